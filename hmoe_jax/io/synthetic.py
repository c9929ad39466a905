"""The embedded default model: configs/models/deepseek_v3_tiny.json with deterministic
synthetic weights, written ONCE as a real FP8 checkpoint (DeepSeek's release format) into
a cache directory and from then on loaded by the normal loader, so the default run goes
through exactly the path a downloaded checkpoint takes.

Weights: every tensor draws from its own RNG seeded by (seed, crc32(name)), so values do
not depend on the order tensors are made. Scales keep activations O(1): projections are
N(0, 1/fan_in) (variance preserving), norms are 1 + small noise, the router has unit-scale
logits (so sigmoid scores spread), and lm_head is scaled so logits have a std of a few
units: peaked enough that greedy decoding follows the context, not a flat lottery. Rows
of lm_head for ids that are not printable ASCII under the byte-level fallback tokenizer
(hmoe_jax.io.tokenizer) are scaled down by OTHER_ROW_SCALE, so the default model's
output reads as (random) text instead of replacement characters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from hmoe_jax.config import ModelConfig, QuantConfig, named_model_config
from hmoe_jax.io.cache import cache_root, install, temp_dir_for
from hmoe_jax.io.names import build_params, expected_tensors
from hmoe_jax.io.tokenizer import ByteTokenizer
from hmoe_jax.io.writer import save_checkpoint
from hmoe_jax.model.params import ModelParams

DEFAULT_MODEL = "deepseek_v3_tiny"
DEFAULT_SEED = 0
# Bump when the recipe below changes: it is part of the cache key, so old caches are
# never mistaken for new weights.
RECIPE_VERSION = 3
LOGIT_STD = 4.0  # target std of lm_head logits on unit-RMS hidden states
EMBED_STD = 1.0
BIAS_STD = 0.05  # router score-correction bias (selection only)
NORM_NOISE = 0.05
OTHER_ROW_SCALE = 0.3
BF16 = np.dtype(ml_dtypes.bfloat16)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    r = _rng(seed, name)
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return (1.0 + NORM_NOISE * r.standard_normal(shape)).astype(BF16)
    if name.endswith("e_score_correction_bias"):
        return (BIAS_STD * r.standard_normal(shape)).astype(np.float32)
    if name == "model.embed_tokens.weight":
        return (EMBED_STD * r.standard_normal(shape)).astype(BF16)
    fan_in = shape[-1]
    std = (LOGIT_STD if name == "lm_head.weight" else 1.0) / np.sqrt(fan_in)
    w = (std * r.standard_normal(shape)).astype(np.float32)
    if name == "lm_head.weight":
        w[~_printable_ids(shape[0])] *= OTHER_ROW_SCALE
    # Embed, lm_head, norms and the router are bf16 in DeepSeek's release; the other
    # matrices are quantized to FP8 by the writer, so they may stay f32 here.
    return w.astype(BF16) if name in ("lm_head.weight",) or name.endswith("mlp.gate.weight") else w


def _printable_ids(vocab_size: int) -> np.ndarray:
    """[V] bool: ids the byte-level tokenizer decodes to printable ASCII or newline."""
    byte = np.arange(vocab_size) - ByteTokenizer.OFFSET
    return ((byte >= 0x20) & (byte < 0x7F)) | (byte == 0x0A)


def synthetic_params(cfg: ModelConfig, seed: int = DEFAULT_SEED) -> ModelParams:
    """High-precision synthetic params for cfg (numpy leaves)."""
    specs = {s.name: s for s in expected_tensors(cfg)}
    return build_params(cfg, lambda n: _tensor(cfg, n, specs[n].shape, seed))


def cache_key(cfg: ModelConfig, seed: int) -> str:
    blob = json.dumps({"cfg": cfg.to_hf_dict(), "seed": seed, "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_default_checkpoint(
    name: str = DEFAULT_MODEL, seed: int = DEFAULT_SEED, progress: bool = True
) -> Path:
    """Path of the cached synthetic checkpoint, writing it first if it is not there.
    Written into a private temp dir and renamed into place, so concurrent first runs
    never see a partial checkpoint."""
    cfg = named_model_config(name)
    cfg = dataclasses.replace(cfg, quant=cfg.quant or QuantConfig())
    root = cache_root()
    final = root / f"{name}-{cache_key(cfg, seed)}"
    if (final / "config.json").exists():
        return final
    tmp = temp_dir_for(final)
    if progress:
        print(f"creating the embedded default checkpoint ({name}, seed {seed}) in {final}", file=sys.stderr)
    save_checkpoint(tmp, cfg, synthetic_params(cfg, seed), fp8=True, progress=progress)
    install(tmp, final)  # False: another process finished first; same key, same checkpoint
    return final
