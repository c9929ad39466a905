"""Memory read bandwidth of this machine, measured in the same run as the kernels.

Uses the `hmoe_read_bytes` FFI probe (512-bit loads on the same thread pool as the GEMM
kernels) over a buffer much larger than L3; falls back to numpy's sum when the extension
is missing (which is slower: one thread, and it converts as it sums)."""

from __future__ import annotations

import numpy as np

from experiments.common.timing import TimingStats, median_time

GIB = 1 << 30


def measure_read_bw(nbytes: int = GIB, threads: int = 0, repeats: int = 5) -> tuple[float, TimingStats, str]:
    """(GB/s from the median time, the timing, the method) for reading `nbytes` once."""
    try:
        from hmoe_jax.kernels.gemm import aligned_empty, device_put_zero_copy, read_bytes

        buf = aligned_empty((nbytes,), np.uint8)
        buf[:] = 1  # touch every page, so the probe reads memory, not the zero page
        arr = device_put_zero_copy(buf)
        stats = median_time(lambda: read_bytes(arr, num_threads=threads), repeats=repeats, warmup=1)
        method = "hmoe_read_bytes"
    except ImportError:
        buf = np.ones(nbytes // 8, np.uint64)
        stats = median_time(lambda: buf.sum(), repeats=repeats, warmup=1)
        method = "numpy_sum"
    return nbytes / stats.median_s / 1e9, stats, method
