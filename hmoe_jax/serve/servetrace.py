"""Where a served token's time goes: the serving path's slices on the engine's Perfetto
trace (plan/trace.py's TraceRecorder), and the per-output-token breakdown read from them.

Tracks (resources) the serving path adds beside the engine's own (acc:*, cpu_experts, ...):

- `sched`: the scheduler loop, one slice per phase of an iteration: `intake` (new requests
  and cancels), `adopt` (background prefills), `decide` (the serving core and the policy;
  the actions are in the slice's args), `prefill` / `chunk` / `decode` (the engine calls the
  actions run), `emit` (handing the tokens to their handles), and `idle` (the loop waiting
  for work);
- `http`: per streamed token, `wait` (from the scheduler's emit until the event loop took the
  token: the loop was busy or waiting for the GIL), `detok` (incremental detokenisation and
  the SSE chunk's JSON), `send` (the ASGI send of the chunk until the generator resumes);
- `compile`: every JAX trace / lowering / backend compile (jax.monitoring's time spans), so a
  step that compiled a new shape is visible as such.

`hmoe serve --trace FILE` writes the trace at shutdown (`--trace-engine` adds the engine's
per-op slices, which cost a plan per step; off by default so the trace does not slow the
path it measures). `breakdown(slices, tokens)` turns the slices into milliseconds per
output token (docs/serve.md, experiments/e09_serving.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from hmoe_jax.plan.trace import TraceRecorder

SCHED, HTTP, COMPILE = "sched", "http", "compile"
# the scheduler's phases that are engine work (the rest of an iteration is scheduler work)
ENGINE_PHASES = ("prefill", "chunk", "decode")
SCHED_PHASES = ("intake", "adopt", "decide", "emit")
HTTP_PHASES = ("wait", "detok", "send")


def now_ns() -> int:
    return time.perf_counter_ns()


@contextlib.contextmanager
def span(trace: TraceRecorder | None, resource: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Record [enter, exit) as one slice (nothing without a trace). The yielded dict's
    entries are added to the slice's args at exit (e.g. what a step decided)."""
    extra: dict[str, Any] = {}
    if trace is None:
        yield extra
        return
    t0 = now_ns()
    try:
        yield extra
    finally:
        trace.add(resource, name, t0, now_ns(), **args, **extra)


class CompileListener:
    """Adds a `compile` slice for every JAX compile-path time span (tracing, lowering,
    backend compile) while installed; counts backend compiles (`compiles`), so a runner can
    tell whether a step it timed compiled something."""

    PREFIX = "/jax/core/compile/"
    BACKEND = "/jax/core/compile/backend_compile_duration"

    def __init__(self, trace: TraceRecorder | None = None):
        self.trace = trace
        self.compiles = 0
        self._lock = threading.Lock()
        # jax stamps spans with time.time(); the trace runs on perf_counter_ns
        self._offset_ns = time.perf_counter_ns() - time.time_ns()
        self._installed = False

    def __call__(self, event: str, start_s: float, end_s: float, **kw: Any) -> None:
        if not event.startswith(self.PREFIX):
            return
        if event == self.BACKEND:
            with self._lock:
                self.compiles += 1
        if self.trace is not None:
            t0 = int(start_s * 1e9) + self._offset_ns
            t1 = int(end_s * 1e9) + self._offset_ns
            self.trace.add(COMPILE, event[len(self.PREFIX) :], t0, t1, fun=str(kw.get("fun_name", "")))

    def install(self) -> CompileListener:
        import jax.monitoring

        if not self._installed:
            jax.monitoring.register_event_time_span_listener(self)
            self._installed = True
        return self

    def uninstall(self) -> None:
        import jax.monitoring

        if self._installed:
            with contextlib.suppress(ValueError, AssertionError):
                jax.monitoring.unregister_event_time_span_listener(self)
            self._installed = False


def _sum_ms(slices: Iterable[dict[str, Any]], resource: str, name: str) -> float:
    return (
        sum(s["end_ns"] - s["start_ns"] for s in slices if s["resource"] == resource and s["name"] == name)
        / 1e6
    )


def breakdown(
    slices: list[dict[str, Any]], tokens: int, window_ns: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Milliseconds per output token of each part of the serving path, from a serving trace's
    slices (TraceRecorder.slices), over `window_ns` (start, end; default: all slices).

    engine_decode / engine_chunk / engine_prefill: the engine calls the scheduler made;
    compile: JAX compiles inside them (part of those, not extra); scheduler: the loop's own
    work (intake, adopt, decide, emit); idle: the loop waiting for work; http_wait /
    http_detok / http_send: the event loop's per-token path (concurrent with the next step,
    on the same cores: it adds to TPOT only through contention); wall: the window;
    decode_steps and mean_step_ms: the decode calls; unaccounted: wall minus the scheduler
    thread's slices (time the loop spent outside any phase)."""
    if tokens < 1:
        raise ValueError(f"breakdown: tokens must be >= 1, got {tokens}")
    if window_ns is not None:
        lo, hi = window_ns
        slices = [s for s in slices if s["start_ns"] >= lo and s["end_ns"] <= hi]
    if not slices:
        raise ValueError("breakdown: no slices in the window (was the trace recording?)")
    lo = min(s["start_ns"] for s in slices)
    hi = max(s["end_ns"] for s in slices)
    wall_ms = (hi - lo) / 1e6 if window_ns is None else (window_ns[1] - window_ns[0]) / 1e6
    out: dict[str, Any] = {"tokens": tokens, "wall_ms": wall_ms}
    for name in ENGINE_PHASES:
        out[f"engine_{name}"] = _sum_ms(slices, SCHED, name) / tokens
    out["scheduler"] = sum(_sum_ms(slices, SCHED, n) for n in SCHED_PHASES) / tokens
    out["idle"] = _sum_ms(slices, SCHED, "idle") / tokens
    for name in HTTP_PHASES:
        out[f"http_{name}"] = _sum_ms(slices, HTTP, name) / tokens
    out["compile"] = (
        sum(s["end_ns"] - s["start_ns"] for s in slices if s["resource"] == COMPILE) / 1e6 / tokens
    )
    steps = [s for s in slices if s["resource"] == SCHED and s["name"] == "decode"]
    out["decode_steps"] = len(steps)
    out["mean_step_ms"] = _sum_ms(steps, SCHED, "decode") / max(len(steps), 1)
    on_thread = sum(
        s["end_ns"] - s["start_ns"]
        for s in slices
        if s["resource"] == SCHED and s["name"] in (*ENGINE_PHASES, *SCHED_PHASES, "idle")
    )
    out["unaccounted"] = (wall_ms - on_thread / 1e6) / tokens
    out["per_token_wall"] = wall_ms / tokens
    return out


__all__ = ["COMPILE", "HTTP", "SCHED", "CompileListener", "breakdown", "span"]
