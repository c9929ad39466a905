"""The GPU check, as one prepared script (under 8 minutes on one H100): is the accelerator side
correct on this GPU, how fast are its pieces, and the box's simulator profile.

    hmoe calibrate --quick --out /tmp/host.toml                            # the host's CPU side
    python tools/gpu_check.py --base /tmp/host.toml --out results/gpu_check_h100
    python tools/gpu_check.py --base calibrate --out DIR                   # runs that calibration first
    python tools/gpu_check.py --base local --out DIR --allow-cpu --smoke-sizes   # CPU stand-in, tiny sizes

Writes DIR/gpu_check.json (everything below) and DIR/gpu_profile.toml (the profile, by
hmoe_jax/measure/gpu_profile.py), and ends stdout with a compact JSON summary. Exit status 1
when a correctness check fails (the JSON says which), 2 on bad arguments.

Checks (each compares against an independent reference and records the numbers):
- env: python, jax, jaxlib and CUDA plugin versions, devices, the card's physical memory.
- kernels: the FP8 GEMMs (kernels/fp8_gemm.py: dense, grouped, decode; interpret=False on a
  GPU) against their `_ref` on the same quantised activations, at DeepSeek-V3 expert shapes
  (M = 1, 8, 512, 4096), within the derived bound of tests/test_kernels_fp8_gemm.py.
- engine: the real-shape bench twin (configs/models/deepseek_v3_bench.json): one slp prefill
  (all positions' logits) and a few greedy decode steps, under the f32 policy (max |delta|
  of logits <= 1e-3 of max|logit|, greedy tokens equal) and the bf16 policy (median position
  within 3% of max|logit|, argmax agreeing at >= 90% of positions; tokens recorded), against the plain
  model's f32 forward on the CPU (teacher-forced over the prompt and the engine's tokens: a
  token equal to the reference argmax at every step is the reference greedy rollout).
Measurements:
- gemm: FP8 (kernel alone, and with the activation quantisation) vs bf16 (resident bf16
  weight; and dequantised per call, the pre-FP8-kernel path) TFLOPS at prefill shapes.
- attention: blocked MLA prefill attention TFLOPS of one DeepSeek-V3 layer at 4K and 8K.
- ring: SLP prefills of the twin per device ring mode (inplace, put) and copy threads
  (2, 4, 8): H2D GB/s through the staging ring (streamed bytes / load time), the host
  memcpy rate, and the fraction of accelerator busy time the copies overlap (from the trace).
- decode: the bf16 decode step (ms, untraced median) and its per-op breakdown from a traced
  step in pipelined mode (each op waited for), per hop memory mode (direct, pinned).
- profile: gpu_profile.measure (link with fresh D2H arrays, GEMMs, memory, attention, op
  overhead, and with two or more accelerators the collectives dslp / ep run, fitted as
  latency + bytes / rate) written over --base.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

F32_REL_TOL = 1e-3  # f32 policy vs f32 reference: association and GPU reduction order only
# bf16 policy vs the f32 reference: bf16 rounding at every op boundary gives ~1-3% of
# max|logit| per position (tests/test_model_parity.py), and a position where two experts'
# routing scores are closer than that rounding picks another expert and moves by tens of
# percent (as HF in bf16 would): so the typical (median) position within 3%, and the argmax
# agreeing at >= 90% of positions; the greedy tokens are recorded, the f32 run requires them.
BF16_REL_TOL, BF16_TOP1_AGREE = 3e-2, 0.9
RING_MODES = ("inplace", "put")
COPY_THREADS = (2, 4, 8)
REAL = {
    "kernel_nk": [(2048, 7168), (7168, 2048)],  # routed expert gate/up and down
    "kernel_m": [1, 8, 512, 4096],
    "grouped": (8, 512),  # experts, rows
    "gemm_nk": [(2048, 7168), (7168, 2048), (24576, 1536)],  # + q_b_proj
    "gemm_m": 4096,
    "attn_tokens": [4096, 8192],
    "attn_model": "deepseek_v3",
    "model": "deepseek_v3_bench",
    "prompt": 512,
    "decode": 4,
}
SMOKE = {
    "kernel_nk": [(256, 256)],
    "kernel_m": [1, 64],
    "grouped": (2, 64),
    "gemm_nk": [(256, 256)],
    "gemm_m": 64,
    "attn_tokens": [64, 128],
    "attn_model": "deepseek_v3_tiny",
    "model": "deepseek_v3_tiny",
    "prompt": 12,
    "decode": 3,
}


# ------------------------------------------------------------------ environment


def environment() -> dict:
    from importlib import metadata

    import jax

    from hmoe_jax.engine.gpu import query_gpu_mem_bytes

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    plugins = {
        n: version(n)
        for n in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
        if version(n)
    }
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "plugins": plugins,
        "hmoe_jax": version("hmoe-jax"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": dev.device_kind,
        "card_mem_bytes": (query_gpu_mem_bytes() or [None])[0],
        "jax_bytes_limit": (stats or {}).get("bytes_limit"),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "cpu_count": os.cpu_count(),
    }


# ------------------------------------------------------------------ FP8 kernels


def _fp8_weight(rng, shape):
    import jax.numpy as jnp

    from hmoe_jax.quant.fp8 import Fp8Tensor, quantize_np

    t = quantize_np(rng.standard_normal(shape).astype(np.float32) * 0.02)
    return Fp8Tensor(w=jnp.asarray(t.w), scale_inv=jnp.asarray(t.scale_inv))


def _compare(name: str, y, y_ref, x_q, x_s, w) -> dict:
    """The kernel vs its reference on the same quantised activations: exact e4m3 products,
    f32 sums in another order, one bf16 rounding each side (tests/test_kernels_fp8_gemm.py):
    |d| <= K 2^-24 sum|x||w| + 2^-8 (|y| + |y_ref|). The bound assumes f32 accumulation inside
    each 128-wide K block; a tensor core that accumulates FP8 products in fewer bits (Hopper's,
    per DeepSeek-V3's report) shows here as worst_delta_over_bound > 1."""
    import jax.numpy as jnp

    from hmoe_jax.quant.fp8 import dequantize

    y, y_ref = np.asarray(jnp.asarray(y, jnp.float32)), np.asarray(jnp.asarray(y_ref, jnp.float32))
    x = np.asarray(jnp.asarray(x_q, jnp.float32)) * np.repeat(np.asarray(x_s), 128, axis=1)
    wd = np.asarray(dequantize(w, jnp.float32))
    k = x.shape[1]
    bound = k * 2.0**-24 * (np.abs(x) @ np.abs(wd).T) + 2.0**-8 * (np.abs(y) + np.abs(y_ref))
    d = np.abs(y - y_ref)
    return {
        "name": name,
        "shape": [int(x.shape[0]), int(wd.shape[0]), k],
        "max_abs_delta": float(d.max()),
        "max_ref": float(np.abs(y_ref).max()),
        "max_rel_delta": float(d.max() / max(float(np.abs(y_ref).max()), 1e-30)),
        "worst_delta_over_bound": float((d / np.maximum(bound, 1e-30)).max()),
        "passed": bool(np.all(d <= bound) and np.all(np.isfinite(y))),
    }


def check_kernels(sizes: dict, interpret: bool) -> dict:
    import jax.numpy as jnp

    from hmoe_jax.kernels import fp8_gemm as F
    from hmoe_jax.quant.fp8 import Fp8Tensor

    rng = np.random.default_rng(0)
    checks = []
    for n, k in sizes["kernel_nk"]:
        w = _fp8_weight(rng, (n, k))
        for m in sizes["kernel_m"]:
            x_q, x_s = F.quantize_act_fp8(jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
            if m <= F.DECODE_ROWS:
                y = F.fp8_gemm_decode(x_q, x_s, w, interpret=interpret)
                checks.append(_compare("fp8_gemm_decode", y, F.fp8_gemm_ref(x_q, x_s, w), x_q, x_s, w))
            y = F.fp8_gemm(x_q, x_s, w, interpret=interpret)
            checks.append(_compare("fp8_gemm", y, F.fp8_gemm_ref(x_q, x_s, w), x_q, x_s, w))
        e, m = sizes["grouped"]
        ws = [_fp8_weight(rng, (n, k)) for _ in range(e)]
        wg = Fp8Tensor(w=jnp.stack([t.w for t in ws]), scale_inv=jnp.stack([t.scale_inv for t in ws]))
        cuts = np.sort(rng.integers(0, m + 1, e - 1))
        sizes_e = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
        x_q, x_s = F.quantize_act_fp8(jnp.asarray(rng.standard_normal((m, k)), jnp.float32))
        y = F.fp8_gemm_grouped(x_q, x_s, wg, jnp.asarray(sizes_e), interpret=interpret)
        y_ref = F.fp8_gemm_grouped_ref(x_q, x_s, wg, sizes_e)
        # the bound per row uses that row's expert weight
        start, parts = 0, []
        for g, size in enumerate(sizes_e):
            rows = slice(start, start + int(size))
            if size:
                parts.append(_compare("fp8_gemm_grouped", y[rows], y_ref[rows], x_q[rows], x_s[rows], ws[g]))
            start += int(size)
        worst = max(parts, key=lambda c: c["worst_delta_over_bound"])
        checks.append({**worst, "shape": [m, n, k], "experts": e, "passed": all(c["passed"] for c in parts)})
    return {"interpret": interpret, "checks": checks, "passed": all(c["passed"] for c in checks)}


# ------------------------------------------------------------------ engine vs CPU f32 reference


def model_and_params(name: str):
    from hmoe_jax.config import named_model_config

    if name == "deepseek_v3_bench":
        from hmoe_jax.io.bench_twin import bench_twin_config, fp8_twin_params

        cfg = bench_twin_config()
        return cfg, fp8_twin_params(cfg)
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config(name)
    return cfg, random_params(cfg, seed=3)


_REFERENCE: dict[tuple, np.ndarray] = {}


def reference_logits(params, cfg, ids: list[int]) -> np.ndarray:
    """[T, V] f32 logits of the plain model (dense experts_ref, f32) on the CPU device
    (kept per token sequence: both policies' runs often ask for the same one)."""
    import jax

    from hmoe_jax.model.generate import teacher_forced_logits

    key = (id(params), tuple(ids))
    if key not in _REFERENCE:
        with jax.default_device(jax.devices("cpu")[0]):
            _REFERENCE[key] = teacher_forced_logits(params, cfg, ids)
    return _REFERENCE[key]


def engine_run(eng, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], dict]:
    """slp prefill (every position's logits) + `steps` - 1 greedy decode steps ->
    (logits [T + steps - 1, V], the `steps` greedy tokens, timings)."""
    t0 = time.perf_counter()
    cache = eng.new_cache(len(prompt) + steps + 1)
    pre, _, prefill_s, plan = eng.prefill(np.asarray(prompt), cache, "slp", all_logits=True)
    rows = [np.asarray(pre, np.float32)]
    toks = [int(rows[0][-1].argmax())]
    for i in range(steps - 1):
        lg = np.asarray(eng.decode_step(toks[-1], len(prompt) + i, cache), np.float32)
        rows.append(lg[None])
        toks.append(int(lg.argmax()))
    return (
        np.concatenate(rows),
        toks,
        {"first_run_s": time.perf_counter() - t0, "ring_slots": plan.meta.get("ring_slots")},
    )


def compare_logits(got: np.ndarray, ref: np.ndarray, toks: list[int], prompt_len: int, policy: str) -> dict:
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max()  # per position
    ref_next = ref[prompt_len - 1 :].argmax(-1)  # the reference's choice after each engine token
    out = {
        "positions": int(got.shape[0]),
        "max_abs_delta": float(np.abs(got - ref).max()),
        "max_abs_ref": float(np.abs(ref).max()),
        "max_rel_delta": float(rel.max()),
        "tokens": toks,
        "reference_tokens": [int(t) for t in ref_next],
        "greedy_equal": bool(list(ref_next) == toks),
        "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).mean()),
    }
    out["median_rel_delta"] = float(np.median(rel))
    out["fraction_within_bf16_tol"] = float((rel <= BF16_REL_TOL).mean())
    if policy == "f32":
        out["passed"] = bool(rel.max() <= F32_REL_TOL and out["greedy_equal"])
    else:
        out["passed"] = bool(out["median_rel_delta"] <= BF16_REL_TOL and out["top1_agree"] >= BF16_TOP1_AGREE)
    return out


def make_engine(params, cfg, precision: str, max_len: int, **kw):
    from hmoe_jax.engine.engine import Engine

    return Engine(params, cfg, precision=precision, max_batch=1, max_len=max_len, **kw)


def check_engine(cfg, params, sizes: dict) -> tuple[dict, Any]:
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(2, cfg.vocab_size, sizes["prompt"])]
    steps = sizes["decode"]
    out: dict = {"model": sizes["model"], "prompt_tokens": len(prompt), "decode_tokens": steps}
    engines = {}
    # f32: the parity configuration (experts_ref on the host: the FFI op rounds activations to
    # bf16); bf16: the serving default (the FFI MoE op for FP8 experts where it is built)
    for policy, expert_fn in (("f32", "ref"), ("bf16", "auto")):
        eng = make_engine(params, cfg, policy, len(prompt) + steps + 8, expert_fn=expert_fn)
        got, toks, timing = engine_run(eng, prompt, steps)
        t0 = time.perf_counter()
        ref = reference_logits(params, cfg, prompt + toks[:-1])
        out[policy] = {
            **compare_logits(got, ref, toks, len(prompt), policy),
            **timing,
            "reference_s": time.perf_counter() - t0,
            "fp8_matmul": getattr(eng.prec.fp8_matmul, "__name__", None),
            "expert_fn": eng.expert_fn_name,
        }
        engines[policy] = eng
    out["passed"] = out["f32"]["passed"] and out["bf16"]["passed"]
    engines["f32"].close()
    return out, engines["bf16"]


