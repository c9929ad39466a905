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


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("lat", "rope"))
def attn_route(
    layer: LayerParams, cfg: ModelConfig, h: jax.Array, lat: jax.Array, rope: jax.Array, start_pos: jax.Array
):
    """Attention, post-attention norm and gating of a MoE layer as ONE computation (one
    dispatch instead of two per layer in decode) -> (h [B, T, D], latent_l, rope_l,
    x [B*T, D], packed [B*T, D + 2k]): the routed experts' inputs x | ids | weights packed in
    one f32 array, so the hop to the host is one transfer, not three (ids < 2^24 are exact
    in f32)."""
    h, lat, rope = M.attention_block(layer, cfg, h, lat, rope, start_pos)
    x, ids, w = route_tokens(layer, cfg, h)
    return h, lat, rope, x, jnp.concatenate([x, ids.astype(jnp.float32), w], axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("lat", "rope"))
def attn_route_shared(
    layer: LayerParams, cfg: ModelConfig, h: jax.Array, lat: jax.Array, rope: jax.Array, start_pos: jax.Array
):
    """attn_route plus the shared expert(s) in the same computation (decode: one dispatch for
    everything the accelerator does before the hop) -> (h, latent_l, rope_l, shared [B*T, D],
    packed [B*T, D + 2k])."""
    h, lat, rope = M.attention_block(layer, cfg, h, lat, rope, start_pos)
    x, ids, w = route_tokens(layer, cfg, h)
    packed = jnp.concatenate([x, ids.astype(jnp.float32), w], axis=-1)
    return h, lat, rope, swiglu(layer.ffn.shared, x), packed


def unpack_route(packed: jax.Array, hidden: int, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inverse of attn_route's packing: [M, D + 2k] -> x [M, D], ids [M, k] int32, weights [M, k]."""
    return packed[:, :hidden], packed[:, hidden : hidden + k].astype(jnp.int32), packed[:, hidden + k :]


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


def row_bucket(n: int) -> int:
    """Static row count for a group of n token-expert rows: the next power of two (>= 16),
    so a prefill compiles a handful of shapes, never one per count."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("rows",))
def experts_group(
    x: jax.Array,
    acc: jax.Array,
    token: jax.Array,
    wts: jax.Array,
    off: jax.Array,
    sizes: jax.Array,
    group: ExpertsParams,
    rows: int,
) -> jax.Array:
    """acc [T, D] += the routed output of the G experts held in one ring slot.

    Grouped GEMM over exactly the group's token-expert rows: they are contiguous in the
    expert-sorted order, starting at `off` (host-known from the layer's offsets), sizes [G]
    rows per expert, padded to the static `rows` (row_bucket) and masked. The rows run
    through jax.lax.ragged_dot (gate, up, down) with the per-expert sizes; FP8 weights are
    dequantized inside this computation (no f32 copy of the weights outlives it). XLA's GPU
    lowering of ragged_dot is a grouped kernel; on CPU it is dense per group (G x the rows'
    FLOPs), which only the stand-in pays.
    """
    m = token.shape[0]
    n = sizes.sum()
    idx = jnp.minimum(off + jnp.arange(rows, dtype=jnp.int32), m - 1)  # [rows]
    tok = token[idx]
    xs = x[tok]  # [rows, D]
    gw = dense_weight(group.gate).transpose(0, 2, 1)  # [G, D, I]
    uw = dense_weight(group.up).transpose(0, 2, 1)
    dw = dense_weight(group.down).transpose(0, 2, 1)  # [G, I, D]
    hid = jax.nn.silu(jax.lax.ragged_dot(xs, gw, sizes)) * jax.lax.ragged_dot(xs, uw, sizes)  # [rows, I]
    y = jax.lax.ragged_dot(hid, dw, sizes)  # [rows, D]
    keep = jnp.arange(rows) < n
    y = y * jnp.where(keep, wts[idx], 0.0)[:, None]
    return acc.at[tok].add(jnp.where(keep[:, None], y, 0.0))
