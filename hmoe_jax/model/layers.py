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
from hmoe_jax.model.precision import Precision
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize
from hmoe_jax.quant.int4 import Int4Tensor, dequantize_int4


def rms_norm(x: jax.Array, w: Any, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * w, statistics in f32 (as HF's DeepseekV3RMSNorm)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return jnp.asarray(w) * y


def dense_weight(w: Weight, dtype: Any = jnp.float32) -> jax.Array:
    """The weight as a plain array of `dtype` (dequantizing block FP8 or group INT4: INT4
    routed experts, `--experts-format int4`, through experts_ref)."""
    if isinstance(w, Fp8Tensor):
        return dequantize(w, dtype)
    if isinstance(w, Int4Tensor):
        return dequantize_int4(w, dtype)
    return jnp.asarray(w).astype(dtype)


def linear(x: jax.Array, w: Weight, dtype: Any = jnp.float32, *, prec: Precision | None = None) -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out] in `dtype`; with a non-exact precision
    policy, in the policy's activation dtype with f32 accumulation (policy_linear)."""
    if prec is not None and not prec.exact:
        return policy_linear(x, w, prec).astype(prec.act_dtype)
    wd = dense_weight(w, dtype)
    if wd.ndim != 2 or x.shape[-1] != wd.shape[-1]:
        raise ValueError(
            f"linear: input [..., {x.shape[-1]}] does not match weight {tuple(wd.shape)} ([out, in])"
        )
    return jnp.einsum("...k,nk->...n", x.astype(dtype), wd)


def policy_linear(x: jax.Array, w: Weight, prec: Precision) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] f32 under a bf16 policy. FP8 weights go to the
    policy's FP8 matmul hook (no dequantised copy) or are dequantised to bf16 inside this
    computation, one matrix at a time; bf16 weights to the bf16 hook or a bf16 dot; f32
    weights (f32 test models) run as stored."""
    if isinstance(w, Fp8Tensor):
        if prec.fp8_matmul is not None:
            return prec.fp8_matmul(x, w)
        wd = dequantize(w, jnp.bfloat16)
    else:
        wd = jnp.asarray(w)
        if wd.dtype == jnp.bfloat16 and prec.bf16_matmul is not None:
            return prec.bf16_matmul(x, wd)
    dt = prec.dot_dtype if wd.dtype == jnp.bfloat16 else wd.dtype
    return jnp.einsum("...k,nk->...n", x.astype(dt), wd.astype(dt), preferred_element_type=jnp.float32)


def swiglu(p: FFNParams, x: jax.Array, prec: Precision | None = None) -> jax.Array:
    """down(silu(gate x) * up x): the dense FFN and the shared expert(s). [..., D] -> [..., D]
    (f32, or the policy's activation dtype with silu(g) * u rounded to it before down)."""
    if prec is None or prec.exact:
        return linear(jax.nn.silu(linear(x, p.gate)) * linear(x, p.up), p.down)
    g = policy_linear(x, p.gate, prec)
    u = policy_linear(x, p.up, prec)
    return linear((jax.nn.silu(g) * u).astype(prec.act_dtype), p.down, prec=prec)
