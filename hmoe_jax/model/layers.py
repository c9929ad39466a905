"""Elementary layers: RMSNorm, a linear layer over plain or block-FP8 weights, SwiGLU.

Weights follow PyTorch's nn.Linear layout ([out, in]); an Fp8Tensor is dequantized to the
computation dtype right before the dot (the reference path; the fused CPU kernels avoid
materialising the f32 copy).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hmoe_jax.model.params import FFNParams, Weight
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize


def rms_norm(x: jax.Array, w: Any, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * w, statistics in f32 (as HF's DeepseekV3RMSNorm)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return jnp.asarray(w) * y


def dense_weight(w: Weight, dtype: Any = jnp.float32) -> jax.Array:
    """The weight as a plain array of `dtype` (dequantizing block FP8)."""
    if isinstance(w, Fp8Tensor):
        return dequantize(w, dtype)
    return jnp.asarray(w).astype(dtype)


def linear(x: jax.Array, w: Weight, dtype: Any = jnp.float32) -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out] in `dtype`."""
    wd = dense_weight(w, dtype)
    if wd.ndim != 2 or x.shape[-1] != wd.shape[-1]:
        raise ValueError(
            f"linear: input [..., {x.shape[-1]}] does not match weight {tuple(wd.shape)} ([out, in])"
        )
    return jnp.einsum("...k,nk->...n", x.astype(dtype), wd)


def swiglu(p: FFNParams, x: jax.Array) -> jax.Array:
    """down(silu(gate x) * up x): the dense FFN and the shared expert(s). [..., D] -> [..., D]"""
    return linear(jax.nn.silu(linear(x, p.gate)) * linear(x, p.up), p.down)
