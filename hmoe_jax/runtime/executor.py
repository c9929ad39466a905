"""Runs a Plan against placed weights.

Each op kind has a handler `fn(run, op) -> arrays` that dispatches the op's JAX work and
returns the arrays whose readiness means the op is done. Three modes:

- "pipelined": one worker thread per resource (the paper's loader / compute / unloader
  workers, plus the CPU expert worker); a worker takes its ops in plan order, waits for
  their deps, runs them and blocks until their outputs are ready, so trace slices are
  real execution intervals and different resources overlap.
- "serial": the same ops one at a time in plan order, each finished before the next
  starts: the overlap-disabled baseline of the same plan.
- "async": plan order on the calling thread without blocking, relying on JAX's async
  dispatch (decode steps: the lowest dispatch overhead); slices then show dispatch time.

Schedules defined elsewhere (e.g. dslp) add their op kinds with register_op_kind.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.moe import ExpertFn
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.plan.format import Op, Plan, PlanError
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime import pieces
from hmoe_jax.runtime.kvpool import KVPool
from hmoe_jax.runtime.staging import StagingRing, slot_layout
from hmoe_jax.runtime.state import PlacedWeights

MODES = ("pipelined", "serial", "async")
Handler = Callable[["Run", Op], list[Any]]
HANDLERS: dict[str, Handler] = {}


def register_op_kind(kind: str, fn: Handler | None = None):
    """Register the handler of an op kind (usable as a decorator)."""

    def deco(f: Handler) -> Handler:
        HANDLERS[kind] = f
        return f

    return deco(fn) if fn is not None else deco


@dataclasses.dataclass
class Run:
    """State of one plan execution: inputs, the cache, intermediate values, resources."""

    cfg: ModelConfig
    weights: PlacedWeights
    cache: KVPool
    tokens: np.ndarray  # [B, T] int32, the plan's new tokens: B rows decoding (T == 1) or one prefill chunk
    start_pos: int | np.ndarray  # position of tokens[:, 0]: an int (all rows) or [B]
    host_expert_fn: Callable  # jitted ExpertFn on host-device arrays
    rows: np.ndarray | None = None  # [B] pool rows of the sequences (None: rows 0..B-1)
    prec: Precision = F32
    attn: dict[str, Any] = dataclasses.field(default_factory=dict)  # form, q_block, k_block (prefill)
    ring: StagingRing | None = None
    trace: TraceRecorder | None = None
    link_gbps: float | None = None  # cap for activation hops too (weights: the ring's cap)
    acc_tflops_cap: float | None = None  # stand-in compute-rate emulation
    vals: dict[Any, Any] = dataclasses.field(default_factory=dict)
    logits: list[Any] = dataclasses.field(default_factory=list)  # chunks of [B, t, V]
    streamed_bytes: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> bytes loaded
    plan_index: int = 0  # which of the trace's plans this run is (slice arg "plan")
    # Runs executed at the same time (dual-batch decode, a chunk beside a decode step) share
    # one lock per resource: a resource then runs one op at a time across all of them, so
    # the runs alternate on the accelerator and the CPU experts instead of contending, and
    # the KV pool arrays (replaced by each attention op) see one writer at a time.
    locks: dict[str, threading.Lock] | None = None
    label: str | None = None  # trace slice arg "batch" (which micro-batch)

    def __post_init__(self) -> None:
        b = self.tokens.shape[0]
        self.rows = np.arange(b, dtype=np.int32) if self.rows is None else np.asarray(self.rows, np.int32)
        self.positions = np.broadcast_to(np.asarray(self.start_pos, np.int32), (b,)).copy()

    @property
    def acc(self) -> jax.Device:
        return self.weights.placement.acc

    def attn_args(self, t0: int, t1: int) -> tuple[tuple, dict]:
        """(rows, positions) operands and the static options of an attention piece for the
        new tokens [t0, t1): decode steps attend over the rows' first kv_len slots."""
        pos = self.positions + t0
        kw = dict(prec=self.prec, **self.attn)
        if t1 - t0 == 1:
            kw["kv_len"] = decode_kv_len(int(pos.max()) + 1, self.cache.max_len)
        return (self.rows, pos), kw

    def span(self, op: Op) -> tuple[int, int]:
        t0, t1 = op.args.get("tokens", (0, self.tokens.shape[1]))
        return int(t0), int(t1)


