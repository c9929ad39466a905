import json

import pytest

from hmoe_jax.config import ConfigError, config_from_dict, load_config, named_model_config


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_tiny", "kimi_k2", "kimi_k2_tiny"])
def test_embedded_configs_parse(name):
    cfg = named_model_config(name)
    assert cfg.cache_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_real_shapes():
    ds = named_model_config("deepseek_v3")
    assert ds.cache_dim == 576 and ds.n_routed_experts == 256 and ds.n_group == 8
    k2 = named_model_config("kimi_k2")
    assert k2.n_routed_experts == 384 and k2.n_group == 1 and k2.first_k_dense_replace == 1


def test_tiny_twins_keep_structure():
    for real, tiny in [("deepseek_v3", "deepseek_v3_tiny"), ("kimi_k2", "kimi_k2_tiny")]:
        r, t = named_model_config(real), named_model_config(tiny)
        assert (t.n_group > 1) == (r.n_group > 1)
        assert t.first_k_dense_replace >= 1 and t.n_shared_experts == r.n_shared_experts
        assert t.rope.rope_type == r.rope.rope_type == "yarn"
        assert t.hidden_size % 128 == 0 and t.moe_intermediate_size % 128 == 0
        assert t.quant is not None


def _raw(name="deepseek_v3_tiny"):
    from hmoe_jax.config import configs_dir

    return json.loads((configs_dir() / "models" / f"{name}.json").read_text())


def test_unknown_key_is_named():
    raw = _raw()
    raw["hiden_size"] = 3
    with pytest.raises(ConfigError, match="unknown config key.*hiden_size"):
        config_from_dict(raw)


def test_unsupported_value_is_named():
    raw = _raw()
    raw["scoring_func"] = "softmax"
    with pytest.raises(ConfigError, match="scoring_func='softmax'.*sigmoid"):
        config_from_dict(raw)


def test_inconsistent_groups():
    raw = _raw()
    raw["n_group"] = 3
    with pytest.raises(ConfigError, match="n_routed_experts=16 is not divisible by n_group=3"):
        config_from_dict(raw)


def test_missing_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_hf_roundtrip():
    import dataclasses

    for name in ("deepseek_v3_tiny", "kimi_k2_tiny"):
        cfg = named_model_config(name)
        back = config_from_dict(cfg.to_hf_dict())
        assert back == dataclasses.replace(cfg, model_type="deepseek_v3")
