"""Decoupled rotary position embedding of MLA, with YaRN scaling.

Matches HF transformers' DeepseekV3RotaryEmbedding + `_compute_yarn_parameters` +
`apply_rotary_pos_emb_interleave`: the rotary dims come in interleaved pairs (x0, x1),
(x2, x3), ... each rotated by one frequency, and the result is written de-interleaved
([rotated evens | rotated odds]). Queries and keys get the same permutation, so scores are
those of the interleaved layout; the cached k_rope keeps HF's (de-interleaved) layout.
YaRN's attention factor multiplies cos and sin (so it scales q.k of the rope part by its
square); the mscale_all_dim correction of the softmax scale is `cfg.softmax_scale`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.config import ModelConfig


def _mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [qk_rope_head_dim // 2] f32, attention_factor) as HF computes them."""
    r = cfg.rope
    dim = cfg.qk_rope_head_dim
    base = r.theta
    f32 = np.float32
    # HF's arithmetic, step by step in f32 (the exponent too); only the pow runs in f64
    # and is rounded once, which agrees with torch's f32 pow to <= 1 ulp.
    exponent = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    pos_freqs = (np.float64(base) ** exponent.astype(np.float64)).astype(f32)  # [dr/2]
    if r.rope_type == "default":
        return (f32(1.0) / pos_freqs).astype(f32), 1.0
    factor = r.factor
    if r.mscale and r.mscale_all_dim:
        attention_factor = _mscale(factor, r.mscale) / _mscale(factor, r.mscale_all_dim)
    else:
        attention_factor = _mscale(factor)
    beta_fast = r.beta_fast or 32.0  # HF: `or` (a zero means the default)
    beta_slow = r.beta_slow or 1.0
    orig = r.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    # HF truncates the correction range to whole dims (truncate=True by default).
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF: prevents a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extrapolation_factor = f32(1) - ramp
    inv_extra = f32(1) / pos_freqs
    inv_inter = f32(1) / (f32(factor) * pos_freqs)
    inv_freq = inv_inter * (f32(1) - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(f32), float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) [B, T, qk_rope_head_dim // 2] f32, attention factor applied."""
    inv_freq, attention_factor = rope_parameters(cfg)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, dr/2]
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, ..., dr] interleaved pairs -> rotated, de-interleaved [B, T, ..., dr].
    cos/sin [B, T, dr/2] broadcast over the middle (head) axes."""
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
