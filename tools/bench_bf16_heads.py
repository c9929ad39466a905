"""Quick timing of the lm_head BF16 GEMM and MLA's per-head FP8 GEMVs (docs/kernels.md).

    PYTHONPATH=build/dev:. python tools/bench_bf16_heads.py [--vocab 129280] [--reps 9]

bf16_matmul [vocab, 7168] at M = 1, 4, 8 against the read probe (`gemm.read_bytes`) on
the same buffer, alternating, medians; fp8_head_matmul [128, 512, 128] and
[128, 128, 512] at B = 1 and 4, per call, with the weights hot (one set, L2/L3
resident) and cold (16 sets rotated, 128 MiB > L3). Not a test; the last stdout line
is the JSON record.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hmoe_jax.kernels import gemm
from hmoe_jax.measure.timing import interleaved_timings, median_time
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor


def bench_bf16(vocab: int, k: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    w_np = gemm.aligned_empty((vocab, k), ml_dtypes.bfloat16)
    tile = rng.standard_normal((64, k)).astype(ml_dtypes.bfloat16)
    for r in range(0, vocab, 64):  # touch every page with normal numbers
        w_np[r : r + 64] = tile[: min(64, vocab - r)]
    w = gemm.device_put_zero_copy(w_np)
    nbytes = w_np.nbytes
    print(f"bf16 [{vocab}, {k}]: {nbytes / 1e9:.2f} GB of weights per call")
    probe = jax.jit(lambda b: gemm.read_bytes(b))
    row = {"shape": [vocab, k], "weight_bytes": nbytes}
    for m in (1, 4, 8):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        mm = jax.jit(gemm.bf16_matmul)
        jax.block_until_ready((mm(x, w), probe(w)))  # compile
        # alternate: the VM's bandwidth drifts
        t = interleaved_timings({"mm": lambda x=x, mm=mm: mm(x, w), "rd": lambda: probe(w)}, reps, warmup=0)
        mm_s, rd_s = t["mm"].median_s, t["rd"].median_s
        row[f"m{m}"] = {
            "matmul_ms": 1e3 * mm_s,
            "read_gbps": nbytes / rd_s / 1e9,
            "matmul_gbps": nbytes / mm_s / 1e9,
            "bw_fraction": rd_s / mm_s,
        }
        r = row[f"m{m}"]
        print(
            f"  M={m}: {r['matmul_ms']:.1f} ms, {r['matmul_gbps']:.1f} GB/s vs read probe "
            f"{r['read_gbps']:.1f} GB/s -> {r['bw_fraction']:.2f}"
        )
    return row


def bench_heads(h: int, n: int, k: int, reps: int, sets: int = 16) -> dict:
    rng = np.random.default_rng(1)
    ws = []
    for _ in range(sets):
        a = gemm.aligned_empty((h, n, k), FP8_DTYPE)
        a.view(np.uint8)[...] = rng.integers(0, 0x7E, a.shape, dtype=np.uint8)  # finite codes
        s = jnp.asarray(rng.uniform(0.5, 2, (h, -(-n // 128), -(-k // 128))), jnp.float32)
        ws.append(Fp8Tensor(w=gemm.device_put_zero_copy(a), scale_inv=s))
    nbytes = h * n * k
    f = jax.jit(gemm.fp8_head_matmul)
    row = {"shape": [h, n, k], "weight_bytes": nbytes}
    for b in (1, 4):
        x = jnp.asarray(rng.standard_normal((b, h, k)), jnp.float32)
        hot_s = median_time(lambda x=x: f(x, ws[0]), 20 * reps).median_s  # warm-up compiles
        it = iter(range(10**9))
        cold_s = median_time(lambda x=x, it=it: f(x, ws[next(it) % sets]), 20 * reps).median_s
        row[f"b{b}"] = {"hot_us": 1e6 * hot_s, "cold_us": 1e6 * cold_s, "cold_gbps": nbytes / cold_s / 1e9}
        r = row[f"b{b}"]
        print(
            f"  fp8 heads [{h}, {n}, {k}] B={b}: hot {r['hot_us']:.0f} us, cold {r['cold_us']:.0f} us "
            f"({r['cold_gbps']:.1f} GB/s)"
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[129280, 32768])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    rec = {"bf16": [bench_bf16(v, 7168, args.reps) for v in args.vocab]}
    rec["fp8_heads"] = [bench_heads(128, 512, 128, args.reps), bench_heads(128, 128, 512, args.reps)]
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
