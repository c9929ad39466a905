"""The GPU profile (hmoe_jax/measure/gpu_profile.py, run by tools/gpu_calibrate.py and
tools/gpu_check.py): the three fixes of issue 25 and a profile that loads.

- d2h copies a fresh device array per timed call (a jax array caches its host copy);
- the card's memory is the physical size nvidia-smi reports, not JAX's 0.75 allocator limit;
- --base (the same host's CPU-side profile) is required, with a clear error when absent;
- the profile written from measurements over a base loads under the strict profile checks,
  with the measured accelerator and link values in place and the base's CPU side.
The real run needs a GPU (docs/simulator.md); smoke sizes run here in test_gpu_check.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hmoe_jax.measure import gpu_profile
from hmoe_jax.plan.profile import load_profile, profile_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_calibrate  # noqa: E402


def test_d2h_times_a_fresh_array_every_call():
    made, copied = [], []

    def make(i):
        made.append(object())
        return made[-1]

    gpu_profile.fresh_copy_s(make, copied.append, 4)
    assert len(copied) == 5 and len({id(a) for a in copied}) == 5  # warm-up + 4 timed, all distinct
    assert [id(a) for a in copied] == [id(a) for a in made]


def test_card_memory_is_the_physical_size(monkeypatch):
    import hmoe_jax.engine.gpu as G

    monkeypatch.setattr(G, "query_gpu_mem_bytes", lambda: [32607 << 20, 81559 << 20])
    assert gpu_profile.card_memory() == (32607 << 20, "nvidia-smi memory.total (physical)")
    monkeypatch.setattr(G, "query_gpu_mem_bytes", lambda: None)
    with pytest.raises(RuntimeError, match="nvidia-smi"):
        gpu_profile.card_memory()
    ram, src = gpu_profile.card_memory(allow_cpu=True)
    assert ram > 0 and "host RAM" in src


def test_base_is_required_and_must_load(tmp_path):
    with pytest.raises(SystemExit, match="--base is required.*hmoe calibrate"):
        gpu_calibrate.main([])
    with pytest.raises(SystemExit, match="--base .*nope"):
        gpu_calibrate.main(["--base", str(tmp_path / "nope.toml")])


def test_refuses_the_cpu_without_allow_cpu():
    if "local" not in profile_names():
        pytest.skip("no configs/systems/local.toml")
    with pytest.raises(SystemExit, match="no GPU.*--allow-cpu"):
        gpu_calibrate.main(["--base", "local"])


def measurements() -> dict:
    return {
        "date_utc": "2026-12-06T00:00:00+00:00",
        "device": "NVIDIA H100 80GB HBM3",
        "devices": 1,
        "mem_bytes": 81559 << 20,
        "mem_bytes_src": "nvidia-smi memory.total (physical)",
        "gemm_n": 8192,
        "mem_bytes_read": 4096 << 20,
        "link": {
            "pinned": True,
            "h2d_gbps": {8: 40.0, 256: 52.5},
            "d2h_gbps": {8: 20.0, 256: 25.0},
            "d2h_pinned_gbps": {8: 45.0, 256: 53.0},
        },
        "gemm": {"fp32": 50.0, "bf16": 700.0, "fp8": 1300.0},
        "mem_gbps": 3000.0,
        "attention": {"tokens": 4096, "model": "deepseek_v3", "seconds": 0.01, "tflops": 300.0},
        "acc_op_s": 2e-5,
    }


@pytest.mark.skipif("local" not in profile_names(), reason="no configs/systems/local.toml")
def test_profile_from_measurements_loads_with_the_measured_values(tmp_path):
    m = measurements()
    out = tmp_path / "gpu_here.toml"
    gpu_profile.write_profile("local", out, m)
    p = load_profile(str(out))
    acc, link = p.values["accelerator"], p.values["link"]
    assert acc["bf16_tflops"] == 700.0 and acc["fp8_tflops"] == 1300.0 and acc["placement"] == "device"
    assert acc["mem_bytes"] == 81559 << 20 and "physical" in p.src["accelerator"]["mem_bytes"]
    assert link["h2d_gbps"] == 52.5 and link["d2h_gbps"] == 53.0  # the largest size; pinned d2h
    assert "fresh device array" in p.src["link"]["d2h_gbps"]
    assert p.values["cpu"] == load_profile("local").values["cpu"]  # the host side is the base's
    assert p.values["overheads"]["acc_op_s"] == 2e-5
    with pytest.raises(gpu_profile.BaseProfileMissing):
        gpu_profile.write_profile(None, out, m)
