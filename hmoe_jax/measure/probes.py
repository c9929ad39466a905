"""Probes of this machine's rates: DRAM read bandwidth (the hmoe_read_bytes kernel: 512-bit
loads on the GEMM kernels' own thread pool, over a buffer much larger than L3) and a
register-resident compute peak: the bf16 dot-product one (hmoe_bf16_dot_peak) where the CPU
has AVX-512-BF16, else the f32 FMA one (hmoe_fma_peak).

- ReadProbe: one read of 1 GiB per call, kept for side-by-side timing (measure/timing.py),
  and over the same bytes the stream probe: our FP8 GEMV (M=1) through ~1 GiB of weights,
  what a decode step does with its experts and attention weights;
- measure_read_bw: the median read rate of a few reads (experiments' ceilings).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from hmoe_jax.measure.timing import TimingStats, median_time

GIB = 1 << 30


def _touched(nbytes: int) -> np.ndarray:
    from hmoe_jax.quant.hostmem import aligned_empty

    buf = aligned_empty((nbytes,), np.uint8)
    buf[:] = 1  # every byte 0x01: in e4m3 a small subnormal, a valid FP8 weight (stream probe)
    return buf


def touched_buffer(nbytes: int):
    """A page-aligned `nbytes` uint8 buffer with every page written (so a probe reads
    memory, not the shared zero page), handed to jax zero-copy."""
    from hmoe_jax.kernels.gemm import device_put_zero_copy

    return device_put_zero_copy(_touched(nbytes))


# The stream probe's matrices: an expert's gate / up shape of DeepSeek-V3 (14.7 MB of FP8)
STREAM_N, STREAM_K = 2048, 7168


def stream_matrices(buf: np.ndarray) -> list:
    """The whole [STREAM_N, STREAM_K] FP8 matrices that fit in `buf` (uint8), as zero-copy
    views of its bytes (unit block scales): the stream probe reads the read probe's memory."""
    import ml_dtypes

    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.fp8 import Fp8Tensor

    per = STREAM_N * STREAM_K
    n = buf.size // per
    if n < 1:
        raise ValueError(
            f"stream probe: a {buf.size}-byte buffer holds no {STREAM_N} x {STREAM_K} FP8 matrix"
        )
    mats = buf[: n * per].view(ml_dtypes.float8_e4m3fn).reshape(n, STREAM_N, STREAM_K)
    scale = device_put_zero_copy(np.ones((STREAM_N // 128, STREAM_K // 128), np.float32))
    return [Fp8Tensor(w=device_put_zero_copy(m), scale_inv=scale) for m in mats]


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

    def __init__(self, nbytes: int = GIB) -> None:
        from hmoe_jax.kernels.gemm import device_put_zero_copy

        self.buf = _touched(nbytes)
        self.arr = device_put_zero_copy(self.buf)
        self.nbytes = nbytes
        self.all_gbps: list[float] = []
        self.all_tflops: list[float] = []
        self.all_stream_gbps: list[float] = []
        self.tflops_kind: str | None = None  # "bf16_dot" / "fma_f32" once tflops() has run
        self._stream: tuple | None = None  # (matrices, x, jitted GEMV) once stream_gbps has run

    def gbps(self) -> float:
        import jax

        from hmoe_jax.kernels.gemm import read_bytes

        t = time.perf_counter()
        jax.block_until_ready(read_bytes(self.arr))
        g = self.nbytes / (time.perf_counter() - t) / 1e9
        self.all_gbps.append(g)
        return g

    def stream_gbps(self) -> float:
        """The stream probe: our FP8 GEMV (one bf16 row, kernels.gemm.fp8_matmul on all pool
        threads) through every [2048, 7168] FP8 matrix in the probe's buffer (64 of them,
        0.94 GB, per GiB), weight bytes over the wall time of the whole pass. The read probe
        is a bare 512-bit load loop; this one decodes FP8 and multiplies as it streams, as a
        decode step does. On the Zen 5 VM the two moved apart: readings of 70-78 GB/s from
        the read probe while the GEMV and the engine's steps ran at their usual rate, and over
        40-80 interleaved rounds the engine's batch-1 step followed this probe more closely
        (docs/simulator.md, "Probes"). The first call compiles (not a reading)."""
        import jax
        import jax.numpy as jnp

        from hmoe_jax.kernels.gemm import fp8_matmul

        if self._stream is None:
            mats = stream_matrices(self.buf)
            x = jnp.ones((1, STREAM_K), jnp.bfloat16)
            fn = jax.jit(fp8_matmul)
            jax.block_until_ready(fn(x, mats[0]))
            self._stream = (mats, x, fn)
        mats, x, fn = self._stream
        t = time.perf_counter()
        for w in mats:
            y = fn(x, w)
        jax.block_until_ready(y)
        g = len(mats) * STREAM_N * STREAM_K / (time.perf_counter() - t) / 1e9
        self.all_stream_gbps.append(g)
        return g

    def tflops(self) -> float | None:
        """A short register-resident compute peak probe (the median of 3 loops, ~50 ms; None
        on a CPU with neither AVX-512-BF16 nor AVX2): the bf16 dot-product loop where the CPU
        has AVX-512-BF16, else the f32 FMA loop (tflops_kind says which). The same estimator for calibrate and the
        simulator validation (experiments/common/simval.py), so their ratio measures the
        neighbours: on a VM whose host lends its cores out, both the kernels and this loop
        slow down together."""
        from hmoe_jax.kernels.moe import bf16_dot_peak_flops, fma_peak_flops

        for kind, fn, iters in (
            ("bf16_dot", bf16_dot_peak_flops, 2_000_000),
            ("fma_f32", fma_peak_flops, 8_000_000),
        ):
            if self.tflops_kind not in (None, kind):
                continue
            try:
                if self.tflops_kind is None:
                    fn(iters=iters // 8, repeats=1)  # the first call compiles: not a reading
                # the median of 3 loops: one ~17 ms loop now and then lands on a hiccup (e04,
                # 2026-12-07: readings of 0.10-0.12 among 0.19-0.20), and a row's probe is the
                # median of only 2-3 calls, so one such reading moved a row's re-based rates 25%
                t = statistics.median(fn(iters=iters, repeats=1) for _ in range(3)) / 1e12
            except RuntimeError:
                continue
            self.tflops_kind = kind
            self.all_tflops.append(t)
            return t
        return None


def dram_corun(nbytes: int = 256 << 20, rounds: int = 3, readers: int = 2) -> dict[str, float]:
    """DRAM co-run efficiency (sim/interference.py, cpu.dram_corun_efficiency): `readers`
    streams reading their own buffers at once, total bytes/s over one stream alone on the
    same cores, side by side in each round (this VM's rate moves), the median of the rounds.

    One stream alone is the hmoe_read_bytes probe on all pool threads. The co-run can not
    use the pool twice (ThreadPool::run serialises its parallel regions, xla_ffi/src/
    thread_pool.cc), so each reader is a set of Python threads each calling hmoe_read_bytes
    with num_threads=1 (run on the calling thread, no region lock) over its own slice: the
    cores are split evenly between the readers, and together they use as many threads as the
    stream alone. About 0.1-0.5 s on this VM."""
    import os
    import statistics
    import threading

    import jax

    from hmoe_jax.kernels.gemm import read_bytes

    cores = max(readers, os.cpu_count() or 1)
    per = cores // readers  # threads per reader
    bufs = [touched_buffer(nbytes) for _ in range(readers)]
    slices = [[b[i * (nbytes // per) : (i + 1) * (nbytes // per)] for i in range(per)] for b in bufs]
    jobs = [s for r in slices for s in r]
    for s in jobs:  # compile both call shapes and warm the pages
        jax.block_until_ready(read_bytes(s, num_threads=1))
    jax.block_until_ready(read_bytes(bufs[0]))
    alone, together, eff = [], [], []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(read_bytes(bufs[0]))
        a = nbytes / (time.perf_counter() - t) / 1e9
        start = threading.Barrier(len(jobs) + 1)

        def read(s, start=start):  # bound now: a fresh barrier each round
            start.wait()
            jax.block_until_ready(read_bytes(s, num_threads=1))

        th = [threading.Thread(target=read, args=(s,)) for s in jobs]
        for x in th:
            x.start()
        start.wait()
        t = time.perf_counter()
        for x in th:
            x.join()
        c = sum(int(s.size) for s in jobs) / (time.perf_counter() - t) / 1e9
        alone.append(a)
        together.append(c)
        eff.append(c / a)
    return {
        "alone_gbps": statistics.median(alone),
        "corun_gbps": statistics.median(together),
        "efficiency": statistics.median(eff),
        "readers": readers,
        "threads_per_reader": per,
        "rounds": rounds,
        "mib_per_reader": nbytes >> 20,
    }
