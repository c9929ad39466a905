"""e01: the CPU FP8 GEMV runs at the memory-bandwidth limit, 4-5x faster than f32/bf16 BLAS.

Claim (paper, technique 4): expanding e4m3 to bf16 in registers + AVX-512 BF16 dot
products gives 4-5x lower GEMV latency than FP32/BF16 BLAS on the same matrix (which moves
2-4x more bytes). Our targets on this machine: fp8_bw_fraction >= 0.85,
speedup_vs_f32_blas >= 3.5, speedup_vs_xla_dequant >= 10, int4_time_ratio_vs_fp8 <= 0.6.

    python -m experiments.e01_fp8_gemv [--quick]

DeepSeek-V3 shapes at M = 1 (one decode token): expert gate/up [2048, 7168], expert down
[7168, 2048], attention q_b [24576, 1536]. Each variant rotates through its own weight set
of >= 2 GiB (--quick: 512 MiB, 3 rounds, all cores only; L3 is 32 MiB), so every call
reads DRAM. Variants are timed round-robin (medians), in one child process per library
and thread count (all cores, then 1 thread):
  "ours":   fp8_ours     hmoe_fp8_gemm (FFI)       int4_ours  hmoe_int4_gemm (FFI)
  "numpy":  f32_blas     numpy (OpenBLAS sgemv)
  "torch":  bf16_torch   torch bf16 matmul
  "xla":    xla_dequant  jit: x @ (f32(w) * scale).T on the same FP8 arrays
            f32_xla      jit x @ W.T, f32          bf16_xla   jit x @ W.T, bf16
  each:     read_bw      hmoe_read_bytes over 1 GiB (the physical limit), our pool
Why one library per process: each library's threads spin after its calls (OpenBLAS,
OpenMP, Eigen, and our pool) and take a core from whatever runs next. With all variants
in one rotation our 2048x7168 FP8 GEMV measured 10-20% slower (same run, same weights),
and with all baselines in one process OpenBLAS and torch ran at half their usual speed.
So fp8_bw_fraction and int4_time_ratio_vs_fp8 come from the "ours" process alone (its own
read_bw rows); a speedup divides a baseline's time (its process) by ours (record rows:
`process`; every process reports the probe, so the machine's state in each is visible).
Every timed call runs GEMVS_PER_DISPATCH (8) GEMVs on consecutive weights of its set,
as a decode step does: the JAX variants as one jitted program, numpy/torch in a Python
loop. Why: a jit dispatch after streaming weights runs with cold caches (L3 is a victim
cache that the weight stream flushes): measured 2026-12-03 from Python's clock against our
FFI handler's (same monotonic clock), ~120 us pass from the call to the first GEMV's start
and ~125 us from the last GEMV's end to the return (plus ~60 us in block_until_ready),
against ~50 us for the whole dispatch when its weights fit in cache: ~300 us per dispatch,
~8% of eight 2048x7168 FP8 GEMVs and more of one. The kernel, not Python, is what this
claim is about. Why 8, not more: XLA's CPU thunk executor runs a program of at most 8
thunks sequentially and larger ones as a dataflow graph, running independent GEMVs side
by side (an optimization barrier between them does not survive compilation, and
has_side_effect does not order them either); our pool serialises those regions, and 32
GEMVs per program measured 20-30% slower per GEMV than 8. Times are reported per GEMV
(the call's time / 8).
The thread count is fixed per child process: XLA_FLAGS / OPENBLAS_NUM_THREADS /
torch.set_num_threads and our num_threads all get the same value.
Summary keys: from median wall times at all cores (the issue's targets), the same from
best-of samples (`*_best`: when a shared core was not taken away), and `*_1t` for one
thread. (Process CPU time is recorded per row as cpu_median_s but not summarised: the
Python thread waiting on XLA's execution thread inflates it.)

    python -m experiments.e01_fp8_gemv --resummarise RECORD.json

prints (last stdout line, JSON) the all-cores summary of a record's own rows again, measuring
nothing: a changed summary formula can be checked on old records (and on hand-made rows:
tests/test_e01_summary.py).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from experiments.common import emit_record, interleaved_timings, parse_args, print_ceiling
from experiments.common.weights import GIB, RotatingSet

SHAPES = {  # name: (N, K) of W [N, K], y = x @ W.T
    "expert_gate_up": (2048, 7168),
    "expert_down": (7168, 2048),
    "attn_q_b": (24576, 1536),
}
VARIANTS = (
    "fp8_ours",
    "int4_ours",
    "xla_dequant",
    "f32_blas",
    "f32_xla",
    "bf16_torch",
    "bf16_xla",
    "read_bw",
)
BYTES_PER_WEIGHT = {"f32_blas": 4.0, "f32_xla": 4.0, "bf16_torch": 2.0, "bf16_xla": 2.0}
CHILD_FLAG = "--child-threads"
RESUMMARISE_FLAG = "--resummarise"
GEMVS_PER_DISPATCH = 8  # <= 8: XLA runs such programs sequentially (module doc)


def _jit_group(f):
    """jit of (x, ws) -> [f(x, w) for w in ws]. Nothing orders the GEMVs in the program: an
    optimization barrier between them compiled to the same executables (checked for all
    three JAX variants) and was dropped. Our FFI GEMVs (one thunk each) still run one after
    another at len(ws) <= 8, because XLA's CPU runtime executes programs of at most 8
    thunks sequentially (module doc); XLA's own variants (several thunks per GEMV) may
    overlap theirs, which can only flatter those baselines. Every output is returned, so
    no GEMV is dead code."""
    import jax

    return jax.jit(lambda x, ws: [f(x, w) for w in ws])


def _fp8_base(n: int, k: int, rng: np.random.Generator):
    from hmoe_jax.quant.fp8 import quantize_np

    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    return w, quantize_np(w)


PROCESSES = {  # one library per process (see the module doc), each with the read probe
    "ours": ("fp8_ours", "int4_ours", "read_bw"),
    "numpy": ("f32_blas", "read_bw"),
    "torch": ("bf16_torch", "read_bw"),
    "xla": ("xla_dequant", "f32_xla", "bf16_xla", "read_bw"),
}


def _measure_shape(
    name: str, n: int, k: int, set_bytes: int, threads: int, rounds: int, process: str
) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from hmoe_jax.kernels import gemm
    from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize
    from hmoe_jax.quant.int4 import Int4Tensor, quantize_int4_np

    names = PROCESSES[process]
    rng = np.random.default_rng(0)
    wf, base = _fp8_base(n, k, rng)
    base4 = quantize_int4_np(base) if "int4_ours" in names else None  # only where it is timed
    g = GEMVS_PER_DISPATCH
    ready = jax.block_until_ready  # the chained calls return lists

    def copy_dev(a: np.ndarray):
        b = gemm.aligned_empty(a.shape, a.dtype)
        b[...] = a
        return gemm.device_put_zero_copy(b)

    def group(s: RotatingSet) -> tuple:
        return tuple(s.next() for _ in range(g))

    x = rng.standard_normal((1, k)).astype(np.float32)
    xj = jnp.asarray(x)
    variants: dict[str, Any] = {}
    sets: dict[str, RotatingSet] = {}
    fp8_rel_err = None
    if "fp8_ours" in names or "xla_dequant" in names:
        fp8_set = RotatingSet(
            lambda i: Fp8Tensor(
                w=copy_dev(np.asarray(base.w)), scale_inv=copy_dev(np.asarray(base.scale_inv))
            ),
            n * k,
            set_bytes,
        )
        assert np.asarray(fp8_set.items[0].w).dtype == FP8_DTYPE
    if "fp8_ours" in names:
        ours = _jit_group(lambda x, w: gemm.fp8_matmul(x, w, num_threads=threads))
        # correctness of what we time, against the reference (not a test: a sanity record)
        y = np.asarray(ours(xj, (fp8_set.items[0],))[0])
        y_ref = np.asarray(gemm.fp8_matmul_ref(x, base))
        fp8_rel_err = float(np.abs(y - y_ref).max() / np.abs(y_ref).max())
        variants["fp8_ours"], sets["fp8_ours"] = lambda: ready(ours(xj, group(fp8_set))), fp8_set
    if "int4_ours" in names:
        int4_set = RotatingSet(
            lambda i: Int4Tensor(q=copy_dev(np.asarray(base4.q)), scale=copy_dev(np.asarray(base4.scale))),
            n * k // 2,
            set_bytes // 2,
        )
        ours4 = _jit_group(lambda x, w: gemm.int4_matmul(x, w, num_threads=threads))
        variants["int4_ours"], sets["int4_ours"] = lambda: ready(ours4(xj, group(int4_set))), int4_set
    if "xla_dequant" in names:
        xla_deq = _jit_group(lambda x, w: x @ dequantize(w, jnp.float32).T)
        variants["xla_dequant"], sets["xla_dequant"] = lambda: ready(xla_deq(xj, group(fp8_set))), fp8_set
    if "f32_blas" in names:
        f32_set = RotatingSet(lambda i: np.array(wf, copy=True), 4 * n * k, set_bytes)
        variants["f32_blas"], sets["f32_blas"] = lambda: [x @ w.T for w in group(f32_set)], f32_set
    xla_dot = _jit_group(lambda x, w: x @ w.T)
    if "f32_xla" in names:
        f32_dev_set = RotatingSet(lambda i: copy_dev(wf), 4 * n * k, set_bytes)
        variants["f32_xla"], sets["f32_xla"] = lambda: ready(xla_dot(xj, group(f32_dev_set))), f32_dev_set
    if "bf16_xla" in names:
        wb = wf.astype(ml_dtypes.bfloat16)  # round to nearest even, as torch's .to(bfloat16)
        bf16_dev_set = RotatingSet(lambda i: copy_dev(wb), 2 * n * k, set_bytes)
        xb = jnp.asarray(x, jnp.bfloat16)
        variants["bf16_xla"], sets["bf16_xla"] = lambda: ready(xla_dot(xb, group(bf16_dev_set))), bf16_dev_set
    if "bf16_torch" in names:
        import torch

        wt = torch.from_numpy(wf).to(torch.bfloat16)
        bf16_set = RotatingSet(lambda i: wt.clone(), 2 * n * k, set_bytes)
        xt = torch.from_numpy(x).to(torch.bfloat16)
        variants["bf16_torch"] = lambda: [torch.matmul(xt, w.T) for w in group(bf16_set)]
        sets["bf16_torch"] = bf16_set
    read_buf = gemm.aligned_empty((GIB,), np.uint8)
    read_buf[:] = 1
    read_dev = gemm.device_put_zero_copy(read_buf)
    variants["read_bw"] = lambda: gemm.read_bytes(read_dev, num_threads=threads)

    # one probe call each, then enough calls per sample for >= ~50 ms (at most one pass:
    # a call takes g weights of the set)
    import time

    calls = {}
    for v, fn in variants.items():
        fn()
        t0 = time.perf_counter()
        ready(fn())
        dt = time.perf_counter() - t0
        calls[v] = (
            1 if v == "read_bw" else int(np.clip(np.ceil(0.05 / max(dt, 1e-6)), 1, max(1, len(sets[v]) // g)))
        )
    stats = interleaved_timings(variants, rounds=rounds, warmup=0, calls_per_sample=calls)
    per_call = {v: 1 if v == "read_bw" else g for v in variants}  # GEMVs per timed call

    weight_bytes = {
        "fp8_ours": n * k + 4 * base.scale_inv.size,
        "xla_dequant": n * k + 4 * base.scale_inv.size,
        "read_bw": GIB,
        **{v: int(b * n * k) for v, b in BYTES_PER_WEIGHT.items()},
    }
    if base4 is not None:
        weight_bytes["int4_ours"] = base4.q.nbytes + base4.scale.nbytes
    rows = []
    for v in names:
        s = stats[v]
        rows.append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "m": 1,
                "threads": threads,
                "process": process,
                "variant": v,
                "bytes": weight_bytes[v],
                "set_bytes": sets[v].total_bytes if v in sets else GIB,
                "calls_per_sample": calls[v],
                "gemvs_per_call": per_call[v],
                **_per_gemv(s.as_dict(), per_call[v]),
                "gbps": weight_bytes[v] * per_call[v] / s.median_s / 1e9,
                "fp8_rel_err_vs_ref": fp8_rel_err if v == "fp8_ours" else None,
            }
        )
    return rows  # the sets die with this frame; the caller collects before the next shape


def _per_gemv(d: dict[str, float], gemvs: int) -> dict[str, float]:
    """A call's timing stats as times per GEMV (sample counts unchanged)."""
    return {k: (v / gemvs if k.endswith("_s") else v) for k, v in d.items()}


