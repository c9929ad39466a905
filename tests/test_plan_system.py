"""System profiles (configs/systems/*.json) are strict like model configs: an unknown key,
a wrong type or a non-positive value is a ConfigError naming the key. Also the one
cache-length rounding rule (plan/buckets.py)."""

from __future__ import annotations

import json

import pytest

from hmoe_jax.config import ConfigError, configs_dir
from hmoe_jax.plan.buckets import CACHE_BUCKET, cache_len
from hmoe_jax.plan.system import SystemSpec, load_system, system_from_dict

SHIPPED = sorted(p.stem for p in (configs_dir() / "systems").glob("*.json"))


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="h2d_gbs"):
        system_from_dict({"h2d_gbs": 25.0})
    with pytest.raises(ConfigError, match="acc_tflops"):  # the old single rate is gone
        system_from_dict({"acc_tflops": 419.0})


@pytest.mark.parametrize(
    "key, value",
    [
        ("h2d_gbps", "fast"),
        ("h2d_gbps", 0),
        ("acc_fp8_tflops", -1.0),
        ("acc_mem_gbps", float("nan")),
        ("acc_bf16_tflops", True),
        ("num_accelerators", 2.0),  # ints stay ints
        ("num_accelerators", 0),
        ("cpu_prefill_chunk_tokens", "2048"),
        ("acc_mem_bytes", None),
        ("name", 3),
    ],
)
def test_wrong_type_or_value_is_an_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        system_from_dict({key: value}, where="s.json")


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="slp_experts_per_slot"):
        SystemSpec(slp_experts_per_slot=0)


def test_comment_and_name_are_accepted_and_ints_are_fine_rates():
    s = system_from_dict({"name": "box", "comment": "why these numbers", "h2d_gbps": 25})
    assert s.name == "box" and s.h2d_gbps == 25.0 and isinstance(s.h2d_gbps, float)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_with_per_dtype_rates(name):
    raw = json.loads((configs_dir() / "systems" / f"{name}.json").read_text())
    assert "public spec" in raw["comment"]  # where the numbers come from
    s = load_system(name)
    assert s.name == name
    assert s.acc_fp32_tflops < s.acc_bf16_tflops < s.acc_fp8_tflops
    assert s.acc_mem_gbps > 0 and s.h2d_gbps < s.acc_mem_gbps


def test_rtx5090_profiles_carry_the_public_specs():
    assert SHIPPED  # the shipped profiles are found at all
    for name in ("rtx5090_x1", "rtx5090_x2"):
        s = load_system(name)
        rates = (s.acc_fp32_tflops, s.acc_bf16_tflops, s.acc_fp8_tflops, s.acc_mem_gbps, s.h2d_gbps)
        assert rates == (105.0, 209.0, 419.0, 1792.0, 56.0)


def test_cache_len_rounds_up_to_the_bucket():
    assert CACHE_BUCKET == 64
    assert [cache_len(n) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 64, 64, 64, 128, 128, 192]
    with pytest.raises(ValueError, match="tokens"):
        cache_len(-1)
