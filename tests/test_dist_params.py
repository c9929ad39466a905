"""Random tiny-model parameters for the distributed tests (no torch needed), plus a check
that the FP8 variant really holds FP8 experts."""

from __future__ import annotations

import dataclasses

import numpy as np

from hmoe_jax.config import ModelConfig, named_model_config
from hmoe_jax.io.names import build_params, expected_tensors
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, quantize_np


def tiny_config(name: str = "deepseek_v3_tiny", **overrides) -> ModelConfig:
    return dataclasses.replace(named_model_config(name), **overrides)


def random_params(cfg: ModelConfig, seed: int = 0, fp8: bool = False) -> ModelParams:
    """Every tensor of `cfg` at a scale that keeps activations O(1) through the layers;
    norms and the router bias are non-trivial so that a dropped one shows. With fp8, every
    tensor DeepSeek's release stores in FP8 is block-quantized (the reference then runs
    on the same Fp8Tensors)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, object] = {}
    for spec in expected_tensors(cfg):
        if spec.name.endswith("norm.weight") or spec.name.endswith("layernorm.weight"):
            x = 1.0 + 0.1 * rng.standard_normal(spec.shape)
        elif spec.name.endswith("e_score_correction_bias"):
            x = 0.05 * rng.standard_normal(spec.shape)
        elif spec.name == "model.embed_tokens.weight":
            x = rng.standard_normal(spec.shape)
        else:
            x = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])
        x = x.astype(np.float32)
        tensors[spec.name] = quantize_np(x) if (fp8 and spec.quantized) else x
    return build_params(cfg, tensors.__getitem__)


def test_fp8_params_hold_fp8_experts():
    cfg = tiny_config()
    p = random_params(cfg, fp8=True)
    moe = p.layers[cfg.first_k_dense_replace].ffn
    assert isinstance(moe.experts.gate, Fp8Tensor)
    assert moe.experts.gate.w.dtype == FP8_DTYPE
    assert moe.experts.gate.w.shape == (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert not isinstance(random_params(cfg).layers[-1].ffn.experts.gate, Fp8Tensor)