def _child(threads: int, quick: bool, process: str) -> None:
    if process == "torch":
        import torch

        torch.set_num_threads(threads)
    set_bytes = GIB // 2 if quick else 2 * GIB
    rounds = 3 if quick else 9
    rows = []
    for name, (n, k) in SHAPES.items():
        print(f"[e01] {process} threads={threads} {name} [{n}, {k}] ...", file=sys.stderr, flush=True)
        rows += _measure_shape(name, n, k, set_bytes, threads, rounds, process)
        gc.collect()
    print(json.dumps(rows))


def _run_child(threads: int, quick: bool, process: str) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if threads > 0:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
        if threads == 1:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    cmd = [sys.executable, "-m", "experiments.e01_fp8_gemv", CHILD_FLAG, str(threads), process]
    cmd += ["--quick"] if quick else []
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summarise(rows: list[dict[str, Any]], threads: int) -> dict[str, float]:
    sel = [r for r in rows if r["threads"] == threads]

    def total(v: str, key: str = "median_s") -> float:  # (read_bw is not summed)
        return sum(r[key] for r in sel if r["variant"] == v)

    def total_bytes(v: str) -> float:
        return sum(r["bytes"] for r in sel if r["variant"] == v)

    # The fraction's limit: each shape's bytes at the read bandwidth measured beside it (the
    # probe rows of the process that ran our kernels, same shape), summed over the shapes,
    # over our summed time. Per shape, not one median probe for all: the machine's
    # bandwidth changes between shapes (30-50 GB/s within one run), and a median probe
    # would credit a shape measured in a fast stretch with a slow stretch's limit.
    probe = {r["shape"]: r for r in sel if r["variant"] == "read_bw" and r["process"] == "ours"}

    def limit_s(v: str, key: str = "median_s") -> float:
        return sum(
            r["bytes"] / (probe[r["shape"]]["bytes"] / probe[r["shape"]][key])
            for r in sel
            if r["variant"] == v
        )

    read_gbps = float(np.median([r["gbps"] for r in probe.values()]))
    read_base = [r["gbps"] for r in sel if r["variant"] == "read_bw" and r["process"] != "ours"]
    fp8_gbps = total_bytes("fp8_ours") / total("fp8_ours") / 1e9
    # best-of samples: what each variant does when a shared core is not taken from it
    read_best = max(r["bytes"] / r["best_s"] / 1e9 for r in probe.values())
    fp8_best = total_bytes("fp8_ours") / total("fp8_ours", "best_s") / 1e9
    best = {
        "read_bw_gbps_best": read_best,
        "fp8_gbps_best": fp8_best,
        "fp8_bw_fraction_best": limit_s("fp8_ours", "best_s") / total("fp8_ours", "best_s"),
        "speedup_vs_f32_blas_best": total("f32_blas", "best_s") / total("fp8_ours", "best_s"),
        "speedup_vs_xla_dequant_best": total("xla_dequant", "best_s") / total("fp8_ours", "best_s"),
        "int4_time_ratio_vs_fp8_best": total("int4_ours", "best_s") / total("fp8_ours", "best_s"),
    }
    return {
        **best,
        "read_bw_gbps": read_gbps,
        "read_bw_gbps_baseline_processes": float(np.median(read_base)),
        "fp8_gbps": fp8_gbps,
        "fp8_bw_fraction": limit_s("fp8_ours") / total("fp8_ours"),
        "fp8_bw_fraction_by_shape": {
            r["shape"]: r["gbps"] / probe[r["shape"]]["gbps"] for r in sel if r["variant"] == "fp8_ours"
        },
        "int4_gbps": total_bytes("int4_ours") / total("int4_ours") / 1e9,
        "speedup_vs_f32_blas": total("f32_blas") / total("fp8_ours"),
        "speedup_vs_f32_xla": total("f32_xla") / total("fp8_ours"),
        "speedup_vs_bf16_torch": (
            total("bf16_torch") / total("fp8_ours")
            if any(r["variant"] == "bf16_torch" for r in sel)
            else None
        ),
        "speedup_vs_bf16_xla": total("bf16_xla") / total("fp8_ours"),
        "speedup_vs_xla_dequant": total("xla_dequant") / total("fp8_ours"),
        "int4_time_ratio_vs_fp8": total("int4_ours") / total("fp8_ours"),
        "fp8_gate_up_us": next(
            r["median_s"] for r in sel if r["variant"] == "fp8_ours" and r["shape"] == "expert_gate_up"
        )
        * 1e6,
    }


