"""FP8 GEMM flops/s by M at DeepSeek-V3 shapes, against the bf16 dot-product peak measured in
the same process (hmoe_bf16_dot_peak): medians of 7 jitted calls per (shape, M), 2 threads.

    PYTHONPATH=build/dev:. python tools/bench_fp8_gemm.py [M ...] [--shapes o_proj,q_b] [--json F]

For an A/B of two kernel builds, alternate runs with each build first on PYTHONPATH
(tools/build_ffi.sh builds one into a folder) and compare medians over the rounds: this
machine's rates drift by 10-20% between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.kernels.gemm import fp8_matmul
from hmoe_jax.kernels.moe import bf16_dot_peak_flops
from hmoe_jax.quant.fp8 import quantize_np

# [N, K] of the DeepSeek-V3 FP8 matrices a prefill chunk multiplies
SHAPES = {
    "o_proj": (7168, 16384),
    "q_b": (24576, 1536),
    "q_a": (1536, 7168),
    "expert_gate_up": (4096, 7168),
    "expert_down": (7168, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("m", nargs="*", type=int, default=[16, 32, 128])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None, help="append one JSON line of the results to this file")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    peak = bf16_dot_peak_flops()
    rows = []
    print(f"bf16 dot peak {peak / 1e12:.3f} TFLOPS (this run)", flush=True)
    f = jax.jit(fp8_matmul)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = jax.tree.map(jnp.asarray, quantize_np(rng.standard_normal((n, k)).astype(np.float32) * 0.02))
        for m in args.m:
            x = jnp.asarray(rng.standard_normal((m, k)) * 0.1, jnp.bfloat16)
            f(x, w).block_until_ready()
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                f(x, w).block_until_ready()
                ts.append(time.perf_counter() - t0)
            s = statistics.median(ts)
            tflops = 2 * m * n * k / s / 1e12
            rows.append({"shape": name, "n": n, "k": k, "m": m, "median_s": s, "tflops": tflops})
            print(
                f"{name:15s} M={m:4d} {s * 1e3:8.2f} ms {tflops:.3f} TFLOPS {tflops * 1e12 / peak:.2f} of peak",
                flush=True,
            )
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"peak_tflops": peak / 1e12, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
