"""Context-parallel MLA prefill over the zig-zag sequence split (plan/dist.py), expanded form.

Per-rank body for `jax.shard_map`: rank r holds the hidden states of its two chunks
(r and 2N-1-r, C tokens each). It projects its tokens' latent + k_rope (cfg.cache_dim
values per token, in the cache dtype: the only thing that crosses a link), all-gathers
them, and expands K_nope / V from the gathered latents with kv_b ONCE per key block of the
row (a lax.scan into [S, H/G, dn + dv] buffers in the dot dtype), not once per query block.

The walk: query and key blocks of b = plan.costs.cp_block(C) tokens. Query block i of
chunk r and query block i of chunk 2N-1-r are walked as ONE loop of
plan.costs.cp_key_blocks(...)[i] key-block steps (a constant: the zig-zag pair needs
(2N-1) C / b + 2 (i+1) key blocks on every rank): the first n_a steps serve chunk r's
block (key blocks 0..n_a-1), the rest chunk 2N-1-r's (0..n_b-1), n_a and n_b from the rank
index. No trip count depends on data (no host sync per block on XLA:GPU), blocks above the
causal diagonal are never visited, masking bites on the diagonal blocks only, and every
rank does the same work. Online softmax with f32 statistics and accumulator; score and
P.V dots take dot-dtype operands (bf16 on a GPU under the bf16 policy) with f32
accumulation.

Head groups (G, plan.costs.cp_head_groups): heads are independent, so the K/V buffers,
queries and walk run for H/G heads at a time and o_proj is accumulated over the groups in
f32; G bounds the buffer (1 GiB) at long prompts without changing any FLOP count. The
groups are a lax.scan whose carry is the f32 output accumulator: a loop body's buffers are
allocated once, so only one group's K/V is ever live (unrolled, XLA kept every group's).

Precision: the engine's Precision (model/precision.py). F32 runs the f32 path of the
model's reference (tests: ~1e-6 rel vs model.mla); the bf16 policy keeps activations and
the cache in bf16 and sends FP8 weights to its FP8 GEMM hook (layers.policy_linear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, linear, policy_linear, rms_norm
from hmoe_jax.model.mla import LORA_NORM_EPS
from hmoe_jax.model.params import LayerParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.model.rope import apply_rope, rope_cos_sin
from hmoe_jax.plan.costs import CP_BLOCK, cp_block, cp_key_blocks
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.quant.fp8 import Fp8Tensor


def _lin32(x: jax.Array, w, prec: Precision) -> jax.Array:
    """x @ w.T with f32 output: the exact f32 path or the policy's (FP8 hook, bf16 dot)."""
    if prec.exact:
        return linear(x, w)
    return policy_linear(x.astype(prec.act_dtype), w, prec)


