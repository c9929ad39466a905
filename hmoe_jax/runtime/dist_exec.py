"""Executor op kinds of the `dslp` / `ep` plans (schedules/dslp.py), on the engine's
executor (runtime/executor.py) and staging ring (runtime/staging.py).

Op kinds (resource in brackets; N ranks = the first N accelerators of the placement):
- dslp_embed  [acc:all]  tokens -> zig-zag-ordered hidden states sharded over the ranks
- dslp_load   [h2d:r]    rank r's share of one layer: its experts [r E/N, (r+1) E/N)
                         through a ring slot (C++ copy threads, optional rate cap), then
                         host -> rank r's device; plus the layer's non-expert weights
- dslp_attn   [acc:all]  context-parallel MLA of the layer; writes its latent cache
- dslp_ffn    [acc:all]  dense FFN on the sequence owners
- dslp_moe    [acc:all]  SmallEP (or standard EP) MoE over the ranks
- dslp_unload [unload:r] frees rank r's slot once the MoE that read it is done
- dslp_final  [acc:all]  final norm + lm_head on the owners (last token or all)
Collective ops span all ranks in lock-step, hence the one `acc:all` track; the per-rank
copies have their own tracks. Results go where the engine's decode expects them: the
latent cache into run.cache (LayerCache on the first accelerator), logits into
run.logits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.parallel.mesh import AXIS
from hmoe_jax.parallel.moe import grouped_experts_fn
from hmoe_jax.parallel.prefill import (
    attn_fn,
    check_dropped,
    embed_fn,
    ffn_fn,
    last_logits_fn,
    logits_fn,
    moe_comm_record,
    split_layer,
)
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.plan.format import Op, PlanError
from hmoe_jax.runtime.dist_stream import RankStreamer
from hmoe_jax.runtime.executor import Run, register_op_kind
from hmoe_jax.runtime.staging import slot_layout


@dataclasses.dataclass
class DslpState:
    mesh: Mesh
    layout: ZigzagLayout
    streamer: RankStreamer
    scheme: str
    capacity: int | None
    expert_fn: ExpertFn  # the accelerator's routed-expert function (grouped GEMMs by default)
    comm: list[dict] = dataclasses.field(default_factory=list)


ACC_EXPERTS = {
    "grouped": grouped_experts_fn(8),
    "ref": experts_ref,
}  # grouped: 8 experts dequantized at a time


def _state(run: Run) -> DslpState:
    st = run.vals.get("dslp")
    if st is None:
        raise PlanError("dslp op before dslp_embed: the plan must start with dslp_embed")
    return st


@functools.cache
def _cache_writer(t: int):
    """pool layer [N, S_max, X] <- new[0, :t] at row `row` (natural-order rows of the real tokens)."""
    return jax.jit(lambda c, new, row: c.at[row, :t].set(new[0, :t].astype(c.dtype)), donate_argnums=0)


@register_op_kind("dslp_embed")
def _embed(run: Run, op: Op) -> list:
    if run.tokens.shape[0] != 1:
        raise PlanError(f"op {op.id}: dslp prefills one sequence, got {run.tokens.shape[0]}")
    if run.start_pos != 0:
        raise PlanError(f"op {op.id}: dslp prefills from position 0, got start_pos={run.start_pos}")
    n = int(op.args["ranks"])
    accs = run.weights.placement.accelerators
    if len(accs) < n:
        raise PlanError(f"op {op.id}: dslp plan for {n} ranks, placement has {len(accs)} accelerators")
    mesh = Mesh(np.array(accs[:n]), (AXIS,))
    b, t = run.tokens.shape
    layout = ZigzagLayout.for_sequence(t, n)
    name = op.args.get("acc_experts", "grouped")
    if name not in ACC_EXPERTS:
        raise PlanError(f"op {op.id}: acc_experts={name!r}, expected one of {sorted(ACC_EXPERTS)}")
    st = DslpState(
        mesh,
        layout,
        RankStreamer(mesh),
        str(op.args["scheme"]),
        op.args.get("ep_capacity"),
        ACC_EXPERTS[name],
    )
    run.vals["dslp"] = st
    tok_zz = np.pad(run.tokens, ((0, 0), (0, layout.padded_len - t)))[:, layout.order].astype(np.int32)
    table = st.streamer.replicated(-1, run.weights.host.embed)
    h = embed_fn(mesh)(table, jax.device_put(tok_zz, NamedSharding(mesh, P(None, AXIS))))
    run.vals["dslp_h"] = h
    return [h]


@register_op_kind("dslp_load")
def _load(run: Run, op: Op) -> list:
    st = _state(run)
    i, r, slot = op.layer, int(op.args["rank"]), int(op.args.get("slot", -1))
    rest, experts = split_layer(run.weights.host.layers[i])
    rest_dev = st.streamer.rank_copy(i, r, rest, "replicated")
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
            run.vals[("copy_ns", op.id)] = run.ring.wait(slot)
            part = run.ring.views(slot, fields, hi - lo, experts)
        else:
            part = jax.tree_util.tree_map(lambda x: x[lo:hi], experts)
            n = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(part))
        exp_dev = st.streamer.rank_copy(i, r, part, "experts", (lo, hi))
        run.streamed_bytes[i] = run.streamed_bytes.get(i, 0) + n
    run.vals[("dslp_w", i, r)] = (rest_dev, exp_dev)
    return jax.tree_util.tree_leaves((rest_dev, exp_dev))


def _layer_weights(run: Run, st: DslpState, i: int) -> tuple[Any, Any]:
    key = ("dslp_layer", i)
    if key not in run.vals:
        ranks = st.streamer.local_ranks
        pieces = {r: run.vals.pop(("dslp_w", i, r)) for r in ranks}
        rest = st.streamer.assemble_replicated({r: p[0] for r, p in pieces.items()})
        experts = None
        if pieces[ranks[0]][1] is not None:
            like = split_layer(run.weights.host.layers[i])[1]
            experts = st.streamer.assemble_sharded({r: p[1] for r, p in pieces.items()}, like)
        run.vals[key] = (rest, experts)
    return run.vals[key]


@register_op_kind("dslp_attn")
def _attn(run: Run, op: Op) -> list:
    st = _state(run)
    i = op.layer
    rest, _ = _layer_weights(run, st, i)
    h, lat, rop = attn_fn(st.mesh, run.cfg, st.layout)(rest, run.vals["dslp_h"])
    t = run.tokens.shape[1]
    acc = run.weights.placement.acc
    row = np.int32(run.rows[0])
    run.cache.latent[i] = _cache_writer(t)(run.cache.latent[i], jax.device_put(lat, acc), row)
    run.cache.rope[i] = _cache_writer(t)(run.cache.rope[i], jax.device_put(rop, acc), row)
    run.vals["dslp_h"] = h
    return [h, run.cache.latent[i], run.cache.rope[i]]


@register_op_kind("dslp_ffn")
def _ffn(run: Run, op: Op) -> list:
    st = _state(run)
    rest, _ = run.vals.pop(("dslp_layer", op.layer))
    h = ffn_fn(st.mesh, run.cfg, False, st.scheme, st.expert_fn, None)(rest, None, run.vals["dslp_h"])
    run.vals["dslp_h"] = h
    return [h]


@register_op_kind("dslp_moe")
def _moe(run: Run, op: Op) -> list:
    st = _state(run)
    i = op.layer
    rest, experts = run.vals.pop(("dslp_layer", i))
    f = ffn_fn(st.mesh, run.cfg, True, st.scheme, st.expert_fn, st.capacity)
    h, ids, dropped = f(rest, experts, run.vals["dslp_h"])
    check_dropped(dropped, i, st.capacity)
    n, b = st.layout.n_ranks, run.tokens.shape[0]
    st.comm.append({"layer": i, **moe_comm_record(run.cfg, n, st.layout.padded_len * b, st.scheme, ids)})
    run.vals["dslp_h"] = h
    return [h]


@register_op_kind("dslp_unload")
def _unload(run: Run, op: Op) -> list:
    slot = int(op.args.get("slot", -1))
    if slot >= 0:
        run.ring.release(slot)
    return []


@register_op_kind("dslp_final")
def _final(run: Run, op: Op) -> list:
    st = _state(run)
    norm, lm_head = st.streamer.replicated(
        run.cfg.num_hidden_layers, (run.weights.host.norm, run.weights.host.lm_head)
    )
    h, lay = run.vals.pop("dslp_h"), st.layout
    t = run.tokens.shape[1]
    acc = run.weights.placement.acc
    if op.args.get("rows", "last") == "all":
        lz = logits_fn(st.mesh, run.cfg)(norm, lm_head, h)  # [B, S_pad, V] zig-zag
        lg = jax.device_put(lz[:, lay.inverse[:t]], acc)  # [B, T, V]
    else:
        rank, local = lay.owner_of_last
        lg = jax.device_put(last_logits_fn(run.cfg, rank * lay.local_len + local)(norm, lm_head, h), acc)[
            :, None
        ]
    run.logits.append(lg)
    return [lg]
