"""The jitted per-layer pieces the executor dispatches: the model API's blocks, split where
the hybrid placement cuts them (after gating, around the routed experts), plus the
accelerator's grouped-GEMM expert kernel for SLP. `cfg` is static everywhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model import model as M
from hmoe_jax.model.layers import dense_weight, rms_norm, swiglu
from hmoe_jax.model.moe import route
from hmoe_jax.model.params import ExpertsParams, FFNParams, LayerParams, MLAParams, ModelParams

jit_cfg = functools.partial(jax.jit, static_argnames=("cfg",))


@jax.jit
def embed(embed_w: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> h [B, T, D] f32."""
    return jnp.take(embed_w, tokens, axis=0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("lat", "rope"))
def attention(
    attn_norm: jax.Array,
    attn: MLAParams,
    cfg: ModelConfig,
    h: jax.Array,
    lat: jax.Array,
    rope: jax.Array,
    start_pos: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> (h [B, T, D], latent_l [B, S, R], rope_l [B, S, dr]); the cache is donated.
    Takes only the attention weights so dense and MoE layers share one compilation."""
    layer = LayerParams(attn_norm=attn_norm, attn=attn, ffn_norm=None, ffn=None)
    return M.attention_block(layer, cfg, h, lat, rope, start_pos)


@jit_cfg
def dense_ffn(layer: LayerParams, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    return M.ffn_block(layer, cfg, h)


@jit_cfg
def route_tokens(
    layer: LayerParams, cfg: ModelConfig, h: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> x [B*T, D] (post-attention-normed, f32), ids [B*T, k], weights [B*T, k]."""
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    ids, w = route(layer.ffn, cfg, x)
    return x, ids, w


@jax.jit
def shared(p: FFNParams, x: jax.Array) -> jax.Array:
    return swiglu(p, x)


@jax.jit
def combine(h: jax.Array, routed: jax.Array, shared_out: jax.Array | None) -> jax.Array:
    """h [B, T, D] + (routed + shared) [B*T, D], summed in moe_block's order."""
    out = routed if shared_out is None else routed + shared_out
    return h + out.reshape(h.shape)


@functools.partial(jax.jit, static_argnames=("cfg", "last_only"))
def final(norm_w: jax.Array, lm_head, cfg: ModelConfig, h: jax.Array, last_only: bool) -> jax.Array:
    """h [B, T, D] -> logits [B, T or 1, V] f32."""
    if last_only:
        h = h[:, -1:]
    return M.final_logits(ModelParams(embed=None, layers=(), norm=norm_w, lm_head=lm_head), cfg, h)


@functools.partial(jax.jit, static_argnames=("n_experts",))
def sort_by_expert(ids: jax.Array, weights: jax.Array, n_experts: int):
    """ids/weights [T, k] -> assignments sorted by expert: (token [T*k], weight [T*k],
    offsets [E + 1]) with the rows of expert e at [offsets[e], offsets[e+1])."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=n_experts)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    return (order // k).astype(jnp.int32), weights.reshape(-1)[order], offsets


@jax.jit
def experts_group(
    x: jax.Array,
    acc: jax.Array,
    token: jax.Array,
    wts: jax.Array,
    offsets: jax.Array,
    lo: jax.Array,
    group: ExpertsParams,
) -> jax.Array:
    """acc [T, D] += the routed output of experts [lo, lo + G) held in one ring slot.

    Grouped GEMM: the token-expert rows of the group (contiguous in the sorted order) are
    rotated to the front and run through jax.lax.ragged_dot with the group's per-expert row
    counts; FP8 weights are dequantized inside this computation (no f32 copy of the weights
    outlives it). Rows past the group's count are masked out.
    """
    g = group.gate.shape[0]
    m = token.shape[0]
    sizes = jax.lax.dynamic_slice(offsets, (lo,), (g + 1,))
    gs = (sizes[1:] - sizes[:-1]).astype(jnp.int32)  # [G]
    rows = (jnp.arange(m, dtype=jnp.int32) + sizes[0]) % m  # [M]
    xs = x[token[rows]]  # [M, D]
    gw = dense_weight(group.gate).transpose(0, 2, 1)  # [G, D, I]
    uw = dense_weight(group.up).transpose(0, 2, 1)
    dw = dense_weight(group.down).transpose(0, 2, 1)  # [G, I, D]
    hid = jax.nn.silu(jax.lax.ragged_dot(xs, gw, gs)) * jax.lax.ragged_dot(xs, uw, gs)  # [M, I]
    y = jax.lax.ragged_dot(hid, dw, gs)  # [M, D]
    valid = jnp.arange(m) < gs.sum()
    y = y * jnp.where(valid, wts[rows], 0.0)[:, None]
    return acc.at[token[rows]].add(y)