def _group_weight(w, g: jax.Array, size: int, axis: int):
    """Head group g's slice of a weight: `size` rows (axis 0: kv_b, q_b outputs) or columns
    (axis 1: o_proj inputs) from g * size, g traced (the group scan's index). An Fp8Tensor
    stays FP8 (dynamic slices of the e4m3 values and their scales) when the groups fall on
    its scale blocks: the FP8 hook then reads FP8, as for the whole weight. Otherwise (tiny
    test models) it was dequantised to the policy's weight dtype by _group_ready."""
    if isinstance(w, Fp8Tensor):
        blk = w.block_n if axis == 0 else w.block_k
        return Fp8Tensor(
            w=lax.dynamic_slice_in_dim(w.w, g * size, size, axis),
            scale_inv=lax.dynamic_slice_in_dim(w.scale_inv, g * (size // blk), size // blk, axis),
            block_n=w.block_n,
            block_k=w.block_k,
        )
    return lax.dynamic_slice_in_dim(w, g * size, size, axis)


def _group_ready(w, size: int, axis: int, prec: Precision):
    """w as _group_weight slices it: an Fp8Tensor whose scale blocks the groups do not
    divide whole is dequantised once (f32 for the exact policy, else bf16)."""
    if isinstance(w, Fp8Tensor):
        blk = w.block_n if axis == 0 else w.block_k
        if size % blk == 0:
            return w
        return dense_weight(w, jnp.float32 if prec.exact else jnp.bfloat16)
    return jnp.asarray(w)


def _walk(cfg, prec, q2, qr2, qpos2, k_buf, r_buf, v_buf, n_a, n_b, trips: int, b: int):
    """Online softmax of two query blocks (index 0: chunk r's, 1: chunk 2N-1-r's) over one
    loop of `trips` key-block steps: step j < n_a is (block 0, key block j), else (block 1,
    key block j - n_a), and steps past n_a + n_b are masked whole. q2 [2, b, Hg, dn],
    qr2 [2, b, Hg, dr] (dot dtype), qpos2 [2, b]; buffers [n_kb, b, Hg, dn | dv], r_buf
    [n_kb, b, dr] -> [2, b, Hg, dv] f32 (normalised). Every query sees key 0 in its
    block's first step, so the running max is finite before any fully masked step."""
    n_kb = k_buf.shape[0]
    hg, dv = q2.shape[2], v_buf.shape[-1]
    dt = prec.dot_dtype
    hi = lax.Precision.HIGHEST if prec.exact else None
    dot = lambda spec, a, c: jnp.einsum(
        spec, a.astype(dt), c.astype(dt), preferred_element_type=jnp.float32, precision=hi
    )

    def body(j, carry):
        m, l_sum, acc = carry
        which = (j >= n_a).astype(jnp.int32)
        kb = jnp.where(which == 1, j - n_a, j)
        valid = jnp.where(which == 1, kb < n_b, True)
        kb = jnp.minimum(kb, n_kb - 1)
        q, qr, qpos = q2[which], qr2[which], qpos2[which]
        s = dot("qhe,khe->qhk", q, k_buf[kb]) + dot("qhd,kd->qhk", qr, r_buf[kb])
        s = s * cfg.softmax_scale
        kpos = kb * b + jnp.arange(b)
        s = jnp.where(valid & (kpos[None, :] <= qpos[:, None])[:, None, :], s, -jnp.inf)
        m_old = m[which]
        m_new = jnp.maximum(m_old, s.max(-1))
        pr = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m_old - m_new)
        l_new = l_sum[which] * corr + pr.sum(-1)
        a_new = acc[which] * corr[..., None] + dot("qhk,khd->qhd", pr, v_buf[kb])
        return m.at[which].set(m_new), l_sum.at[which].set(l_new), acc.at[which].set(a_new)

    # built from the positions (rank-dependent) so the carry has the body's type: varying
    # over the ranks (q itself may come typed invarying out of an FFI matmul hook), and
    # from q (a float times 0 is not folded: NaN semantics) so the carry is created when
    # this block's q is, not hoisted to the start with every other block's
    zero = (q2[..., 0].astype(jnp.float32) * 0) + (qpos2 * 0).astype(jnp.float32)[..., None]
    init = (zero - jnp.inf, zero, jnp.zeros((2, b, hg, dv), jnp.float32) + zero[..., None])
    _, l_sum, acc = lax.fori_loop(0, trips, body, init)
    return acc / l_sum[..., None]


def cp_attention_block(
    layer: LayerParams,
    cfg: ModelConfig,
    h_local: jax.Array,
    layout: ZigzagLayout,
    *,
    axis: str,
    prec: Precision = F32,
    block: int = CP_BLOCK,
    head_groups: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-rank attention block (input norm + MLA + residual) of a prefill from position 0.
    h_local [B, 2C, D] (this rank's chunks r, 2N-1-r) -> (h_out [B, 2C, D] act dtype,
    latent [B, S_pad, kv_lora_rank], k_rope [B, S_pad, dr]) where the caches (cache dtype)
    are the FULL sequence in natural order, identical on every rank.

    block: the largest query / key block (plan.costs.cp_block picks the one used);
    head_groups: G, a divisor of the head count (plan.costs.cp_head_groups). Peak
    temporaries: one group's K/V buffers [S_pad, H/G, dn + dv] (dot dtype), the gathered
    cache [S_pad, 576], the rank's q_a rows and f32 output accumulator [2C, D], one pair of
    query blocks' working set (two f32 score blocks [b, H/G, b])."""
    n, c = layout.n_ranks, layout.chunk
    bsz, t_l, d = h_local.shape
    if t_l != 2 * c:
        raise ValueError(f"cp_attention_block: h_local has {t_l} tokens, layout expects 2*chunk = {2 * c}")
    h = cfg.num_attention_heads
    if head_groups < 1 or h % head_groups:
        raise ValueError(f"cp_attention_block: head_groups={head_groups} must divide the {h} heads")
    p = layer.attn
    act, dt = prec.act_dtype, prec.dot_dtype
    dn, dv, dr, r_dim, qk = (
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
        cfg.qk_rope_head_dim,
        cfg.kv_lora_rank,
        cfg.qk_head_dim,
    )
    hg = h // head_groups
    b = cp_block(c, block)
    n_qb = -(-c // b)
    s_pad = layout.padded_len
    n_kb = -(-s_pad // b)
    trips = cp_key_blocks(c, n, b)

    rank = lax.axis_index(axis)
    chunk_a, chunk_b = rank, 2 * n - 1 - rank
    ar = jnp.arange(c, dtype=jnp.int32)
    pos = jnp.concatenate([chunk_a * c + ar, chunk_b * c + ar])  # [2C] natural positions
    x = rms_norm(h_local.astype(act), layer.attn_norm, cfg.rms_norm_eps).astype(act)
    cos, sin = rope_cos_sin(cfg, jnp.broadcast_to(pos, (bsz, t_l)))
    kv = _lin32(x, p.kv_a, prec)  # [B, 2C, R + dr] f32
    latent = rms_norm(kv[..., :r_dim], p.kv_a_norm, LORA_NORM_EPS).astype(prec.cache_dtype)
    k_rope = apply_rope(kv[..., r_dim:], cos, sin).astype(prec.cache_dtype)

    # The only attention communication: the compressed cache of every token (cache dtype).
    inverse = jnp.asarray(layout.inverse)
    lat = lax.all_gather(latent, axis, axis=1, tiled=True, to="invarying")[:, inverse]  # [B, S_pad, R]
    rop = lax.all_gather(k_rope, axis, axis=1, tiled=True, to="invarying")[:, inverse]  # [B, S_pad, dr]

    # q's input rows per chunk, padded to whole query blocks: [2, n_qb b, q_in]
    def q_input(xr):
        if cfg.q_lora_rank is None:
            return xr
        return rms_norm(_lin32(xr, p.q_a, prec), p.q_a_norm, LORA_NORM_EPS).astype(act)

    q_w = p.q if cfg.q_lora_rank is None else p.q_b
    pad_q = ((0, 0), (0, n_qb * b - c), (0, 0))
    kv_b_w = _group_ready(p.kv_b, hg * (dn + dv), 0, prec)
    q_w_g = _group_ready(q_w, hg * qk, 0, prec)
    o_w_g = _group_ready(p.o, hg * dv, 1, prec)
    # natural positions of the padded query rows: [2, n_qb b]
    qpos_all = jnp.stack([chunk_a * c, chunk_b * c])[:, None] + jnp.arange(n_qb * b, dtype=jnp.int32)[None]
    qcos, qsin = rope_cos_sin(cfg, qpos_all)  # [2, n_qb b, dr/2]
    rows = []
    for bi in range(bsz):
        qin = jnp.stack(
            [jnp.pad(q_input(x[bi, half * c : (half + 1) * c])[None], pad_q)[0] for half in (0, 1)]
        )
        lat_k = jnp.pad(lat[bi], ((0, n_kb * b - s_pad), (0, 0))).reshape(n_kb, b, r_dim)
        r_buf = jnp.pad(rop[bi], ((0, n_kb * b - s_pad), (0, 0))).reshape(n_kb, b, dr).astype(dt)

        def group(out, g, qin=qin, lat_k=lat_k, r_buf=r_buf):
            # One head group: expand its K/V, walk every query-block pair, add its o_proj
            # share to the f32 accumulator carried through the scan. A scan (not a Python
            # loop) because a loop body's buffers are allocated once and reused: XLA holds
            # ONE group's K/V buffers, not every group's (unrolled, with the blocks ordered
            # by barriers, the 32K piece compiled to 5.29 GiB of temporaries; 1.79 now).
            kv_b = _group_weight(kv_b_w, g, hg * (dn + dv), 0)
            qw = _group_weight(q_w_g, g, hg * qk, 0)
            o_w = _group_weight(o_w_g, g, hg * dv, 1)

            def expand(lat_blk):
                e = _lin32(lat_blk, kv_b, prec).reshape(b, hg, dn + dv).astype(dt)
                return e[..., :dn], e[..., dn:]

            # kv_b once per key block of the row: [n_kb, b, Hg, dn] and [n_kb, b, Hg, dv]
            _, (k_buf, v_buf) = lax.scan(lambda cr, lb: (cr, expand(lb)), None, lat_k)
            for i, n_i in enumerate(trips):
                # block i reads block i-1's output (a float times 0 is not folded): this data
                # dependency orders the blocks, so one block's q and walk state is live at a
                # time. (An optimization_barrier does not: XLA:CPU drops it before scheduling
                # and computed all 16 blocks' q [2b, Hg qk] f32 first at 32K, 0.75 GiB.) Only
                # a non-finite out[0, 0, 0] changes a value: token 0's output is bad then.
                tie = (out[0, 0, :1] * 0).astype(act)
                qb = qin[:, i * b : (i + 1) * b] + tie
                q = _lin32(qb, qw, prec).reshape(2, b, hg, qk)
                qr = apply_rope(q[..., dn:], qcos[:, i * b : (i + 1) * b], qsin[:, i * b : (i + 1) * b])
                qpos2 = qpos_all[:, i * b : (i + 1) * b]
                n_a = jnp.minimum(n_kb, (chunk_a * c + (i + 1) * b + b - 1) // b)
                n_b = jnp.minimum(n_kb, (chunk_b * c + (i + 1) * b + b - 1) // b)
                o = _walk(
                    cfg,
                    prec,
                    q[..., :dn].astype(dt),
                    qr.astype(dt),
                    qpos2,
                    k_buf,
                    r_buf,
                    v_buf,
                    n_a,
                    n_b,
                    n_i,
                    b,
                )
                o = _lin32(o.astype(act).reshape(2 * b, hg * dv), o_w, prec).reshape(2, b, d)
                out = lax.dynamic_update_slice(out, out[:, i * b : (i + 1) * b] + o, (0, i * b, 0))
            return out, None

        # the carry is rank-varying (built from the positions, as _walk's), like what the
        # body adds to it
        out0 = jnp.zeros((2, n_qb * b, d), jnp.float32) + (pos[0] * 0).astype(jnp.float32)
        out, _ = lax.scan(group, out0, jnp.arange(head_groups, dtype=jnp.int32))
        rows.append(jnp.concatenate([out[0, :c], out[1, :c]], axis=0).astype(act))
    return h_local.astype(act) + jnp.stack(rows), lat, rop
