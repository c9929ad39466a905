"""The GPU check of the real-scale engine issue, as one prepared script (under 8 minutes on
one GPU): compile and run the slp prefill of the real-shape DeepSeek-V3 bench twin
(configs/models/deepseek_v3_bench.json, hmoe_jax/io/bench_twin.py: real layer dims, 2 MoE
layers of 32 experts) at 8K prompt tokens, and print one JSON line with the measured host->device copy
rate (GB/s), prefill tokens/s and the GPU's peak memory.

    python tools/gpu_slp_check.py                 # on a GPU host (the device tool)
    python tools/gpu_slp_check.py --tokens 256    # a smoke run on a CPU stand-in

Nothing here is typed in: the copy rate is bytes streamed / the copy slices' time from the
engine's own trace, prefill tok/s is the median of the timed runs after one compile run,
peak memory is jax's `memory_stats()["peak_bytes_in_use"]` (None on CPU).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    import jax
    import numpy as np

    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.io.bench_twin import bench_twin_config, fp8_twin_params
    from hmoe_jax.plan.system import load_system
    from hmoe_jax.plan.trace import TraceRecorder

    cfg = bench_twin_config()
    t0 = time.perf_counter()
    params = fp8_twin_params(cfg)
    build_s = time.perf_counter() - t0
    eng = Engine(
        params,
        cfg,
        system=load_system("paper_epyc9355_rtx5090", 1),
        precision="bf16",
        max_batch=1,
        max_len=args.tokens + 64,
    )
    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, args.tokens).astype(np.int32)
    cache = eng.new_cache(args.tokens + 64)
    t0 = time.perf_counter()
    eng.prefill(ids, cache, "slp")  # compile
    compile_s = time.perf_counter() - t0
    times, copy_gbps = [], []
    for _ in range(args.runs):
        tr = TraceRecorder()
        logits, run, secs, plan = eng.prefill(ids, cache, "slp", trace=tr)
        jax.block_until_ready(logits)
        times.append(secs)
        loads = [s for s in tr.slices if s["name"].startswith("load")]
        busy_s = sum(s["end_ns"] - s["start_ns"] for s in loads) / 1e9
        copy_gbps.append(sum(run.streamed_bytes.values()) / busy_s / 1e9 if busy_s else float("nan"))
    dev = eng.placement.acc
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    print(
        json.dumps(
            {
                "device": str(dev),
                "platform": dev.platform,
                "prompt_tokens": args.tokens,
                "weights_build_s": build_s,
                "compile_run_s": compile_s,
                "prefill_s_median": float(np.median(times)),
                "prefill_tok_per_s": args.tokens / float(np.median(times)),
                "h2d_copy_gbps_median": float(np.median(copy_gbps)),
                "streamed_bytes": int(sum(run.streamed_bytes.values())),
                "peak_gpu_bytes": (stats or {}).get("peak_bytes_in_use"),
                "plan": {k: plan.meta.get(k) for k in ("ring_slots", "slot_bytes", "bound", "compute_dtype")},
            }
        )
    )
    eng.close()


if __name__ == "__main__":
    main()
