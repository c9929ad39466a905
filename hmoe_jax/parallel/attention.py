"""Context-parallel MLA prefill over the zig-zag sequence split (plan/dist.py).

Per-rank body for `jax.shard_map`: rank r holds the hidden states of its two chunks
(r and 2N-1-r, C tokens each). It computes its tokens' queries and latent/k_rope, the
latent cache (cfg.cache_dim values per token: the only thing that crosses a link) is
all-gathered, and each query chunk c attends to key chunks 0..c only, one key chunk per
step with an online softmax. Chunk c costs c+1 steps, so every rank does 2N+1 steps: the
zig-zag split balances causal attention. Outputs stay on the sequence owners.

Same math as model.mla.mla_attention (absorbed MLA, the model's projections and RoPE);
only the softmax is accumulated blockwise, which reorders f32 sums (tests: ~1e-6 rel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, linear, rms_norm
from hmoe_jax.model.mla import project_kv, project_q
from hmoe_jax.model.params import LayerParams
from hmoe_jax.model.rope import apply_rope, rope_cos_sin
from hmoe_jax.plan.dist import ZigzagLayout


def _chunk_attention(
    q_lat: jax.Array,
    q_rope: jax.Array,
    q_pos: jax.Array,
    chunk_idx: jax.Array,
    lat: jax.Array,
    rop: jax.Array,
    c: int,
    scale: float,
) -> jax.Array:
    """One query chunk against key chunks 0..chunk_idx of the natural-order cache.
    q_lat [B, C, H, R], q_rope [B, C, H, dr], q_pos [C], lat [B, S, R], rop [B, S, dr]
    -> o_lat [B, C, H, R] (softmax-weighted latents)."""
    # zeros_like keeps q's per-rank (varying) type, which the loop carry must have.
    den0 = jnp.transpose(jnp.zeros_like(q_lat[..., 0]), (0, 2, 1))  # [B, H, C]
    m0 = den0 - jnp.inf
    acc0 = jnp.zeros_like(q_lat)  # [B, C, H, R]

    def step(j, carry):
        m, den, acc = carry
        k_lat = lax.dynamic_slice_in_dim(lat, j * c, c, axis=1)  # [B, C, R]
        k_rop = lax.dynamic_slice_in_dim(rop, j * c, c, axis=1)  # [B, C, dr]
        s = jnp.einsum("bthr,bsr->bhts", q_lat, k_lat) + jnp.einsum("bthd,bsd->bhts", q_rope, k_rop)
        s = s * scale  # [B, H, C, C]
        k_pos = j * c + jnp.arange(c)
        s = jnp.where((k_pos[None, :] <= q_pos[:, None])[None, None], s, -jnp.inf)
        # Block 0 holds key 0, visible to every query, so m is finite from the first step.
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)  # [B, H, C]
        p = jnp.exp(s - m_new[..., None])
        den_new = den * alpha + p.sum(-1)
        acc_new = acc * jnp.transpose(alpha, (0, 2, 1))[..., None] + jnp.einsum("bhts,bsr->bthr", p, k_lat)
        return m_new, den_new, acc_new

    _, den, acc = lax.fori_loop(0, chunk_idx + 1, step, (m0, den0, acc0))
    return acc / jnp.transpose(den, (0, 2, 1))[..., None]


def cp_attention_block(
    layer: LayerParams,
    cfg: ModelConfig,
    h_local: jax.Array,
    layout: ZigzagLayout,
    *,
    axis: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-rank attention block (input norm + MLA + residual) of a prefill from position 0.
    h_local [B, 2C, D] (this rank's chunks r, 2N-1-r) -> (h_out [B, 2C, D],
    latent [B, S_pad, kv_lora_rank], k_rope [B, S_pad, dr]) where the caches are the FULL
    sequence in natural order, identical on every rank."""
    n, c = layout.n_ranks, layout.chunk
    b, t_l, _ = h_local.shape
    if t_l != 2 * c:
        raise ValueError(f"cp_attention_block: h_local has {t_l} tokens, layout expects 2*chunk = {2 * c}")
    hd, dn, dv, rr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    p = layer.attn

    rank = lax.axis_index(axis)
    chunk_a, chunk_b = rank, 2 * n - 1 - rank
    ar = jnp.arange(c, dtype=jnp.int32)
    pos = jnp.concatenate([chunk_a * c + ar, chunk_b * c + ar])  # [2C] natural positions
    x = rms_norm(h_local, layer.attn_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, jnp.broadcast_to(pos, (b, t_l)))
    q = project_q(p, cfg, x)
    q_nope, q_rope = q[..., :dn], apply_rope(q[..., dn:], cos, sin)  # [B, 2C, H, dn], [B, 2C, H, dr]
    latent, k_rope = project_kv(p, cfg, x)
    k_rope = apply_rope(k_rope, cos, sin)  # [B, 2C, dr]

    # The only attention communication: the compressed cache of every token.
    inverse = jnp.asarray(layout.inverse)
    lat = lax.all_gather(latent, axis, axis=1, tiled=True, to="invarying")[
        :, inverse
    ]  # [B, S_pad, R] natural order
    rop = lax.all_gather(k_rope, axis, axis=1, tiled=True, to="invarying")[:, inverse]  # [B, S_pad, dr]

    kv_b = dense_weight(p.kv_b).reshape(hd, dn + dv, rr)
    w_uk, w_uv = kv_b[:, :dn, :], kv_b[:, dn:, :]  # [H, dn, R], [H, dv, R]
    q_lat = jnp.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [B, 2C, H, R]
    outs = []
    for half, chunk in ((0, chunk_a), (1, chunk_b)):
        sl = slice(half * c, (half + 1) * c)
        outs.append(
            _chunk_attention(q_lat[:, sl], q_rope[:, sl], pos[sl], chunk, lat, rop, c, cfg.softmax_scale)
        )
    o_lat = jnp.concatenate(outs, axis=1)  # [B, 2C, H, R]
    o = jnp.einsum("bthr,hdr->bthd", o_lat, w_uv).reshape(b, t_l, hd * dv)
    return h_local + linear(o, p.o), lat, rop
