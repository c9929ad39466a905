"""Model configs shared by experiments and tests."""

from __future__ import annotations

import dataclasses

from hmoe_jax.config import ModelConfig, named_model_config


def larger_moe_config(num_hidden_layers: int = 4) -> ModelConfig:
    """deepseek_v3_tiny widened to 64 experts of 3 x 512 x 512 per MoE layer (hidden 512,
    4 expert groups, top-2 groups), the first layer dense."""
    return dataclasses.replace(
        named_model_config("deepseek_v3_tiny"),
        n_routed_experts=64,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=512,
        hidden_size=512,
        num_hidden_layers=num_hidden_layers,
        first_k_dense_replace=1,
    )
