"""Handlers of the op kinds of the `dslp` / `ep` plans (schedules/dslp.py), listed in the
executor's table (runtime/executor.py), on the engine's staging ring (runtime/staging.py).
Their state is the run's DslpState (runtime/run.py), created by dslp_embed.

Op kinds (resource in brackets; N ranks = the first N accelerators of the placement):
- dslp_embed  [acc:all]  tokens -> zig-zag-ordered hidden states sharded over the ranks
- dslp_load   [h2d:r]    rank r's share of one layer: its experts [r E/N, (r+1) E/N)
                         through a ring slot (C++ copy threads, optional rate cap), then
                         host -> rank r's device; plus the layer's non-expert weights,
                         except where args.rest == "resident" (rank 0: the engine placed
                         them on accelerator 0 = mesh device 0 already; reused, not copied)
- dslp_attn   [acc:all]  context-parallel MLA of the layer; writes its latent cache
- dslp_ffn    [acc:all]  dense FFN on the sequence owners
- dslp_moe    [acc:all]  SmallEP (or standard EP) MoE over the ranks
- dslp_unload [unload:r] frees rank r's slot once the MoE that read it is done
- dslp_final  [acc:all]  final norm + lm_head on the owners (last token or all)
Collective ops span all ranks in lock-step, hence the one `acc:all` track; the per-rank
copies have their own tracks. Results go where the engine's decode expects them: the
latent cache into the sequence's row of run.cache (the KV pool on the first accelerator), logits into
run.logits; each rank's copies into run.dslp.streamer.log, the MoE's actual collective
bytes into run.dslp.comm.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hmoe_jax.model.moe import experts_ref
from hmoe_jax.parallel.mesh import AXIS, make_mesh
from hmoe_jax.parallel.moe import expert_bytes_view
from hmoe_jax.parallel.prefill import (
    attn_fn,
    check_dropped,
    embed_fn,
    ffn_fn,
    grouped_expert_fn,
    last_logits_fn,
    logits_fn,
    moe_comm_record,
    split_layer,
)
from hmoe_jax.plan.costs import CP_BLOCK
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.plan.format import Op, PlanError
from hmoe_jax.runtime.dist_stream import RankStreamer
from hmoe_jax.runtime.run import DslpState, Run
from hmoe_jax.runtime.staging import slot_layout

# acc_experts: "grouped" = grouped GEMMs under the run's policy (parallel/prefill.py
# grouped_expert_fn: the FP8 grouped hook, or a few experts dequantized at a time), "ref" =
# experts_ref (every local expert on every token, f32)
ACC_EXPERTS = ("grouped", "ref")


def _state(run: Run) -> DslpState:
    st = run.dslp
    if st is None:
        raise PlanError("dslp op before dslp_embed: the plan must start with dslp_embed")
    return st


@functools.cache
def _cache_writer(t: int):
    """pool layer [N, S_max, X] <- new[0, :t] at row `row` (natural-order rows of the real tokens)."""
    return jax.jit(lambda c, new, row: c.at[row, :t].set(new[0, :t].astype(c.dtype)), donate_argnums=0)


def _resident_rank(run: Run, st: DslpState) -> int | None:
    """The mesh rank whose device holds the engine's resident (decode) weights, or None."""
    acc = run.weights.placement.acc
    for r in st.streamer.local_ranks:
        if st.streamer.device(r) == acc:
            return r
    return None


def _replicated(run: Run, st: DslpState, layer: int, host_tree: Any, resident_tree: Any) -> Any:
    """host_tree on every rank: the rank on the resident accelerator reuses resident_tree
    (the same weights, already there: no copy, nothing logged), the others get a copy."""
    r0 = _resident_rank(run, st)
    same = r0 is not None and jax.tree_util.tree_structure(host_tree) == jax.tree_util.tree_structure(
        resident_tree
    )
    pieces = {
        r: resident_tree if (same and r == r0) else st.streamer.rank_copy(layer, r, host_tree, "replicated")
        for r in st.streamer.local_ranks
    }
    return st.streamer.assemble_replicated(pieces)


