"""Every tensor a checkpoint of a config holds: name, shape, and whether DeepSeek's FP8
release stores it quantized (then a `<name>_scale_inv` tensor of the block-grid shape sits
beside it). Plain data from the config alone, so the loader (io/names.py), the cost model
and the plans share one list."""

from __future__ import annotations

import dataclasses

from hmoe_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    quantized: bool  # stored as FP8 + weight_scale_inv in DeepSeek's FP8 release


def _attn_specs(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h, d = cfg.num_attention_heads, cfg.hidden_size
    s = [
        TensorSpec(f"{p}.input_layernorm.weight", (d,), False),
        TensorSpec(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (cfg.cache_dim, d), True),
        TensorSpec(f"{p}.self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), False),
        TensorSpec(
            f"{p}.self_attn.kv_b_proj.weight",
            (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            True,
        ),
        TensorSpec(f"{p}.self_attn.o_proj.weight", (d, h * cfg.v_head_dim), True),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (d,), False),
    ]
    if cfg.q_lora_rank is None:
        s.append(TensorSpec(f"{p}.self_attn.q_proj.weight", (h * cfg.qk_head_dim, d), True))
    else:
        s += [
            TensorSpec(f"{p}.self_attn.q_a_proj.weight", (cfg.q_lora_rank, d), True),
            TensorSpec(f"{p}.self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), False),
            TensorSpec(f"{p}.self_attn.q_b_proj.weight", (h * cfg.qk_head_dim, cfg.q_lora_rank), True),
        ]
    return s


def _ffn_specs(p: str, inter: int, d: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{p}.gate_proj.weight", (inter, d), True),
        TensorSpec(f"{p}.up_proj.weight", (inter, d), True),
        TensorSpec(f"{p}.down_proj.weight", (d, inter), True),
    ]


def expected_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (v, d), False)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        specs += _attn_specs(cfg, p)
        if not cfg.is_moe_layer(i):
            specs += _ffn_specs(f"{p}.mlp", cfg.intermediate_size, d)
            continue
        e = cfg.n_routed_experts
        specs += [
            TensorSpec(f"{p}.mlp.gate.weight", (e, d), False),
            TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (e,), False),
        ]
        for j in range(e):
            specs += _ffn_specs(f"{p}.mlp.experts.{j}", cfg.moe_intermediate_size, d)
        if cfg.n_shared_experts:
            specs += _ffn_specs(
                f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts, d
            )
    specs += [
        TensorSpec("model.norm.weight", (d,), False),
        TensorSpec("lm_head.weight", (v, d), False),
    ]
    return specs
