"""The real-shape DeepSeek-V3 bench twin: configs/models/deepseek_v3_bench.json (DeepSeek-V3's
layer dims exactly, 2 MoE layers of 32 routed experts in 4 groups of 8, keep 2, a vocab of
8,192) and random block-FP8 weights for it, made in memory without an f32 copy.

Experiments (e03-e06, e22) and tools/gpu_check.py time the engine on it: ~3.3 GB of
FP8 weights, far over any L3, so a decode step reads DRAM as the real model does; the vocab
is not a layer dim and would otherwise be most of the bytes (lm_head 117 MB bf16 instead of
1.85 GB). The weights' values do not matter to the timing, only that activations stay O(1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hmoe_jax.config import ModelConfig, named_model_config

BENCH_MODEL = "deepseek_v3_bench"
# --quick runs: half the experts and a quarter of the vocab (every layer dim unchanged)
QUICK_EXPERTS = 16
QUICK_VOCAB = 2048


def bench_twin_config(quick: bool = False) -> ModelConfig:
    """configs/models/deepseek_v3_bench.json; with quick, 16 experts and a vocab of 2,048."""
    cfg = named_model_config(BENCH_MODEL)
    if quick:
        cfg = dataclasses.replace(cfg, n_routed_experts=QUICK_EXPERTS, vocab_size=QUICK_VOCAB)
    return cfg


def fp8_twin_params(cfg: ModelConfig, seed: int = 0):
    """Random block-FP8 params of cfg, written straight as FP8 codes into aligned memory
    (no f32 copy of 3 GB): codes uniform over the finite e4m3 values, scales 1/(rms code *
    sqrt(fan_in)) so every projection is variance preserving."""
    import ml_dtypes

    from hmoe_jax.io.names import build_params, expected_tensors
    from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, scale_grid_shape
    from hmoe_jax.quant.hostmem import aligned_empty

    rng = np.random.default_rng(seed)
    finite = np.arange(256, dtype=np.uint8)
    finite = finite[(finite & 0x7F) != 0x7F]  # 0x7F / 0xFF are e4m3fn's NaNs
    code_rms = float(np.sqrt(np.mean(finite.view(FP8_DTYPE).astype(np.float32) ** 2)))
    specs = {s.name: s for s in expected_tensors(cfg)}

    def get(name: str):
        s = specs[name]
        if len(s.shape) == 1:
            if name.endswith("e_score_correction_bias"):
                return (0.05 * rng.standard_normal(s.shape)).astype(np.float32)
            return np.ones(s.shape, np.float32)
        if s.quantized:
            w = aligned_empty(s.shape, np.uint8)
            w[...] = finite[rng.integers(0, finite.size, s.shape, dtype=np.uint16)]
            sc = np.full(scale_grid_shape(s.shape), 1.0 / (code_rms * np.sqrt(s.shape[-1])), np.float32)
            return Fp8Tensor(w=w.view(FP8_DTYPE), scale_inv=sc)
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / np.sqrt(s.shape[-1])
        out = aligned_empty(s.shape, np.float32)
        out[...] = std * rng.standard_normal(s.shape, np.float32)
        if name == "lm_head.weight":  # bf16 as DeepSeek releases it
            return out.astype(ml_dtypes.bfloat16)
        return out

    return build_params(cfg, get)


def word_tokenizer(vocab_size: int) -> dict[str, Any]:
    """A tokenizer.json with one word per id (`<s>`, `</s>`, then w2, w3, ...): every
    generated id decodes to text, so the server streams one chunk per token."""
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for t, i in (("<s>", 0), ("</s>", 1))]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "</s>"},
    }