def _resident_layer(run: Run, i: int) -> Any:
    """Layer i's non-expert weights as the engine placed them, without the absorbed copies
    (w_uk / w_uv, which the f32 dslp bodies do not use): the host layer's tree."""
    lp = split_layer(run.weights.acc.layers[i])[0]
    return lp.replace(attn=lp.attn.replace(w_uk=None, w_uv=None))


def embed(run: Run, op: Op) -> list:
    if run.tokens.shape[0] != 1:
        raise PlanError(f"op {op.id}: dslp prefills one sequence, got {run.tokens.shape[0]}")
    if run.start_pos != 0:
        raise PlanError(f"op {op.id}: dslp prefills from position 0, got start_pos={run.start_pos}")
    n = int(op.args["ranks"])
    accs = run.weights.placement.accelerators
    if len(accs) < n:
        raise PlanError(f"op {op.id}: dslp plan for {n} ranks, placement has {len(accs)} accelerators")
    mesh = make_mesh(n, accs)
    b, t = run.tokens.shape
    layout = ZigzagLayout.for_sequence(t, n)
    name = op.args.get("acc_experts", "grouped")
    if name not in ACC_EXPERTS:
        raise PlanError(f"op {op.id}: acc_experts={name!r}, expected one of {list(ACC_EXPERTS)}")
    st = DslpState(
        mesh,
        layout,
        RankStreamer(mesh),
        str(op.args["scheme"]),
        op.args.get("ep_capacity"),
        grouped_expert_fn(run.prec) if name == "grouped" else experts_ref,
    )
    run.dslp = st
    tok_zz = np.pad(run.tokens, ((0, 0), (0, layout.padded_len - t)))[:, layout.order].astype(np.int32)
    table = _replicated(run, st, -1, run.weights.host.embed, run.weights.acc.embed)
    st.h = embed_fn(mesh, run.prec)(table, jax.device_put(tok_zz, NamedSharding(mesh, P(None, AXIS))))
    return [st.h]


def load(run: Run, op: Op) -> list:
    st = _state(run)
    i, r, slot = op.layer, int(op.args["rank"]), int(op.args.get("slot", -1))
    rest, experts = split_layer(run.weights.host.layers[i])
    resident = op.args.get("rest") == "resident" and r == _resident_rank(run, st)
    if not resident:  # the resident rank's share is taken at dslp_attn (_layer_rest)
        st.rest[i, r] = st.streamer.rank_copy(i, r, rest, "replicated")
    exp_dev = None
    if experts is not None:
        lo, hi = op.args["experts"]
        if slot >= 0:
            if run.ring is None:
                raise PlanError(
                    f"op {op.id} (dslp_load) uses ring slot {slot} but the run has no staging ring"
                )
            fields, _ = slot_layout(experts, hi - lo)
            n = run.ring.fill_experts(slot, experts, lo, hi, fields)
            c0, c1 = run.ring.wait(slot)
            run.note(op, copy_start_ns=c0, copy_end_ns=c1)
            part = run.ring.views(slot, fields, hi - lo, experts)
        else:
            part = jax.tree_util.tree_map(lambda x: x[lo:hi], experts)
            n = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(part))
        # FP8 as bytes (a numpy view): the grouped ExpertFn bitcasts one chunk at a time.
        exp_dev = st.streamer.rank_copy(i, r, expert_bytes_view(part), "experts", (lo, hi))
        run.streamed_bytes[i] = run.streamed_bytes.get(i, 0) + n
        st.experts[i, r] = exp_dev
    return jax.tree_util.tree_leaves((st.rest.get((i, r)), exp_dev))


