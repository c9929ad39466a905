"""Probes of this machine's rates: DRAM read bandwidth (the hmoe_read_bytes kernel: 512-bit
loads on the GEMM kernels' own thread pool, over a buffer much larger than L3) and the bf16
dot-product peak (hmoe_bf16_dot_peak).

- ReadProbe: one read of 1 GiB per call, kept for side-by-side timing (measure/timing.py);
- measure_read_bw: the median read rate of a few reads (experiments' ceilings).
"""

from __future__ import annotations

import time

import numpy as np

from hmoe_jax.measure.timing import TimingStats, median_time

GIB = 1 << 30


def touched_buffer(nbytes: int):
    """A page-aligned `nbytes` uint8 buffer with every page written (so a probe reads
    memory, not the shared zero page), handed to jax zero-copy."""
    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.hostmem import aligned_empty

    buf = aligned_empty((nbytes,), np.uint8)
    buf[:] = 1
    return device_put_zero_copy(buf)


def measure_read_bw(nbytes: int = GIB, threads: int = 0, repeats: int = 5) -> tuple[float, TimingStats, str]:
    """(GB/s from the median time, the timing, the method) for reading `nbytes` once. Falls
    back to numpy's sum when the extension is missing (slower: one thread, and it converts
    as it sums)."""
    try:
        from hmoe_jax.kernels.gemm import read_bytes

        arr = touched_buffer(nbytes)
        stats = median_time(lambda: read_bytes(arr, num_threads=threads), repeats=repeats, warmup=1)
        method = "hmoe_read_bytes"
    except ImportError:
        buf = np.ones(nbytes // 8, np.uint64)
        stats = median_time(lambda: buf.sum(), repeats=repeats, warmup=1)
        method = "numpy_sum"
    return nbytes / stats.median_s / 1e9, stats, method


class ReadProbe:
    """The hmoe_read_bytes probe over 1 GiB (all pool threads). This VM's read rate moves
    by 2x within minutes (other tenants), so every efficiency below is measured SIDE BY
    SIDE: a probe before each round of kernel calls, efficiency = kernel rate / the median
    of the probes taken in its own rounds."""

    def __init__(self) -> None:
        self.arr = touched_buffer(GIB)
        self.all_gbps: list[float] = []
        self.all_tflops: list[float] = []

    def gbps(self) -> float:
        import jax

        from hmoe_jax.kernels.gemm import read_bytes

        t = time.perf_counter()
        jax.block_until_ready(read_bytes(self.arr))
        g = GIB / (time.perf_counter() - t) / 1e9
        self.all_gbps.append(g)
        return g

    def tflops(self) -> float | None:
        """A short bf16 dot-product peak probe (~60 ms; None without AVX-512-BF16): the same
        estimator for calibrate and the simulator validation (experiments/common/simval.py),
        so their ratio measures the neighbours."""
        from hmoe_jax.kernels.moe import bf16_dot_peak_flops

        try:
            t = bf16_dot_peak_flops(iters=2_000_000, repeats=1) / 1e12
        except RuntimeError:
            return None
        self.all_tflops.append(t)
        return t
