"""Context-parallel MLA prefill over the zig-zag sequence split (plan/dist.py).

Per-rank body for `jax.shard_map`: rank r holds the hidden states of its two chunks
(r and 2N-1-r, C tokens each). It computes its tokens' queries and latent/k_rope, the
latent cache (cfg.cache_dim values per token: the only thing that crosses a link) is
all-gathered, and each query chunk c attends to key positions 0..(its own) only, through
the single-device blocked attention (model.attention.attend_blocks: query blocks, key
blocks up to the diagonal, online softmax). Chunk c visits about c+1 chunks of keys, so
every rank does about 2N+1: the zig-zag split balances causal attention. Outputs stay on
the sequence owners.

Same math as model.mla.mla_attention (the model's projections and RoPE); only the softmax
is accumulated blockwise, which reorders f32 sums (tests: ~1e-6 rel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.attention import attend_blocks
from hmoe_jax.model.layers import rms_norm
from hmoe_jax.model.mla import project_kv
from hmoe_jax.model.params import LayerParams
from hmoe_jax.model.precision import F32
from hmoe_jax.model.rope import apply_rope, rope_cos_sin
from hmoe_jax.plan.dist import ZigzagLayout


def cp_attention_block(
    layer: LayerParams,
    cfg: ModelConfig,
    h_local: jax.Array,
    layout: ZigzagLayout,
    *,
    axis: str,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-rank attention block (input norm + MLA + residual) of a prefill from position 0.
    h_local [B, 2C, D] (this rank's chunks r, 2N-1-r) -> (h_out [B, 2C, D],
    latent [B, S_pad, kv_lora_rank], k_rope [B, S_pad, dr]) where the caches are the FULL
    sequence in natural order, identical on every rank.

    Each query chunk runs model.attention.attend_blocks over the gathered cache: query
    blocks of q_block with their projections inside the block, key blocks of k_block up to
    the block's last position, online softmax; `form` ("auto": expanded for chunks of >= 256
    tokens). f32 throughout (the F32 policy). Peak temporaries: one (query block, key block)
    pair's working set plus [2C, D]-sized buffers and the [S_pad, 576] cache; no [C, C]
    score block and no q_lat for all local tokens."""
    n, c = layout.n_ranks, layout.chunk
    b, t_l, _ = h_local.shape
    if t_l != 2 * c:
        raise ValueError(f"cp_attention_block: h_local has {t_l} tokens, layout expects 2*chunk = {2 * c}")
    p = layer.attn

    rank = lax.axis_index(axis)
    chunk_a, chunk_b = rank, 2 * n - 1 - rank
    ar = jnp.arange(c, dtype=jnp.int32)
    pos = jnp.concatenate([chunk_a * c + ar, chunk_b * c + ar])  # [2C] natural positions
    x = rms_norm(h_local, layer.attn_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, jnp.broadcast_to(pos, (b, t_l)))
    latent, k_rope = project_kv(p, cfg, x)
    k_rope = apply_rope(k_rope, cos, sin)  # [B, 2C, dr]

    # The only attention communication: the compressed cache of every token.
    inverse = jnp.asarray(layout.inverse)
    lat = lax.all_gather(latent, axis, axis=1, tiled=True, to="invarying")[
        :, inverse
    ]  # [B, S_pad, R] natural order
    rop = lax.all_gather(k_rope, axis, axis=1, tiled=True, to="invarying")[:, inverse]  # [B, S_pad, dr]

    # Pad the keys to a whole number of key blocks (keys past the real ones are masked by
    # causality), so the key block never degenerates to gcd(k_block, S_pad).
    s_pad = lat.shape[1]
    bk = min(int(k_block), s_pad)
    extra = -(-s_pad // bk) * bk - s_pad
    lat_k = jnp.pad(lat, ((0, 0), (0, extra), (0, 0)))
    rop_k = jnp.pad(rop, ((0, 0), (0, extra), (0, 0)))
    rows = []
    for bi in range(b):
        halves = [
            attend_blocks(
                p,
                cfg,
                x[bi, half * c : (half + 1) * c],
                lat_k,
                rop_k,
                bi,
                chunk * c,
                prec=F32,
                form=form,
                q_block=q_block,
                k_block=bk,
                # the CPU walk everywhere: the static walk's bound (a chunk anywhere in the
                # gathered row) would visit every key block for every chunk
                walk="traced",
            )
            for half, chunk in ((0, chunk_a), (1, chunk_b))
        ]
        rows.append(jnp.concatenate(halves, axis=0))
    return h_local + jnp.stack(rows), lat, rop
