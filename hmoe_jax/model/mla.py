"""Multi-head Latent Attention (DeepSeek-V2/V3) over the compressed latent KV cache.

The cache holds, per token and layer, the normed kv_lora part of kv_a_proj_with_mqa
(`latent`, kv_lora_rank values) and the roped shared key (`k_rope`, qk_rope_head_dim
values): cfg.cache_dim in all, never the expanded per-head K/V. Attention runs in the
absorbed form: q_nope is mapped into the latent space through kv_b's key half, scores are
q_lat . latent + q_rope . k_rope, and the latent-space output goes through kv_b's value
half. This equals HF's expanded form (same products, another summation order), which
`mla_attend_expanded` also offers (cheaper for long prefill).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, linear, rms_norm
from hmoe_jax.model.params import MLAParams
from hmoe_jax.model.rope import apply_rope, rope_cos_sin

# HF's and DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not
# config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


def project_q(p: MLAParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> q [B, T, H, qk_head_dim]."""
    if cfg.q_lora_rank is None:
        q = linear(x, p.q)
    else:
        q = linear(rms_norm(linear(x, p.q_a), p.q_a_norm, LORA_NORM_EPS), p.q_b)
    return q.reshape(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)


def project_kv(p: MLAParams, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> (latent [B, T, kv_lora_rank] normed, k_rope [B, T, qk_rope_head_dim] not yet roped)."""
    kv = linear(x, p.kv_a)  # [B, T, kv_lora_rank + dr]
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p.kv_a_norm, LORA_NORM_EPS)
    return latent, kv[..., cfg.kv_lora_rank :]


def causal_mask(start_pos: jax.Array, t: int, s_max: int) -> jax.Array:
    """[T, S_max] bool: query t (at position start_pos + t) sees cache slots 0..start_pos + t.
    Covers prefill (start_pos 0), decode (T 1) and chunked prefill (start_pos > 0, T > 1)."""
    q_pos = start_pos + jnp.arange(t)[:, None]
    return jnp.arange(s_max)[None, :] <= q_pos


def mla_qkv(
    p: MLAParams, cfg: ModelConfig, x: jax.Array, start_pos: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The new tokens' part: x [B, T, D] (input-normed) at positions start_pos.. ->
    (q_nope [B, T, H, dn], q_rope [B, T, H, dr] roped, latent [B, T, R], k_rope [B, T, dr] roped)."""
    b, t, _ = x.shape
    dn = cfg.qk_nope_head_dim
    positions = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32) + jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_cos_sin(cfg, positions)  # [B, T, dr/2]
    q = project_q(p, cfg, x)
    latent, k_rope = project_kv(p, cfg, x)
    return q[..., :dn], apply_rope(q[..., dn:], cos, sin), latent, apply_rope(k_rope, cos, sin)


def mla_attend(
    p: MLAParams,
    cfg: ModelConfig,
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache_latent: jax.Array,
    cache_rope: jax.Array,
    start_pos: jax.Array,
) -> jax.Array:
    """Absorbed attention of the queries q_nope [B, T, H, dn], q_rope [B, T, H, dr] over a
    cache that already holds them: cache_latent [B, S_max, R], cache_rope [B, S_max, dr]
    -> [B, T, D]."""
    b, t, h, dn = q_nope.shape
    dv, r = cfg.v_head_dim, cfg.kv_lora_rank
    lat = cache_latent.astype(jnp.float32)  # [B, S, R]
    rop = cache_rope.astype(jnp.float32)  # [B, S, dr]
    kv_b = dense_weight(p.kv_b).reshape(h, dn + dv, r)
    w_uk, w_uv = kv_b[:, :dn, :], kv_b[:, dn:, :]  # [H, dn, R], [H, dv, R]
    q_lat = jnp.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [B, T, H, R]
    scores = jnp.einsum("bthr,bsr->bhts", q_lat, lat) + jnp.einsum("bthd,bsd->bhts", q_rope, rop)
    scores = scores * cfg.softmax_scale  # [B, H, T, S]
    mask = causal_mask(jnp.asarray(start_pos, jnp.int32), t, lat.shape[1])
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    o_lat = jnp.einsum("bhts,bsr->bthr", probs, lat)  # [B, T, H, R]
    o = jnp.einsum("bthr,hdr->bthd", o_lat, w_uv).reshape(b, t, h * dv)
    return linear(o, p.o)


def mla_attention(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    cache_latent: jax.Array,
    cache_rope: jax.Array,
    start_pos: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] (already input-normed) at positions start_pos.. ; cache_latent
    [B, S_max, kv_lora_rank], cache_rope [B, S_max, dr] of ONE layer -> (out [B, T, D],
    new caches). The new tokens' latent/k_rope are written at start_pos before attending."""
    start_pos = jnp.asarray(start_pos, jnp.int32)
    q_nope, q_rope, latent, k_rope = mla_qkv(p, cfg, x, start_pos)
    cache_latent = jax.lax.dynamic_update_slice(
        cache_latent, latent.astype(cache_latent.dtype), (0, start_pos, 0)
    )
    cache_rope = jax.lax.dynamic_update_slice(cache_rope, k_rope.astype(cache_rope.dtype), (0, start_pos, 0))
    return mla_attend(p, cfg, q_nope, q_rope, cache_latent, cache_rope, start_pos), cache_latent, cache_rope


def mla_attend_expanded(
    p: MLAParams,
    cfg: ModelConfig,
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache_latent: jax.Array,
    cache_rope: jax.Array,
    start_pos: jax.Array,
) -> jax.Array:
    """mla_attend in HF's expanded form: per-head K_nope/V from kv_b over the cached latents,
    then ordinary attention over qk_head_dim. Same result; fewer FLOPs for long prefill
    (scores cost H*(dn+dr) instead of H*(R+dr) per query-key pair: 3x less at DeepSeek-V3
    dims), more memory ([B, S, H, dn+dv] expanded). Same shapes as mla_attend."""
    b, t, h, dn = q_nope.shape
    dv = cfg.v_head_dim
    lat = cache_latent.astype(jnp.float32)  # [B, S, R]
    rop = cache_rope.astype(jnp.float32)  # [B, S, dr]
    kv = jnp.einsum("bsr,nr->bsn", lat, dense_weight(p.kv_b)).reshape(b, -1, h, dn + dv)  # [B, S, H, dn+dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = jnp.einsum("bthd,bshd->bhts", q_nope, k_nope) + jnp.einsum("bthd,bsd->bhts", q_rope, rop)
    scores = scores * cfg.softmax_scale  # [B, H, T, S]
    mask = causal_mask(jnp.asarray(start_pos, jnp.int32), t, lat.shape[1])
    probs = jax.nn.softmax(jnp.where(mask[None, None], scores, -jnp.inf), axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, h * dv)
    return linear(o, p.o)
