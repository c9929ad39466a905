"""Probes of this machine's rates: DRAM read bandwidth (the hmoe_read_bytes kernel over
1 GiB, all pool threads) and the bf16 dot-product peak (hmoe_bf16_dot_peak)."""

from __future__ import annotations

import time

import numpy as np

GIB = 1 << 30


class ReadProbe:
    """The hmoe_read_bytes probe over 1 GiB (all pool threads). This VM's read rate moves
    by 2x within minutes (other tenants), so every efficiency below is measured SIDE BY
    SIDE: a probe before each round of kernel calls, efficiency = kernel rate / the median
    of the probes taken in its own rounds."""

    def __init__(self) -> None:
        from hmoe_jax.kernels.gemm import device_put_zero_copy
        from hmoe_jax.quant.hostmem import aligned_empty

        buf = aligned_empty((GIB,), np.uint8)
        buf[:] = 1  # touch every page
        self.arr = device_put_zero_copy(buf)
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
        estimator experiments/common/simval.py uses, so their ratio measures the neighbours."""
        from hmoe_jax.kernels.moe import bf16_dot_peak_flops

        try:
            t = bf16_dot_peak_flops(iters=2_000_000, repeats=1) / 1e12
        except RuntimeError:
            return None
        self.all_tflops.append(t)
        return t
