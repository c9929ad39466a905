"""Timing helpers every measurement uses: the median of repeated calls after a warm-up, and
side-by-side timing (a read probe before each round, so a rate is read against the DRAM
rate of its own moment; this VM's read rate moves by 2x within minutes)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hmoe_jax.measure.probes import ReadProbe


def median_s(fn, repeats: int, warmup: int = 1, probe: ReadProbe | None = None) -> float:
    """Median wall time of fn(); with a probe, a compute probe before each timed call (the
    compute rates are then predicted relative to the probes' median, like the reads)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        if probe is not None:
            probe.tflops()
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def side_by_side(probe: ReadProbe, fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median seconds per fn() call, median probe GB/s of the same rounds)."""
    import jax

    for _ in range(calls):
        jax.block_until_ready(fn())
    ts, bws = [], []
    for _ in range(rounds):
        bws.append(probe.gbps())
        probe.tflops()
        t = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t) / calls)
    return statistics.median(ts), statistics.median(bws)
