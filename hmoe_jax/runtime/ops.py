"""Handlers of the single-device op kinds (plan.OP_KINDS: the cpu, slp and reference
schedules). Each is `fn(run, op) -> arrays`: it dispatches the op's JAX work, keeps what
later ops of the plan need in the run's typed state (runtime/run.py: the chunk's hidden
states, a MoE layer's routing and expert outputs, the ring slots) and returns the arrays
whose readiness means the op is done. runtime/executor.py maps op kinds to them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hmoe_jax.plan.format import Op, PlanError
from hmoe_jax.runtime import hops, pieces
from hmoe_jax.runtime.run import Run
from hmoe_jax.runtime.staging import StagingRing, slot_layout


def embed(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    tok = jax.device_put(run.tokens[:, t0:t1], run.acc)
    c = run.chunk(op)
    c.h = pieces.embed(run.weights.acc.embed, tok, run.prec)
    return [c.h]


def attn(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    i = op.layer
    lp = run.weights.acc.layers[i]
    pos_args, kw = run.attn_args(t0, t1)
    c = run.chunk(op)
    decode = t1 - t0 == 1
    h, lat, rope = (pieces.attention_decode if decode else pieces.attention)(
        lp.attn_norm,
        lp.attn,
        run.cfg,
        c.h,
        run.cache.latent[i],
        run.cache.rope[i],
        *pos_args,
        **kw,
    )
    _keep_kv(run, i, decode, pos_args, lat, rope)
    c.h = h
    return [h]


def _keep_kv(run: Run, i: int, decode: bool, pos_args: tuple, lat, rope) -> None:
    """Layer i's pool arrays after an attention piece: the piece's own (a prefill chunk
    wrote them in place), or, after a decode step, the pool with the step's new keys
    (lat, rope) written by a second, in-place dispatch (pieces.write_kv: the piece only
    read the pool; model.attention.decode_attention_unwritten says why)."""
    if decode:
        lat, rope = pieces.write_kv(run.cache.latent[i], run.cache.rope[i], *pos_args, lat, rope)
    run.cache.latent[i], run.cache.rope[i] = lat, rope


def dense_ffn(run: Run, op: Op) -> list:
    c = run.chunk(op)
    c.h = pieces.dense_ffn(run.weights.acc.layers[op.layer], run.cfg, c.h, run.prec)
    return [c.h]


def route(run: Run, op: Op) -> list:
    c = run.chunk(op)
    m = c.layer(op.layer)
    m.x, m.ids, m.weights = pieces.route_tokens(run.weights.acc.layers[op.layer], run.cfg, c.h, run.prec)
    return [m.x, m.ids, m.weights]


def shared(run: Run, op: Op) -> list:
    m = run.chunk(op).layer(op.layer)
    m.shared = pieces.shared(run.weights.acc.layers[op.layer].ffn.shared, m.x, run.prec)
    return [m.shared]


def attn_route(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    i = op.layer
    pos_args, kw = run.attn_args(t0, t1)
    kw["with_shared"] = bool(op.args.get("with_shared"))
    c = run.chunk(op)
    decode = t1 - t0 == 1
    h, lat, rope, x, packed = (pieces.attn_route_decode if decode else pieces.attn_route)(
        run.weights.acc.layers[i],
        run.cfg,
        c.h,
        run.cache.latent[i],
        run.cache.rope[i],
        *pos_args,
        **kw,
    )
    _keep_kv(run, i, decode, pos_args, lat, rope)
    c.h = h
    m = c.layer(i)
    if op.args.get("with_shared"):
        m.shared = x  # the shared expert's output (x itself is not needed)
    else:
        m.x = x
    m.packed = packed
    return [h, packed]


def d2h(run: Run, op: Op) -> list:
    m = run.chunk(op).layer(op.layer)
    packed, m.packed = m.packed, None
    # one transfer of the packed x | ids | weights (attn_route), else the three arrays
    send = [packed] if packed is not None else [m.x, m.ids, m.weights]
    mode = run.hop_mode
    m.host_in = [hops.to_host(a, run.acc, run.weights.placement.host, mode) for a in send]
    run.note(op, moved_bytes=hops.moved_bytes(send), transfers=len(send), hop_memory=mode)
    return m.host_in


@functools.cache
def _host_expert_fn(fn: Callable, hidden: int, k: int, packed: bool, out_dtype: Any) -> Callable:
    """The host's routed-expert call as one jitted computation: unpack the hop (packed),
    run the expert function (f32 out), and round its output to the hop dtype (`out_dtype`,
    the policy's activation dtype: bf16 under the bf16 policy, so the return hop moves 2
    bytes per value; combine sums it with the shared output in f32, as before)."""

    def call(*args):
        *moved, experts = args
        inputs = pieces.unpack_hop(moved[0], hidden, k) if packed else moved
        return fn(*inputs, experts).astype(out_dtype)

    return jax.jit(call)


def experts_cpu(run: Run, op: Op) -> list:
    m = run.chunk(op).layer(op.layer)
    moved, m.host_in = m.host_in, None
    experts = run.weights.host_experts_dev[op.layer]
    d, k = run.cfg.hidden_size, run.cfg.num_experts_per_tok
    packed = len(moved) == 1
    if run.trace is not None:  # distinct experts this op reads (traced runs only: a host sync)
        ids = pieces.unpack_hop(moved[0], d, k)[1] if packed else moved[1]
        run.note(op, experts_touched=int(np.unique(np.asarray(ids)).size))
    fn = _host_expert_fn(run.host_expert_fn, d, k, packed, np.dtype(run.prec.act_dtype))
    m.host_out = fn(*moved, experts)
    return [m.host_out]


def h2d(run: Run, op: Op) -> list:
    m = run.chunk(op).layer(op.layer)
    y, m.host_out = m.host_out, None
    m.routed = hops.to_acc(y, run.acc, run.hop_mode)
    run.note(op, moved_bytes=hops.moved_bytes([y]), transfers=1, hop_memory=run.hop_mode)
    return [m.routed]


def _staging_ring(run: Run, op: Op) -> StagingRing:
    if run.ring is None:
        raise PlanError(
            f"op {op.id} ({op.kind}) needs a staging ring; the engine creates one for plans with ring_slots"
        )
    return run.ring


def _slot_group(run: Run, op: Op) -> tuple[int, int, int, Any, list]:
    """(slot, lo, hi, the layer's host experts, the slot's field layout) of a stage/load op."""
    lo, hi = op.args["experts"]
    host = run.weights.host_experts[op.layer]
    return int(op.args["slot"]), int(lo), int(hi), host, slot_layout(host, hi - lo)[0]


def _fill(run: Run, op: Op) -> tuple[int, int, int, Any, list]:
    """Queue the memcpy of the op's expert group into its host slot (C++ copy threads) and
    count the streamed bytes; returns _slot_group's tuple."""
    slot, lo, hi, host, fields = g = _slot_group(run, op)
    n = _staging_ring(run, op).fill_experts(slot, host, lo, hi, fields)
    run.streamed_bytes[op.layer] = run.streamed_bytes.get(op.layer, 0) + n
    return g