# ------------------------------------------------------------------ rates


def _gemm_row(rng, m: int, n: int, k: int, interpret: bool, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from hmoe_jax.kernels import fp8_gemm as F
    from hmoe_jax.measure.timing import median_time
    from hmoe_jax.quant.fp8 import dequantize

    w = _fp8_weight(rng, (n, k))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    x_q, x_s = F.quantize_act_fp8(x)
    w_bf16 = dequantize(w, jnp.bfloat16)
    bf16_dot = jax.jit(lambda x, wb: jnp.dot(x, wb.T, preferred_element_type=jnp.float32))
    dequant_dot = jax.jit(
        lambda x, w: jnp.dot(x, dequantize(w, jnp.bfloat16).T, preferred_element_type=jnp.float32)
    )
    fns = {
        "fp8_kernel": lambda: F.fp8_gemm(x_q, x_s, w, interpret=interpret),
        "fp8_linear": lambda: F.fp8_linear(x, w, interpret=interpret),  # + activation quantisation
        "bf16_dot": lambda: bf16_dot(x, w_bf16),  # a resident bf16 weight
        "bf16_dequant_dot": lambda: dequant_dot(x, w),  # dequantised per call (no FP8 kernel)
    }
    row: dict = {"m": m, "n": n, "k": k}
    for name, fn in fns.items():
        row[f"{name}_tflops"] = 2 * m * n * k / median_time(fn, reps).median_s / 1e12
    row["fp8_over_bf16"] = row["fp8_kernel_tflops"] / row["bf16_dot_tflops"]
    return row


def gemm_rates(sizes: dict, interpret: bool, reps: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [_gemm_row(rng, sizes["gemm_m"], n, k, interpret, reps) for n, k in sizes["gemm_nk"]]


def attention_rates(sizes: dict, reps: int) -> list[dict]:
    from hmoe_jax.measure.gpu_profile import attention_rate

    return [attention_rate(t, reps, sizes["attn_model"]) for t in sizes["attn_tokens"]]


def _intervals(slices: list[dict], pred) -> list[tuple[int, int]]:
    return [(s["start_ns"], s["end_ns"]) for s in slices if pred(s)]


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in iv)


def overlap_fraction(copies: list[tuple[int, int]], busy: list[tuple[int, int]]) -> float | None:
    """Share of the accelerator's busy time (union of `busy`) during which a copy runs."""
    c, b = _union(copies), _union(busy)
    total = _length(b)
    if not total:
        return None
    both, i, j = 0, 0, 0
    while i < len(c) and j < len(b):
        lo, hi = max(c[i][0], b[j][0]), min(c[i][1], b[j][1])
        both += max(0, hi - lo)
        if c[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both / total


def auto_copy_threads() -> bool:
    """Whether this build's StagingRing sizes its copy threads itself (copy_threads=None)."""
    import inspect

    from hmoe_jax.runtime.staging import StagingRing

    return inspect.signature(StagingRing.__init__).parameters["copy_threads"].default is None


def ring_rates(params, cfg, prompt_len: int) -> list[dict]:
    from hmoe_jax.plan.trace import TraceRecorder

    ids = np.random.default_rng(2).integers(2, cfg.vocab_size, prompt_len)
    rows = []
    # None: the engine's own sizing (from the measured copy rate against the link), where built
    counts = (*COPY_THREADS, None) if auto_copy_threads() else COPY_THREADS
    for mode in RING_MODES:
        for threads in counts:
            row: dict = {"device_ring": mode, "copy_threads": threads if threads else "auto"}
            os.environ["HMOE_DEVICE_RING"] = mode
            try:
                eng = make_engine(params, cfg, "bf16", prompt_len + 8, copy_threads=threads)
                cache = eng.new_cache(prompt_len + 8)
                eng.prefill(ids, cache, "slp")  # warm: compiles, first-touch
                tr = TraceRecorder()
                _, run, secs, plan = eng.prefill(ids, cache, "slp", trace=tr)
                loads = _intervals(tr.slices, lambda s: s["name"].startswith("load"))
                copies = _intervals(tr.slices, lambda s: s["resource"].startswith("copy"))
                acc = _intervals(tr.slices, lambda s: s["resource"].startswith("acc"))
                streamed = int(sum(run.streamed_bytes.values()))
                row.update(
                    prefill_s=secs,
                    streamed_bytes=streamed,
                    ring_slots=plan.meta.get("ring_slots"),
                    h2d_gbps=streamed / (_length(_union(loads)) / 1e9) / 1e9 if loads else None,
                    memcpy_gbps=streamed / (_length(_union(copies)) / 1e9) / 1e9 if copies else None,
                    overlap_of_acc_busy=overlap_fraction(copies + loads, acc),
                    pinned_arena=bool(eng.ring_for(plan).pinned) if plan.meta.get("ring_slots") else None,
                )
                if threads is None and plan.meta.get("ring_slots"):
                    ring = eng.ring_for(plan)
                    row["copy_threads_chosen"] = getattr(ring, "copy_threads", None)
                    row["copy_threads_why"] = getattr(ring, "copy_threads_why", None)
                eng.close()
            except Exception as e:  # noqa: BLE001 (a mode this runtime refuses: recorded, the others go on)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                os.environ.pop("HMOE_DEVICE_RING", None)
            rows.append(row)
    return rows


def decode_hops(eng, steps: int) -> list[dict]:
    """Decode step time per hop memory mode: untraced async steps (median), and one traced
    pipelined step's per-op-kind milliseconds (each op waited for: the breakdown)."""
    import jax

    from hmoe_jax.measure.timing import median_time
    from hmoe_jax.plan.trace import TraceRecorder
    from hmoe_jax.runtime import hops

    rows = []
    cache = eng.new_cache(64)
    eng.prefill(np.arange(2, 10), cache, "slp")
    for want in ("direct", "pinned"):
        os.environ[hops.HOP_MEMORY_ENV] = want
        row: dict = {"requested": want}
        try:
            mode, why = hops.hop_memory(eng.placement.acc, eng.placement.host)
            row.update(mode=mode, why=why)
            if mode != want:
                row["skipped"] = f"{want} unavailable: {why}"
                rows.append(row)
                continue
            s = median_time(lambda: eng.decode_step(5, 8, cache), steps).median_s
            tr = TraceRecorder()
            eng.decode_rows(np.array([5]), np.array([0]), np.array([8]), cache, tr, mode="pipelined")
            per_kind: dict[str, float] = {}
            for sl in tr.slices:
                kind = sl["name"].split(" ")[0]
                per_kind[kind] = per_kind.get(kind, 0.0) + (sl["end_ns"] - sl["start_ns"]) / 1e6
            hop = [sl["args"] for sl in tr.slices if sl["name"].split(" ")[0] in ("d2h", "h2d")]
            row.update(
                step_ms=s * 1e3,
                traced_step_ms=(max(x["end_ns"] for x in tr.slices) - min(x["start_ns"] for x in tr.slices))
                / 1e6,
                breakdown_ms=per_kind,
                hop_bytes_per_layer=sum(a["moved_bytes"] for a in hop) // max(1, len(hop) // 2),
                transfers_per_layer=sum(a["transfers"] for a in hop) // max(1, len(hop) // 2),
            )
            jax.block_until_ready(cache.latent)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            os.environ.pop(hops.HOP_MEMORY_ENV, None)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ main


def host_base(base: str | None, out: Path) -> str | None:
    """--base calibrate: measure this host's CPU side now (hmoe calibrate --quick)."""
    if base != "calibrate":
        return base
    path = out / "host_profile.toml"
    subprocess.run(
        [sys.executable, "-m", "hmoe_jax.cli", "calibrate", "--quick", "--out", str(path)], check=True
    )
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_profile.toml")
    ap.add_argument(
        "--base",
        default=None,
        help="the host's CPU-side profile (hmoe calibrate --out), or 'calibrate' to measure it first: required",
    )
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU stand-in when JAX has no GPU")
    ap.add_argument("--smoke-sizes", action="store_true", help="tiny model and shapes (the CPU smoke test)")
    ap.add_argument(
        "--reps", type=int, default=None, help="timed repeats per measurement (default 5, smoke 2)"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")  # several engines + the calibration

    from hmoe_jax.engine.gpu import PlatformError, check_gpu, check_platforms
    from hmoe_jax.measure import gpu_profile

    try:
        base = gpu_profile.check_base(host_base(args.base, out))
    except gpu_profile.BaseProfileMissing as e:
        ap.error(str(e))
    check_platforms()
    try:
        check_gpu(required=not args.allow_cpu)
    except PlatformError as e:
        raise SystemExit(f"gpu_check: {e}; --allow-cpu runs this on the CPU stand-in") from None
    import jax

    sizes = SMOKE if args.smoke_sizes else REAL
    reps = args.reps or (2 if args.smoke_sizes else 5)
    interpret = jax.default_backend() == "cpu"
    t_start = time.perf_counter()
    rec: dict = {
        "argv": sys.argv[1:] if argv is None else argv,
        "sizes": "smoke" if args.smoke_sizes else "real",
    }
    rec["env"] = environment()
    seconds: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds[name] = time.perf_counter() - t0
            print(f"gpu_check: {name} {seconds[name]:.1f} s", file=sys.stderr, flush=True)

    rec["kernels"] = timed("kernels", check_kernels, sizes, interpret)
    cfg, params = timed("build_params", model_and_params, sizes["model"])
    rec["engine"], eng = timed("engine", check_engine, cfg, params, sizes)
    rec["decode"] = timed("decode", decode_hops, eng, reps)
    eng.close()
    rec["gemm"] = timed("gemm", gemm_rates, sizes, interpret, reps)
    rec["attention"] = timed("attention", attention_rates, sizes, reps)
    rec["ring"] = timed("ring", ring_rates, params, cfg, sizes["prompt"])
    m = timed("calibration", gpu_profile.measure, smoke=args.smoke_sizes, allow_cpu=args.allow_cpu)
    profile = out / "gpu_profile.toml"
    gpu_profile.write_profile(base, profile, m)
    rec["calibration"], rec["profile"] = m, str(profile)
    stats = jax.devices()[0].memory_stats() or {}
    rec["peak_gpu_bytes"] = stats.get("peak_bytes_in_use")  # None on the CPU stand-in
    seconds["total"] = time.perf_counter() - t_start
    rec["seconds"] = seconds
    failures = [k for k in ("kernels", "engine") if not rec[k]["passed"]]
    rec["passed"], rec["failures"] = not failures, failures
    (out / "gpu_check.json").write_text(json.dumps(rec, indent=1, default=str))
    summary = {
        "passed": rec["passed"],
        "failures": failures,
        "device": rec["env"]["device_kind"],
        "engine_max_rel_delta": {p: rec["engine"][p]["max_rel_delta"] for p in ("f32", "bf16")},
        "decode_step_ms": {r["requested"]: r.get("step_ms") for r in rec["decode"]},
        "collectives": {
            k: (v if k == "skipped" else {"latency_us": v["latency_s"] * 1e6, "gbps": v["gbps"]})
            for k, v in (m.get("collectives") or {}).items()
        },
        "seconds": round(seconds["total"], 1),
        "json": str(out / "gpu_check.json"),
        "profile": str(profile),
    }
    print(json.dumps(summary))
    return rec


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
