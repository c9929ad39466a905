import json

import pytest

from hmoe_jax.config import ConfigError, config_from_dict, load_config, named_model_config


@pytest.mark.parametrize(
    "name", ["deepseek_v3", "deepseek_v3_tiny", "deepseek_v3_bench", "kimi_k2", "kimi_k2_tiny"]
)
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


def test_bench_twin_keeps_every_layer_dim_of_deepseek_v3():
    """configs/models/deepseek_v3_bench.json: DeepSeek-V3's layer dims, attention and FP8
    format exactly; only the layer count (2, all MoE), the routed experts (32 in 4 groups of
    8, top-2 groups), the vocab (8,192) and the context (4,096) are cut."""
    import dataclasses

    real, bench = named_model_config("deepseek_v3"), named_model_config("deepseek_v3_bench")
    cut = dict(
        num_hidden_layers=2,
        first_k_dense_replace=0,
        n_routed_experts=32,
        n_group=4,
        topk_group=2,
        vocab_size=8192,
        max_position_embeddings=4096,
    )
    for f in dataclasses.fields(real):
        want = cut.get(f.name, getattr(real, f.name))
        assert getattr(bench, f.name) == want, f.name
    assert bench.hidden_size == 7168 and bench.moe_intermediate_size == 2048 and bench.cache_dim == 576
    assert bench.quant is not None and bench.rope.rope_type == "yarn"


def test_bench_twin_quick_variant():
    from hmoe_jax.io.bench_twin import bench_twin_config

    full, quick = bench_twin_config(), bench_twin_config(quick=True)
    assert full == named_model_config("deepseek_v3_bench")
    assert (quick.n_routed_experts, quick.vocab_size) == (16, 2048)
    assert quick.hidden_size == full.hidden_size and quick.num_hidden_layers == full.num_hidden_layers


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
