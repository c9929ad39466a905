"""The one timing helper of the project (hmoe calibrate, experiments/common, tools/): on a
shared, noisy machine, repeat, interleave variants, take medians.

- median_time: median (and best/worst) wall time of fn() after a warm-up, optionally with
  an untimed probe before each timed call;
- interleaved_timings: several variants round-robin (A B C A B C ...), so a neighbour's
  load hits them alike;
- side_by_side: calls timed in rounds with a DRAM read probe before each round, so a rate
  is read against the read rate of its own moment (this VM's moves by 2x within minutes).

A call's result is waited for (jax.block_until_ready: any pytree of jax arrays; other
values pass through), so asynchronous dispatch is never timed instead of the work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class RateProbe(Protocol):
    """What side_by_side reads before each round (measure/probes.ReadProbe is one)."""

    def gbps(self) -> float: ...

    def tflops(self) -> float | None: ...

    def stream_gbps(self) -> float | None: ...


@dataclass(frozen=True)
class TimingStats:
    median_s: float
    best_s: float
    worst_s: float
    n: int
    # median process CPU time per call (all threads: memory stalls count, time spent
    # descheduled by a neighbour does not; but a thread waiting on another, e.g. Python
    # blocked on XLA's execution thread, may count too)
    cpu_median_s: float | None = None

    @staticmethod
    def of(samples_s: list[float], cpu_samples_s: list[float] | None = None) -> TimingStats:
        if not samples_s:
            raise ValueError("TimingStats.of: no samples (repeats/rounds must be >= 1)")
        cpu = statistics.median(cpu_samples_s) if cpu_samples_s else None
        return TimingStats(statistics.median(samples_s), min(samples_s), max(samples_s), len(samples_s), cpu)

    def as_dict(self) -> dict[str, float]:
        d = {"median_s": self.median_s, "best_s": self.best_s, "worst_s": self.worst_s, "samples": self.n}
        if self.cpu_median_s is not None:
            d["cpu_median_s"] = self.cpu_median_s
        return d


def wait(out: Any) -> Any:
    """Block until every jax array in `out` (any pytree) is computed; other leaves pass."""
    import jax

    return jax.block_until_ready(out)


def time_once(fn: Callable[[], object]) -> float:
    """Seconds of one fn() call, its result waited for."""
    t0 = time.perf_counter()
    wait(fn())
    return time.perf_counter() - t0


def median_time(
    fn: Callable[[], object],
    repeats: int = 7,
    warmup: int = 1,
    between: Callable[[], object] | None = None,
) -> TimingStats:
    """Median (and best/worst) wall time of fn() over `repeats` calls after `warmup`.
    `between` (untimed) runs before each timed call: e.g. a compute probe, so compute rates
    are read against the probes' median like the reads are."""
    for _ in range(warmup):
        wait(fn())
    samples = []
    for _ in range(repeats):
        if between is not None:
            between()
        samples.append(time_once(fn))
    return TimingStats.of(samples)


def interleaved_timings(
    variants: dict[str, Callable[[], object]],
    rounds: int = 7,
    warmup: int = 1,
    calls_per_sample: int | dict[str, int] = 1,
) -> dict[str, TimingStats]:
    """Time several variants round-robin (A B C A B C ...), so that a neighbour's load hits
    them alike, and return per-variant stats of the time of ONE call (a sample is the mean
    of `calls_per_sample` back-to-back calls, per variant if a dict; use it to rotate
    through a weight set)."""

    def calls(name: str) -> int:
        return calls_per_sample[name] if isinstance(calls_per_sample, dict) else calls_per_sample

    for name, fn in variants.items():
        for _ in range(warmup):
            for _ in range(calls(name)):
                wait(fn())
    samples: dict[str, list[float]] = {name: [] for name in variants}
    cpu_samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            for _ in range(calls(name)):
                wait(fn())
            samples[name].append((time.perf_counter() - t0) / calls(name))
            cpu_samples[name].append((time.process_time() - c0) / calls(name))
    return {name: TimingStats.of(s, cpu_samples[name]) for name, s in samples.items()}


def side_by_side(probe: RateProbe, fn: Callable[[], object], calls: int, rounds: int) -> tuple[float, float]:
    """(median seconds per fn() call, median probe GB/s of the same rounds): each round a
    read probe and a compute probe, then `calls` back-to-back calls (rotate a weight set
    through them so each call reads DRAM). side_by_side_points of one variant."""
    ts, gbps = side_by_side_points(probe, {"fn": fn}, calls, rounds)
    return ts["fn"], gbps


def side_by_side_points(probe: RateProbe, fns: dict, calls: int, rounds: int) -> tuple[dict, float]:
    """Several variants of one measurement ({key: fn}, e.g. ones whose DIFFERENCE matters),
    side by side with the probes: `calls` warm-up calls of each, then every round a read
    probe, a compute probe and a stream probe, then `calls` back-to-back calls of each
    variant, in an order that reverses every round -> ({key: median seconds per call},
    median probe GB/s)."""
    keys = list(fns)
    for k in keys:
        for _ in range(calls):
            wait(fns[k]())
    ts: dict = {k: [] for k in keys}
    bws = []
    for r in range(rounds):
        bws.append(probe.gbps())
        probe.tflops()
        probe.stream_gbps()  # recorded by the probe (calibrate keeps its median)
        for k in keys if r % 2 == 0 else keys[::-1]:
            t = time.perf_counter()
            for _ in range(calls):
                wait(fns[k]())
            ts[k].append((time.perf_counter() - t) / calls)
    return {k: statistics.median(v) for k, v in ts.items()}, statistics.median(bws)