def decode_kv_len(tokens: int, max_len: int) -> int:
    """Static prefix a decode step reads: `tokens` (max position + 1) rounded up to a power
    of two >= 64 (a few compiled shapes per batch size), capped at the row length."""
    return min(max_len, max(64, 1 << (max(tokens, 1) - 1).bit_length()))


# ---------------------------------------------------------------- handlers


@register_op_kind("embed")
def _embed(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    tok = jax.device_put(run.tokens[:, t0:t1], run.acc)
    h = pieces.embed(run.weights.acc.embed, tok, run.prec)
    run.vals[("h", t0)] = h
    return [h]


@register_op_kind("attn")
def _attn(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    i = op.layer
    lp = run.weights.acc.layers[i]
    pos_args, kw = run.attn_args(t0, t1)
    h, lat, rope = pieces.attention(
        lp.attn_norm,
        lp.attn,
        run.cfg,
        run.vals[("h", t0)],
        run.cache.latent[i],
        run.cache.rope[i],
        *pos_args,
        **kw,
    )
    run.cache.latent[i], run.cache.rope[i] = lat, rope
    run.vals[("h", t0)] = h
    return [h]


@register_op_kind("dense_ffn")
def _dense(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    h = pieces.dense_ffn(run.weights.acc.layers[op.layer], run.cfg, run.vals[("h", t0)], run.prec)
    run.vals[("h", t0)] = h
    return [h]


@register_op_kind("route")
def _route(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    x, ids, w = pieces.route_tokens(run.weights.acc.layers[op.layer], run.cfg, run.vals[("h", t0)], run.prec)
    run.vals[("route", op.layer, t0)] = (x, ids, w)
    return [x, ids, w]


@register_op_kind("shared")
def _shared(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    x = run.vals[("route", op.layer, t0)][0]
    s = pieces.shared(run.weights.acc.layers[op.layer].ffn.shared, x, run.prec)
    run.vals[("shared", op.layer, t0)] = s
    return [s]


@register_op_kind("attn_route")
def _attn_route(run: Run, op: Op) -> list:
    t0, t1 = run.span(op)
    i = op.layer
    pos_args, kw = run.attn_args(t0, t1)
    kw["with_shared"] = bool(op.args.get("with_shared"))
    h, lat, rope, x, packed = pieces.attn_route(
        run.weights.acc.layers[i],
        run.cfg,
        run.vals[("h", t0)],
        run.cache.latent[i],
        run.cache.rope[i],
        *pos_args,
        **kw,
    )
    run.cache.latent[i], run.cache.rope[i] = lat, rope
    run.vals[("h", t0)] = h
    if op.args.get("with_shared"):
        run.vals[("shared", i, t0)] = x  # the shared expert's output (x itself is not needed)
    else:
        run.vals[("route", i, t0)] = (x, None, None)
    run.vals[("packed", i, t0)] = packed
    return [h, packed]


@register_op_kind("d2h")
def _d2h(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    host = run.weights.placement.host
    packed = run.vals.pop(("packed", op.layer, t0), None)
    if packed is not None:  # one transfer of x | ids | weights (attn_route)
        moved = [jax.device_put(packed, host)]
    else:
        moved = list(jax.device_put(run.vals[("route", op.layer, t0)], host))
    run.vals[("route_host", op.layer, t0)] = moved
    return moved


@functools.cache
def _packed_expert_fn(fn: Callable, hidden: int, k: int) -> Callable:
    return jax.jit(lambda packed, experts: fn(*pieces.unpack_route(packed, hidden, k), experts))


@register_op_kind("experts_cpu")
def _experts_cpu(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    moved = run.vals.pop(("route_host", op.layer, t0))
    experts = run.weights.host_experts_dev[op.layer]
    if run.trace is not None:  # distinct experts this op reads (traced runs only: a host sync)
        d, k = run.cfg.hidden_size, run.cfg.num_experts_per_tok
        ids = np.asarray(moved[0])[:, d : d + k] if len(moved) == 1 else np.asarray(moved[1])
        run.vals[("touched", op.layer, t0)] = int(np.unique(ids).size)
    if len(moved) == 1:
        fn = _packed_expert_fn(run.host_expert_fn, run.cfg.hidden_size, run.cfg.num_experts_per_tok)
        y = fn(moved[0], experts)
    else:
        y = run.host_expert_fn(*moved, experts)
    run.vals[("routed_host", op.layer, t0)] = y
    return [y]


@register_op_kind("h2d")
def _h2d(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    y = jax.device_put(run.vals.pop(("routed_host", op.layer, t0)), run.acc)
    run.vals[("routed", op.layer, t0)] = y
    return [y]


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


@register_op_kind("stage")
def _stage(run: Run, op: Op) -> list:
    """Stager: queue the memcpy of a group from the host weight arena into its host slot and
    return at once; the C++ copy threads run the queued fills back to back (FIFO, the rate
    cap applies there), so the copy of group g+1 proceeds while group g's slot goes to the
    accelerator. Its deps (the unload of the slot's previous group) make the slot free; the
    ring refuses to fill a slot that is not."""
    slot, lo, hi, _, _ = _fill(run, op)
    run.vals[("staged", slot)] = (op.layer, lo, hi)
    return []


@register_op_kind("load")
def _load(run: Run, op: Op) -> list:
    """Loader: wait until the slot's fill (queued by its stage op; by this op itself in
    plans without stage ops) has landed, then hand the slot to the accelerator through the
    ring's fixed device side (StagingRing.to_device: the slot itself on a stand-in, in-place
    writes into preallocated buffers on a GPU)."""
    ring = _staging_ring(run, op)
    slot, lo, hi, host, fields = _slot_group(run, op)
    staged = run.vals.pop(("staged", slot), None)
    if staged is None:  # no stage op: fill here, then wait (copy and hand-off in sequence)
        _fill(run, op)
    elif staged != (op.layer, lo, hi):
        raise PlanError(
            f"op {op.id} (load) expects layer {op.layer} experts [{lo}, {hi}) in slot {slot}, staged: {staged}"
        )
    c0, c1 = ring.wait(slot)
    dev = ring.to_device(slot, fields, hi - lo, host, run.acc)
    run.vals[("slot", slot)] = dev
    run.vals[("copy_ns", op.id)] = (c0, c1)
    if run.trace is not None:  # the C++ memcpy itself, on its own track
        run.trace.add(
            "copy:0", f"copy L{op.layer}", c0, c1, plan=run.plan_index, op=op.id, layer=op.layer, slot=slot
        )
    return jax.tree_util.tree_leaves(dev)


@register_op_kind("experts_acc")
def _experts_acc(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    i = op.layer
    key = ("sorted", i, t0)
    if key not in run.vals:  # first group of the layer: sort its assignments once
        x, ids, w = run.vals[("route", i, t0)]
        token, wts, offsets = pieces.sort_by_expert(ids, w, run.cfg.n_routed_experts)
        # E + 1 ints to the host (one small sync per layer) so each group runs on exactly
        # its rows, with a static bucketed shape.
        run.vals[key] = (token, wts, np.asarray(offsets))
        run.vals[("routed", i, t0)] = jax.numpy.zeros_like(x, jax.numpy.float32)  # f32, on x's device
    x = run.vals[("route", i, t0)][0]
    token, wts, offsets = run.vals[key]
    lo, hi = op.args["experts"]
    sizes = np.diff(offsets[lo : hi + 1]).astype(np.int32)
    n = int(sizes.sum())
    if n == 0:  # no token chose these experts: nothing to add
        return []
    acc = pieces.experts_group(
        x,
        run.vals[("routed", i, t0)],
        token,
        wts,
        np.int32(offsets[lo]),
        sizes,
        run.vals[("slot", int(op.args["slot"]))],
        rows=pieces.row_bucket(n),
        prec=run.prec,
    )
    run.vals[("routed", i, t0)] = acc
    return [acc]


@register_op_kind("unload")
def _unload(run: Run, op: Op) -> list:
    """Unloader: the slot's last reader is done (deps), drop the device view, free the slot."""
    slot = int(op.args["slot"])
    run.vals.pop(("slot", slot), None)
    run.ring.release(slot)
    return []


@register_op_kind("combine")
def _combine(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    i = op.layer
    h = pieces.combine(
        run.vals[("h", t0)], run.vals.pop(("routed", i, t0)), run.vals.pop(("shared", i, t0), None), run.prec
    )
    run.vals.pop(("route", i, t0), None)
    run.vals.pop(("sorted", i, t0), None)
    run.vals[("h", t0)] = h
    return [h]


@register_op_kind("final")
def _final(run: Run, op: Op) -> list:
    t0, _ = run.span(op)
    a = run.weights.acc
    last = op.args.get("rows", "last") == "last"
    lg = pieces.final(a.norm, a.lm_head, run.cfg, run.vals[("h", t0)], last, run.prec)
    run.logits.append(lg)
    return [lg]


@register_op_kind("forward")
def _forward(run: Run, op: Op) -> list:
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


# ---------------------------------------------------------------- execution


def _throttle(run: Run, op: Op, start_ns: int) -> None:
    """Stand-in rate emulation: an op may not finish before its bytes/flops at the cap."""
    due = 0.0
    if run.acc_tflops_cap and op.resource.startswith("acc") and op.flops:
        due = op.flops / (run.acc_tflops_cap * 1e12)
    if run.link_gbps and op.kind in ("d2h", "h2d") and op.bytes:
        due = op.bytes / (run.link_gbps * 1e9)
    left = start_ns / 1e9 + due - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _exec(run: Run, op: Op, block: bool) -> None:
    fn = HANDLERS.get(op.kind)
    if fn is None:
        raise PlanError(f"op {op.id}: no handler for kind {op.kind!r} (known: {sorted(HANDLERS)})")
    lock = run.locks.get(op.resource) if (run.locks is not None and block) else None
    if lock is not None:
        lock.acquire()
    try:
        t0 = time.perf_counter_ns()
        outs = fn(run, op)
        if block:
            jax.block_until_ready(outs)
            _throttle(run, op, t0)
        t1 = time.perf_counter_ns()
    finally:
        if lock is not None:
            lock.release()
    if run.trace is not None:
        name = op.kind if op.layer < 0 else f"{op.kind} L{op.layer}"
        args = {
            "plan": run.plan_index,
            "op": op.id,
            "layer": op.layer,
            "bytes": op.bytes,
            "flops": op.flops,
            **op.args,
        }
        if run.label is not None:
            args["batch"] = run.label
        if ("copy_ns", op.id) in run.vals:
            c0, c1 = run.vals.pop(("copy_ns", op.id))
            args.update(copy_start_ns=c0, copy_end_ns=c1)
        run.trace.add(op.resource, name, t0, t1, **args)


def execute(plan: Plan, run: Run, mode: str = "pipelined") -> float:
    """Run every op of `plan`; returns wall seconds (all outputs ready)."""
    if mode not in MODES:
        raise ValueError(f"execute: mode {mode!r} not in {MODES}")
    start = time.perf_counter()
    if mode != "pipelined" or len(plan.resources()) == 1:
        for op in plan.ops:
            _exec(run, op, block=mode != "async")
        jax.block_until_ready(run.logits)
        return time.perf_counter() - start

    done = [threading.Event() for _ in plan.ops]
    errors: list[BaseException] = []

    def worker(ops: list[Op]) -> None:
        try:
            for op in ops:
                for d in op.deps:
                    done[d].wait()
                    if errors:
                        return
                _exec(run, op, block=True)
                done[op.id].set()
        except BaseException as e:  # surface in the caller, release everyone waiting
            errors.append(e)
            for ev in done:
                ev.set()

    by_res: dict[str, list[Op]] = {}
    for op in plan.ops:
        by_res.setdefault(op.resource, []).append(op)
    threads = [
        threading.Thread(target=worker, args=(ops,), name=f"hmoe-{r}", daemon=True)
        for r, ops in by_res.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    jax.block_until_ready(run.logits)
    return time.perf_counter() - start


def jit_host_expert_fn(expert_fn: ExpertFn) -> Callable:
    return jax.jit(expert_fn)


def shared_locks(*plans: Plan) -> dict[str, threading.Lock]:
    """One lock per resource any of `plans` uses (Run.locks for runs executed together)."""
    return {r: threading.Lock() for p in plans for r in p.resources()}
