"""Random params of any ModelConfig, built through hmoe_jax.io.names.build_params (so
they follow the checkpoint contract), f32 or DeepSeek block FP8. The one builder of
in-memory random weights for tests, experiments and the trace figure; the embedded
default checkpoint has its own fixed, cache-keyed recipe (hmoe_jax.io.synthetic)."""

from __future__ import annotations

import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.names import build_params, expected_tensors
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import quantize_np


def random_params(cfg: ModelConfig, seed: int = 0, fp8: bool | None = None) -> ModelParams:
    """Every tensor of `cfg` at a scale that keeps activations O(1) through the layers
    (projections N(0, 1/fan_in), embeddings N(0, 1)); norms and the router bias are
    non-trivial so that a dropped one shows. fp8: None follows cfg.quant; True
    block-quantizes every tensor DeepSeek's release stores in FP8 (cfg.quant's blocks, else
    128x128; a reference then runs on the same Fp8Tensors); False keeps everything f32."""
    rng = np.random.default_rng(seed)
    specs = {s.name: s for s in expected_tensors(cfg)}
    quantize = cfg.quant is not None if fp8 is None else fp8
    block = (cfg.quant.block_n, cfg.quant.block_k) if cfg.quant is not None else (128, 128)

    def get(name: str) -> object:
        s = specs[name]
        if name.endswith("e_score_correction_bias"):
            x = 0.05 * rng.standard_normal(s.shape)
        elif len(s.shape) == 1:  # RMSNorm weights
            x = 1.0 + 0.1 * rng.standard_normal(s.shape)
        elif name == "model.embed_tokens.weight":
            x = rng.standard_normal(s.shape)
        else:
            x = rng.standard_normal(s.shape) / np.sqrt(s.shape[-1])
        x = x.astype(np.float32)
        return quantize_np(x, *block) if (quantize and s.quantized) else x

    return build_params(cfg, get)
