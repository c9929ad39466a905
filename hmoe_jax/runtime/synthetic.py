"""Random params of any ModelConfig, built through hmoe_jax.io.names.build_params (so
they follow the checkpoint contract), f32 or DeepSeek block FP8 (cfg.quant). For tests,
experiments and the trace figure; values are scaled so activations stay O(1)."""

from __future__ import annotations

import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.names import build_params, expected_tensors
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import quantize_np


def random_params(cfg: ModelConfig, seed: int = 0) -> ModelParams:
    rng = np.random.default_rng(seed)
    specs = {s.name: s for s in expected_tensors(cfg)}

    def get(name: str) -> object:
        s = specs[name]
        if len(s.shape) == 1:
            if name.endswith("e_score_correction_bias"):
                return rng.normal(0, 0.1, s.shape).astype(np.float32)
            return (1.0 + rng.normal(0, 0.1, s.shape)).astype(np.float32)
        w = rng.normal(0, 1.0 / np.sqrt(s.shape[-1]), s.shape).astype(np.float32)
        if name == "model.embed_tokens.weight":
            w = rng.normal(0, 1.0, s.shape).astype(np.float32)
        if s.quantized and cfg.quant is not None:
            return quantize_np(w, cfg.quant.block_n, cfg.quant.block_k)
        return w

    return build_params(cfg, get)
