"""tools/gpu_check.py on the CPU stand-in: its checks really compare (a planted wrong
reference makes each fail), its interval arithmetic matches a brute-force timeline, it refuses
what it must, and (slow lane) the whole script runs end to end at smoke sizes, same code path
as on a GPU, writing its JSON and a loadable profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hmoe_jax.plan.profile import load_profile, profile_names

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402

TINY_KERNELS = {"kernel_nk": [(128, 256)], "kernel_m": [1, 16], "grouped": (2, 16)}


def test_kernel_check_passes_and_a_wrong_reference_fails(monkeypatch):
    from hmoe_jax.kernels import fp8_gemm as F

    ok = gpu_check.check_kernels(TINY_KERNELS, interpret=True)
    assert ok["passed"] and {c["name"] for c in ok["checks"]} == {
        "fp8_gemm",
        "fp8_gemm_decode",
        "fp8_gemm_grouped",
    }
    real_ref = F.fp8_gemm_ref
    monkeypatch.setattr(F, "fp8_gemm_ref", lambda *a: real_ref(*a) * 1.05)  # 5% off: past the bound
    bad = gpu_check.check_kernels(TINY_KERNELS, interpret=True)
    assert not bad["passed"] and not any(c["passed"] for c in bad["checks"])


def test_logit_comparison_fails_on_a_wrong_reference():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 50)).astype(np.float32)
    prompt_len = 4
    toks = [int(t) for t in ref[prompt_len - 1 :].argmax(-1)]
    for policy in ("f32", "bf16"):
        assert gpu_check.compare_logits(ref.copy(), ref, toks, prompt_len, policy)["passed"]
    shifted = np.roll(ref, 1, axis=-1)  # a reference that disagrees everywhere
    for policy in ("f32", "bf16"):
        r = gpu_check.compare_logits(ref.copy(), shifted, toks, prompt_len, policy)
        assert not r["passed"] and not r["greedy_equal"]
    # f32 also fails on a small logit error with equal tokens; bf16 allows it
    off = ref + 0.01 * np.abs(ref).max()
    assert not gpu_check.compare_logits(off, ref, toks, prompt_len, "f32")["passed"]
    assert gpu_check.compare_logits(off, ref, toks, prompt_len, "bf16")["passed"]


def _timeline(intervals) -> np.ndarray:
    t = np.arange(200)
    return np.any([(t >= a) & (t < b) for a, b in intervals], axis=0)


def test_overlap_fraction_matches_a_timeline():
    rng = np.random.default_rng(1)
    for _ in range(20):
        copies = [tuple(sorted(rng.integers(0, 200, 2))) for _ in range(rng.integers(1, 6))]
        busy = [tuple(sorted(rng.integers(0, 200, 2))) for _ in range(rng.integers(1, 6))]
        c, b = _timeline(copies), _timeline(busy)
        want = (c & b).sum() / b.sum() if b.sum() else None
        got = gpu_check.overlap_fraction(copies, busy)
        assert (got is None and want is None) or got == pytest.approx(want)


def test_refuses_without_base_or_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")  # main sets a default otherwise
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--base is required" in capsys.readouterr().err
    if "local" in profile_names():
        with pytest.raises(SystemExit, match="no GPU.*--allow-cpu"):
            gpu_check.main(["--out", str(tmp_path), "--base", "local"])


@pytest.mark.slow
def test_engine_check_fails_on_a_wrong_reference(monkeypatch):
    cfg, params = gpu_check.model_and_params("deepseek_v3_tiny")
    real = gpu_check.reference_logits
    monkeypatch.setattr(gpu_check, "reference_logits", lambda *a: np.roll(real(*a), 3, axis=-1))
    out, eng = gpu_check.check_engine(cfg, params, gpu_check.SMOKE)
    eng.close()
    assert not out["passed"] and not out["f32"]["passed"] and not out["bf16"]["passed"]


@pytest.mark.slow
@pytest.mark.skipif("local" not in profile_names(), reason="no configs/systems/local.toml")
def test_end_to_end_on_the_cpu_stand_in(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, not an installed copy
    cmd = [sys.executable, "tools/gpu_check.py", "--allow-cpu", "--smoke-sizes", "--base", "local"]
    p = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    rec = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["passed"] and rec["passed"] and rec["failures"] == []
    want = {
        "env",
        "kernels",
        "engine",
        "decode",
        "gemm",
        "attention",
        "ring",
        "calibration",
        "profile",
        "seconds",
    }
    assert want <= set(rec)
    assert rec["env"]["jax"] and rec["env"]["backend"] == "cpu"
    assert (
        rec["engine"]["f32"]["greedy_equal"]
        and rec["engine"]["f32"]["max_rel_delta"] <= gpu_check.F32_REL_TOL
    )
    counts = [*gpu_check.COPY_THREADS, *(["auto"] if gpu_check.auto_copy_threads() else [])]
    assert {(r["device_ring"], r["copy_threads"]) for r in rec["ring"]} == {
        (m, t) for m in gpu_check.RING_MODES for t in counts
    }
    ok = [r for r in rec["ring"] if "error" not in r]
    assert ok and all(r["streamed_bytes"] > 0 and 0 <= r["overlap_of_acc_busy"] <= 1 for r in ok)
    direct = next(r for r in rec["decode"] if r["requested"] == "direct")
    assert direct["step_ms"] > 0 and {"d2h", "h2d", "experts_cpu"} <= set(direct["breakdown_ms"])
    assert all(r["fp8_kernel_tflops"] > 0 and r["bf16_dot_tflops"] > 0 for r in rec["gemm"])
    assert load_profile(str(tmp_path / "gpu_profile.toml")).values["accelerator"]["placement"] == "device"
