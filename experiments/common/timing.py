"""Timing helpers for a shared, noisy machine: repeat, interleave variants, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


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
        cpu = statistics.median(cpu_samples_s) if cpu_samples_s else None
        return TimingStats(statistics.median(samples_s), min(samples_s), max(samples_s), len(samples_s), cpu)

    def as_dict(self) -> dict[str, float]:
        d = {"median_s": self.median_s, "best_s": self.best_s, "worst_s": self.worst_s, "samples": self.n}
        if self.cpu_median_s is not None:
            d["cpu_median_s"] = self.cpu_median_s
        return d


def _time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    out = fn()
    if hasattr(out, "block_until_ready"):
        out.block_until_ready()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> TimingStats:
    """Median (and best/worst) wall time of fn() over `repeats` calls after `warmup`.
    fn's result is waited for (block_until_ready) when it is a jax array."""
    for _ in range(warmup):
        _time_once(fn)
    return TimingStats.of([_time_once(fn) for _ in range(repeats)])


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
                _time_once(fn)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    cpu_samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            out = None
            for _ in range(calls(name)):
                out = fn()
                if hasattr(out, "block_until_ready"):
                    out.block_until_ready()
            samples[name].append((time.perf_counter() - t0) / calls(name))
            cpu_samples[name].append((time.process_time() - c0) / calls(name))
    return {name: TimingStats.of(s, cpu_samples[name]) for name, s in samples.items()}