def stage(run: Run, op: Op) -> list:
    """Stager: queue the memcpy of a group from the host weight arena into its host slot and
    return at once; the C++ copy threads run the queued fills back to back (FIFO, the rate
    cap applies there), so the copy of group g+1 proceeds while group g's slot goes to the
    accelerator. Its deps (the unload of the slot's previous group) make the slot free; the
    ring refuses to fill a slot that is not."""
    slot, lo, hi, _, _ = _fill(run, op)
    run.staged[slot] = (op.layer, lo, hi)
    return []


def load(run: Run, op: Op) -> list:
    """Loader: wait until the slot's fill (queued by its stage op; by this op itself in
    plans without stage ops) has landed, then hand the slot to the accelerator through the
    ring's fixed device side (StagingRing.to_device: the slot itself on a stand-in, in-place
    writes into preallocated buffers on a GPU)."""
    ring = _staging_ring(run, op)
    slot, lo, hi, host, fields = _slot_group(run, op)
    staged = run.staged.pop(slot, None)
    if staged is None:  # no stage op: fill here, then wait (copy and hand-off in sequence)
        _fill(run, op)
    elif staged != (op.layer, lo, hi):
        raise PlanError(
            f"op {op.id} (load) expects layer {op.layer} experts [{lo}, {hi}) in slot {slot}, staged: {staged}"
        )
    c0, c1 = ring.wait(slot)
    dev = ring.to_device(slot, fields, hi - lo, host, run.acc)
    run.loaded[slot] = dev
    run.note(op, copy_start_ns=c0, copy_end_ns=c1)
    if run.trace is not None:  # the C++ memcpy itself, on its own track
        run.trace.add(
            "copy:0", f"copy L{op.layer}", c0, c1, plan=run.plan_index, op=op.id, layer=op.layer, slot=slot
        )
    return jax.tree_util.tree_leaves(dev)


