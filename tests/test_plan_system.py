"""The one machine description: configs/systems/*.toml profiles, read by load_system as the
SystemSpec the engine's schedules plan with. Values are checked by the profile's one
validator (also for a SystemSpec built in code); an unknown profile name lists the known
ones; the JSON system files are gone. Also the one cache-length rounding rule
(plan/buckets.py)."""

from __future__ import annotations

import tomllib

import pytest

from hmoe_jax.config import ConfigError, configs_dir
from hmoe_jax.plan.buckets import CACHE_BUCKET, cache_len
from hmoe_jax.plan.profile import profile_names
from hmoe_jax.plan.system import SystemSpec, load_system

SYSTEMS = configs_dir() / "systems"
PAPER = "paper_epyc9355_rtx5090"
# the engine's numbers as the retired rtx5090_x1.json / _x2.json carried them (PAPER.md and
# NVIDIA's public RTX 5090 specs), written out here independently of both files
RTX5090 = dict(
    h2d_gbps=56.0,
    acc_fp32_tflops=105.0,
    acc_bf16_tflops=209.0,
    acc_fp8_tflops=419.0,
    acc_mem_bytes=34359738368,
    auto_slp_min_tokens=4096,
    auto_dslp_min_tokens=4096,
    cpu_prefill_chunk_tokens=2048,
    slp_experts_per_slot=1,
)


def test_one_file_format_for_systems():
    assert not list(SYSTEMS.glob("*.json")), "system files are TOML profiles only"
    assert PAPER in profile_names()


@pytest.mark.parametrize(
    "key, value",
    [
        ("h2d_gbps", "fast"),
        ("h2d_gbps", 0),
        ("acc_fp8_tflops", -1.0),
        ("acc_bf16_tflops", float("nan")),
        ("acc_bf16_tflops", True),
        ("num_accelerators", 2.0),  # ints stay ints
        ("num_accelerators", 0),
        ("cpu_prefill_chunk_tokens", "2048"),
        ("slp_experts_per_slot", 0),
        ("acc_mem_bytes", None),
        ("name", 3),
    ],
)
def test_direct_construction_is_checked_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        SystemSpec(**{key: value})


def test_int_rates_become_floats():
    s = SystemSpec(h2d_gbps=25)
    assert s.h2d_gbps == 25.0 and isinstance(s.h2d_gbps, float)


@pytest.mark.parametrize("devices", [1, 2])
def test_paper_profile_is_the_rtx5090_box_with_a_device_count(devices):
    s = load_system(PAPER, devices)
    assert s.name == PAPER and s.num_accelerators == devices
    for k, v in RTX5090.items():
        assert getattr(s, k) == v, k
    assert load_system(PAPER).num_accelerators == 2  # None: every accelerator the box has


def test_defaults_are_the_paper_box_with_one_accelerator():
    assert SystemSpec() == load_system(PAPER, 1)


def test_more_devices_than_the_box_has_is_an_error():
    with pytest.raises(ConfigError, match="3 accelerators requested, it has 2"):
        load_system(PAPER, 3)


def test_unknown_profile_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="not found") as e:
        load_system("rtx5090_x1")  # the retired JSON name
    for name in profile_names():
        assert name in str(e.value)


def test_schedule_section_drives_the_thresholds(tmp_path):
    raw = (SYSTEMS / f"{PAPER}.toml").read_text()
    raw = raw.replace(
        "auto_slp_min_tokens = { value = 4096,", "auto_slp_min_tokens = { value = 1024,"
    ).replace("h2d_gbps = { value = 56.0,", "h2d_gbps = { value = 25,")
    assert tomllib.loads(raw)["schedule"]["auto_slp_min_tokens"]["value"] == 1024
    f = tmp_path / "box.toml"
    f.write_text(raw)
    s = load_system(str(f), 1)
    assert s.auto_slp_min_tokens == 1024 and s.h2d_gbps == 25.0 and s.auto_dslp_min_tokens == 4096


def test_unknown_schedule_key_is_an_error_naming_it(tmp_path):
    raw = (SYSTEMS / f"{PAPER}.toml").read_text()
    raw = raw.replace("[schedule]\n", '[schedule]\nauto_slp_min_tokenz = { value = 1, src = "assumed: x" }\n')
    f = tmp_path / "box.toml"
    f.write_text(raw)
    with pytest.raises(ConfigError, match="auto_slp_min_tokenz"):
        load_system(str(f))


@pytest.mark.skipif("local" not in profile_names(), reason="no configs/systems/local.toml")
def test_local_profile_drives_the_engines_thresholds():
    raw = tomllib.loads((SYSTEMS / "local.toml").read_text())
    s = load_system("local", 2)  # a stand-in box: any number of XLA CPU devices
    assert s.num_accelerators == 2
    for k, v in raw["schedule"].items():
        assert getattr(s, k) == v["value"], k
    assert s.h2d_gbps == raw["link"]["h2d_gbps"]["value"]


def test_cache_len_rounds_up_to_the_bucket():
    assert CACHE_BUCKET == 64
    assert [cache_len(n) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 64, 64, 64, 128, 128, 192]
    with pytest.raises(ValueError, match="tokens"):
        cache_len(-1)