def _layer_rest(run: Run, st: DslpState, i: int) -> Any:
    """Layer i's non-expert weights replicated over the mesh: the loads' copies, and on the
    resident rank the engine's own (its load did not copy them)."""
    if i not in st.layer_rest:
        host = split_layer(run.weights.host.layers[i])[0]
        r0 = _resident_rank(run, st)
        pieces = {}
        for r in st.streamer.local_ranks:
            got = st.rest.pop((i, r), None)
            if got is None and r == r0:
                got = _resident_layer(run, i)
                if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(host):
                    got = st.streamer.rank_copy(i, r, host, "replicated")
            if got is None:
                raise PlanError(f"dslp_attn of layer {i}: no non-expert weights loaded for rank {r}")
            pieces[r] = got
        st.layer_rest[i] = st.streamer.assemble_replicated(pieces)
    return st.layer_rest[i]


def _layer_experts(run: Run, st: DslpState, i: int) -> Any:
    """Layer i's routed experts sharded P(AXIS) from every rank's load."""
    like = split_layer(run.weights.host.layers[i])[1]
    pieces = {r: st.experts.pop((i, r)) for r in st.streamer.local_ranks}
    return st.streamer.assemble_sharded(pieces, like)


def attn(run: Run, op: Op) -> list:
    st = _state(run)
    i = op.layer
    rest = _layer_rest(run, st, i)
    f = attn_fn(
        st.mesh,
        run.cfg,
        st.layout,
        run.prec,
        int(op.args.get("block", CP_BLOCK)),
        int(op.args.get("head_groups", 1)),
    )
    h, lat, rop = f(rest, st.h)
    t = run.tokens.shape[1]
    acc = run.weights.placement.acc
    row = np.int32(run.rows[0])
    run.cache.latent[i] = _cache_writer(t)(run.cache.latent[i], jax.device_put(lat, acc), row)
    run.cache.rope[i] = _cache_writer(t)(run.cache.rope[i], jax.device_put(rop, acc), row)
    st.h = h
    return [h, run.cache.latent[i], run.cache.rope[i]]


def ffn(run: Run, op: Op) -> list:
    st = _state(run)
    rest = st.layer_rest.pop(op.layer)
    for r in st.streamer.local_ranks:
        st.experts.pop((op.layer, r), None)
    st.h = ffn_fn(st.mesh, run.cfg, False, st.scheme, st.expert_fn, None, run.prec)(rest, None, st.h)
    return [st.h]


def moe(run: Run, op: Op) -> list:
    st = _state(run)
    i = op.layer
    rest, experts = st.layer_rest.pop(i), _layer_experts(run, st, i)
    f = ffn_fn(st.mesh, run.cfg, True, st.scheme, st.expert_fn, st.capacity, run.prec)
    h, ids, dropped = f(rest, experts, st.h)
    check_dropped(dropped, i, st.capacity)
    n, b = st.layout.n_ranks, run.tokens.shape[0]
    act_bytes = np.dtype(run.prec.act_dtype).itemsize  # the payloads' dtype (parallel/moe.py)
    rec = moe_comm_record(run.cfg, n, st.layout.padded_len * b, st.scheme, ids, act_bytes)
    st.comm.append({"layer": i, **rec})
    st.h = h
    return [h]


def unload(run: Run, op: Op) -> list:
    slot = int(op.args.get("slot", -1))
    if slot >= 0:
        run.ring.release(slot)
    return []


def final(run: Run, op: Op) -> list:
    st = _state(run)
    norm, lm_head = _replicated(
        run,
        st,
        run.cfg.num_hidden_layers,
        (run.weights.host.norm, run.weights.host.lm_head),
        (run.weights.acc.norm, run.weights.acc.lm_head),
    )
    h, lay = st.h, st.layout
    st.h = None
    t = run.tokens.shape[1]
    acc = run.weights.placement.acc
    if op.args.get("rows", "last") == "all":
        lz = logits_fn(st.mesh, run.cfg, run.prec)(norm, lm_head, h)  # [B, S_pad, V] zig-zag
        lg = jax.device_put(lz[:, lay.inverse[:t]], acc)  # [B, T, V]
    else:
        rank, local = lay.owner_of_last
        lg = jax.device_put(
            last_logits_fn(run.cfg, rank * lay.local_len + local, run.prec)(norm, lm_head, h), acc
        )[:, None]
    run.logits.append(lg)
    return [lg]
