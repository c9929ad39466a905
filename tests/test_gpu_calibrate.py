"""tools/gpu_calibrate.py (the GPU part of the calibration) at its smoke sizes on this
machine's backend: every measurement comes back positive, and the profile it writes from
them (over a CPU-side base profile) loads under the strict profile checks with the measured
accelerator and link values in place. The real run needs a GPU (docs/simulator.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hmoe_jax.plan.profile import load_profile, profile_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_calibrate  # noqa: E402


@pytest.mark.skipif("local" not in profile_names(), reason="no configs/systems/local.toml")
def test_smoke_measures_and_writes_a_loadable_profile(tmp_path):
    m = gpu_calibrate.main(["--smoke"])
    assert all(v > 0 for v in m["link"]["h2d_gbps"].values())
    assert m["gemm"]["bf16"] > 0 and m["mem_gbps"] > 0 and m["attention"]["tflops"] > 0
    m["mem_bytes"] = 80 << 30  # what a GPU's memory_stats reports; the CPU backend has none
    out = tmp_path / "gpu_here.toml"
    gpu_calibrate.write("local", out, m)
    p = load_profile(str(out))
    assert p.values["accelerator"]["bf16_tflops"] == pytest.approx(m["gemm"]["bf16"], rel=1e-3)
    assert p.values["accelerator"]["placement"] == "device" and p.accelerators == m["devices"]
    assert p.values["cpu"] == load_profile("local").values["cpu"]  # the host side is the base's
    assert "tools/gpu_calibrate.py" in p.src["link"]["h2d_gbps"]