def experts_acc(run: Run, op: Op) -> list:
    m = run.chunk(op).layer(op.layer)
    if m.sorted is None:  # first group of the layer: sort its assignments once
        token, wts, offsets = pieces.sort_by_expert(m.ids, m.weights, run.cfg.n_routed_experts)
        # E + 1 ints to the host (one small sync per layer) so each group runs on exactly
        # its rows, with a static bucketed shape.
        m.sorted = (token, wts, np.asarray(offsets))
        m.routed = jax.numpy.zeros_like(m.x, jax.numpy.float32)  # f32, on x's device
    token, wts, offsets = m.sorted
    lo, hi = op.args["experts"]
    sizes = np.diff(offsets[lo : hi + 1]).astype(np.int32)
    n = int(sizes.sum())
    if n == 0:  # no token chose these experts: nothing to add
        return []
    m.routed = pieces.experts_group(
        m.x,
        m.routed,
        token,
        wts,
        np.int32(offsets[lo]),
        sizes,
        run.loaded[int(op.args["slot"])],
        rows=pieces.row_bucket(n),
        prec=run.prec,
    )
    return [m.routed]


def unload(run: Run, op: Op) -> list:
    """Unloader: the slot's last reader is done (deps), drop the device view, free the slot."""
    slot = int(op.args["slot"])
    run.loaded.pop(slot, None)
    run.ring.release(slot)
    return []


def combine(run: Run, op: Op) -> list:
    c = run.chunk(op)
    m = c.moe.pop(op.layer)  # the layer's routing and expert outputs end here
    c.h = pieces.combine(c.h, m.routed, m.shared, run.prec)
    return [c.h]


def final(run: Run, op: Op) -> list:
    a = run.weights.acc
    last = op.args.get("rows", "last") == "last"
    last_at = None
    if last and run.real_tokens is not None:  # a padded prefill: the last REAL token's logits
        t0, t1 = run.span(op)
        if not t0 < run.real_tokens <= t1:
            raise PlanError(
                f"op {op.id} (final): chunk [{t0}, {t1}) lacks the last real token {run.real_tokens - 1}"
            )
        last_at = np.asarray(run.real_tokens - 1 - t0, np.int32)
    lg = pieces.final(a.norm, a.lm_head, run.cfg, run.chunk(op).h, last, run.prec, last_at)
    run.logits.append(lg)
    return [lg]


def forward(run: Run, op: Op) -> list:
    from hmoe_jax.model.model import forward

    if run.tokens.shape[0] != 1:
        raise PlanError(
            f"op {op.id} (forward): the reference schedule runs one sequence, got {run.tokens.shape[0]}"
        )
    row = int(run.rows[0])
    lg, cache = forward(
        run.weights.acc_full(),
        run.cfg,
        jax.device_put(run.tokens, run.acc),
        jax.device_put(run.cache.row_cache(row), run.acc),
        int(run.positions[0]),
    )
    run.cache.set_row(row, cache)
    run.logits.append(lg)
    return [lg]