def main() -> None:
    if CHILD_FLAG in sys.argv:
        i = sys.argv.index(CHILD_FLAG)
        _child(int(sys.argv[i + 1]), "--quick" in sys.argv, sys.argv[i + 2])
        return
    if RESUMMARISE_FLAG in sys.argv:
        rec = json.loads(open(sys.argv[sys.argv.index(RESUMMARISE_FLAG) + 1]).read())
        print(json.dumps(_summarise(rec["rows"], rec["config"]["summary_threads"])))
        return
    args = parse_args("e01_fp8_gemv", __doc__)
    all_threads = args.threads or os.cpu_count()
    set_gib = 0.5 if args.quick else 2
    thread_counts = [all_threads] if args.quick else [all_threads, 1]
    for name, (n, k) in SHAPES.items():
        print_ceiling(
            f"{name} [{n}, {k}] M=1",
            fp8_bytes=n * k,
            f32_bytes=4 * n * k,
            ideal_fp8_speedup_vs_f32=4.0,
            ideal_int4_time_ratio=0.5 + 2 / 64,
        )
    print_ceiling(
        "time = bytes / read bandwidth (measured in the same run, see read_bw rows)", set_gib=set_gib
    )
    # torch is a peer baseline from the test extra: without it (a plain `pip install .`) its
    # process is left out and its speedup is None, never a number made of a missing time
    import importlib.util

    processes = [p for p in PROCESSES if p != "torch" or importlib.util.find_spec("torch") is not None]
    if len(processes) < len(PROCESSES):
        print("[e01] torch is not installed: the bf16 torch baseline is skipped", flush=True)
    rows = []
    for threads in thread_counts:
        for process in processes:
            rows += _run_child(threads, args.quick, process)
    summary = _summarise(rows, all_threads)
    summary_1t = {f"{k}_1t": v for k, v in _summarise(rows, 1).items()} if 1 in thread_counts else {}
    targets = {
        "fp8_bw_fraction": (">=", 0.85),
        "speedup_vs_f32_blas": (">=", 3.5),
        "speedup_vs_xla_dequant": (">=", 10.0),
        "int4_time_ratio_vs_fp8": ("<=", 0.6),
    }
    summary["targets_met"] = {
        k: (summary[k] >= t if op == ">=" else summary[k] <= t) for k, (op, t) in targets.items()
    }
    for r in rows:
        print(
            f"{r['threads']}t {r['process']:9s} {r['shape']:15s} {r['variant']:12s} {r['median_s'] * 1e6:10.1f} us  {r['gbps']:7.2f} GB/s",
            flush=True,
        )
    emit_record(
        args,
        claim="CPU FP8 GEMV (e4m3->bf16 in registers, AVX-512 BF16) runs at the memory-bandwidth limit, "
        "4-5x faster than FP32/BF16 BLAS GEMV",
        paper_value={"speedup_vs_f32_bf16_blas": [4, 5]},
        config={
            "shapes": SHAPES,
            "m": 1,
            "set_bytes_per_variant": int(set_gib * GIB),
            "thread_counts": thread_counts,
            "variants": VARIANTS,
            "int4_group": 64,
            "gemvs_per_dispatch": GEMVS_PER_DISPATCH,
            "processes": {p: PROCESSES[p] for p in processes},
            "summary_threads": all_threads,
            "summary_is": "sum of median times over the three shapes per variant",
        },
        rows=rows,
        summary={**summary, **summary_1t},
    )


if __name__ == "__main__":
    main()
