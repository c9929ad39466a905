"""Runs a Plan against placed weights.

Each op kind has a handler `fn(run, op) -> arrays` that dispatches the op's JAX work and
returns the arrays whose readiness means the op is done; HANDLERS below is the one table of
them (single-device kinds in runtime/ops.py, the dslp/ep kinds in runtime/dist_exec.py; the
state they pass between ops is typed, runtime/run.py). Three modes:

- "pipelined": one worker thread per resource (the paper's loader / compute / unloader
  workers, plus the CPU expert worker); a worker takes its ops in plan order, waits for
  their deps, runs them and blocks until their outputs are ready, so trace slices are
  real execution intervals and different resources overlap.
- "serial": the same ops one at a time in plan order, each finished before the next
  starts: the overlap-disabled baseline of the same plan.
- "async": plan order on the calling thread without blocking, relying on JAX's async
  dispatch (decode steps: the lowest dispatch overhead); slices then show dispatch time.

A new op kind is a handler function plus one line in HANDLERS (and its kind in
plan.OP_KINDS or its schedule's docs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from hmoe_jax.model.moe import ExpertFn
from hmoe_jax.plan.format import Op, Plan, PlanError
from hmoe_jax.runtime import dist_exec, ops
from hmoe_jax.runtime.run import Run

MODES = ("pipelined", "serial", "async")
Handler = Callable[[Run, Op], list[Any]]
HANDLERS: dict[str, Handler] = {
    # single device (cpu, slp, reference schedules)
    "embed": ops.embed,
    "attn": ops.attn,
    "dense_ffn": ops.dense_ffn,
    "route": ops.route,
    "attn_route": ops.attn_route,
    "shared": ops.shared,
    "d2h": ops.d2h,
    "experts_cpu": ops.experts_cpu,
    "h2d": ops.h2d,
    "stage": ops.stage,
    "load": ops.load,
    "experts_acc": ops.experts_acc,
    "unload": ops.unload,
    "combine": ops.combine,
    "final": ops.final,
    "forward": ops.forward,
    # distributed prefill over N accelerators (dslp, ep)
    "dslp_embed": dist_exec.embed,
    "dslp_load": dist_exec.load,
    "dslp_attn": dist_exec.attn,
    "dslp_ffn": dist_exec.ffn,
    "dslp_moe": dist_exec.moe,
    "dslp_unload": dist_exec.unload,
    "dslp_final": dist_exec.final,
}


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
        args.update(run.notes.pop(op.id, ()))  # what the handler measured (copy interval, experts touched)
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

    def worker(mine: list[Op]) -> None:
        try:
            for op in mine:
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
        threading.Thread(target=worker, args=(mine,), name=f"hmoe-{r}", daemon=True)
        for r, mine in by_res.items()
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
