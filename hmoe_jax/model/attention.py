"""Memory-bounded MLA for the engine: blocked (flash-style) prefill and batched decode over
a pool of per-sequence cache rows. `mla.mla_attend` (dense scores, one softmax) is the
reference these are tested against.

Prefill (one sequence, T new tokens at positions start..start+T-1 of cache row `row`):
the new tokens' latent/k_rope are written into the row, then queries run in blocks of
`q_block` (projections, RoPE, attention and o_proj inside the block, so no [T, H, ...]
tensor exists) and each query block walks the key blocks 0..(its last position)/k_block
with an online softmax (blocks entirely above the causal diagonal are never visited;
masking only bites on the diagonal block). Peak temporaries are those of one (query
block, key block) pair: independent of T beyond the block sizes.

Two forms of the same maths (mla.py explains absorbed vs expanded):
- "expanded" (long prefill): key latents go through kv_b into per-head K_nope / V, scores
  cost H (dn + dr) per query-key pair: ~3x fewer FLOPs than absorbed at DeepSeek-V3 dims.
  Two walks (attend_blocks): on a CPU ("traced") each query block re-expands the key blocks
  it visits ([k_block, H, dn + dv] at a time) and stops at its causal limit; on an
  accelerator ("static") kv_b runs once per key block into bf16 K/V buffers of the row and
  every trip count is a constant.
- "absorbed" (decode, short chunks): queries are mapped into the latent space
  (q_lat = W_uk^T q_nope) and attend to the 576-value cache directly; the latent output
  goes through W_uv. No per-key expansion, H (2 R + dr) per pair.
`plan.costs.attn_flops` prices exactly these forms and block walks.

Decode (B rows at their own positions pos[b]): absorbed form over the rows' valid prefix,
read as the first `kv_len` cache slots (a static bucket >= max(pos) + 1), masked per row.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, linear, rms_norm
from hmoe_jax.model.mla import LORA_NORM_EPS
from hmoe_jax.model.params import MLAParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.model.rope import apply_rope, rope_cos_sin
from hmoe_jax.plan.costs import static_key_blocks  # the cost model prices the same bound
from hmoe_jax.quant.fp8 import Fp8Tensor

FORMS = ("auto", "absorbed", "expanded")
WALKS = ("auto", "traced", "static")
# Below this many query tokens the absorbed form is cheaper (the expanded form pays the
# per-key expansion through kv_b for every query block; see plan.costs.attn_flops).
EXPANDED_MIN_TOKENS = 256


def resolve_form(form: str, tokens: int) -> str:
    if form not in FORMS:
        raise ValueError(f"attention form {form!r}: expected one of {FORMS}")
    if form == "auto":
        return "expanded" if tokens >= EXPANDED_MIN_TOKENS else "absorbed"
    return form


def key_block(k_block: int, cache_len: int) -> int:
    """The key block actually used: a divisor of the cache length (cache lengths are
    multiples of 64, plan.buckets), so every dynamic slice of a block stays in bounds."""
    return math.gcd(int(k_block), int(cache_len))


def _lin(x, w, prec: Precision):
    return linear(x, w, prec=prec)


def _project_q(p: MLAParams, cfg: ModelConfig, prec: Precision, x: jax.Array) -> jax.Array:
    """x [M, D] -> q [M, H, qk_head_dim] (act dtype)."""
    if cfg.q_lora_rank is None:
        q = _lin(x, p.q, prec)
    else:
        qa = rms_norm(_lin(x, p.q_a, prec), p.q_a_norm, LORA_NORM_EPS).astype(prec.act_dtype)
        q = _lin(qa, p.q_b, prec)
    return q.reshape(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)


def _project_kv(p: MLAParams, cfg: ModelConfig, prec: Precision, x: jax.Array, pos: jax.Array):
    """x [M, D] at positions pos [M] -> (latent [M, R] normed, k_rope [M, dr] roped)."""
    kv = _lin(x, p.kv_a, prec)
    latent = rms_norm(kv[..., : cfg.kv_lora_rank], p.kv_a_norm, LORA_NORM_EPS)
    cos, sin = rope_cos_sin(cfg, pos[None])  # [1, M, dr/2]
    k_rope = apply_rope(kv[None, :, cfg.kv_lora_rank :].astype(jnp.float32), cos, sin)[0]
    return latent, k_rope


def _rope_q(cfg: ModelConfig, q: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [M, H, qk] at positions pos [M] -> (q_nope [M, H, dn], q_rope [M, H, dr] roped, f32)."""
    dn = cfg.qk_nope_head_dim
    cos, sin = rope_cos_sin(cfg, pos[None])
    q_rope = apply_rope(q[None, :, :, dn:].astype(jnp.float32), cos, sin)[0]
    return q[..., :dn], q_rope


def _dot(spec: str, a, b, prec: Precision):
    dt = prec.dot_dtype
    return jnp.einsum(
        spec,
        a.astype(dt),
        b.astype(dt),
        preferred_element_type=jnp.float32,
        precision=prec.matmul_precision,
    )


def _head_matmul(
    p: MLAParams, cfg: ModelConfig, prec: Precision, x: jax.Array, which: str, rowwise: bool
) -> jax.Array:
    """One of kv_b's per-head halves applied to x [M, H, K] -> [M, H, N] f32. which "uk":
    W_uk^T (K = dn, N = R); "uv": W_uv (K = R, N = dv). Weights as placement derived them
    (state.absorbed_weights: FP8 [H, N, K] for the per-head kernel hook, or arrays
    w_uk [H, dn, R] / w_uv [H, dv, R]); without them, sliced from kv_b here. rowwise: each
    row's result must not depend on M (decode: the rows are other sequences)."""
    h, dn, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    w = p.w_uk if which == "uk" else p.w_uv
    if isinstance(w, Fp8Tensor) and prec.fp8_head_matmul is not None:
        return prec.fp8_head_matmul(x, w)
    if w is None or isinstance(w, Fp8Tensor):
        kv_b = dense_weight(p.kv_b, prec.dot_dtype).reshape(h, dn + cfg.v_head_dim, r)
        w = kv_b[:, :dn] if which == "uk" else kv_b[:, dn:]
    row_spec = "hd,hdr->hr" if which == "uk" else "hr,hdr->hd"  # one row: [H, K] -> [H, N]
    if not rowwise:
        return _dot("m" + row_spec.replace("->", "->m"), x, w, prec)
    # On XLA:CPU a dot's result for one row depends on how many rows share it (M=1 takes
    # another path that sums in another order; so does a fused multiply-reduce, measured on
    # an AVX2 host), so a decode row's logits would depend on the batch it runs in. On a CPU
    # each row therefore runs through the same one-row product: its sums cannot depend on
    # the row count. Other backends keep the one batched dot. Prefill keeps it everywhere: a
    # chunk is one sequence's tokens, the same rows whatever else is running (and XLA's cost
    # analysis, which counts a loop body once, sees all of its FLOPs).
    return lax.platform_dependent(
        x,
        w,
        cpu=lambda x, w: per_row(lambda xr: _dot(row_spec, xr, w, prec), x),
        default=lambda x, w: _dot("m" + row_spec.replace("->", "->m"), x, w, prec),
    )


def per_row(fn, x: jax.Array) -> jax.Array:
    """fn over the rows of x [M, ...] one at a time (lax.map): every row goes through the
    same one-row computation, so its result is the same for any M (a batched op's need
    not be). Costs M sequential small ops: for the CPU stand-in's small per-head products."""
    return lax.map(fn, x)


def q_absorb(
    p: MLAParams, cfg: ModelConfig, prec: Precision, q_nope: jax.Array, *, rowwise: bool = False
) -> jax.Array:
    """q_nope [M, H, dn] -> q_lat [M, H, R] f32 (W_uk^T q_nope per head). rowwise: a row's
    result independent of M (decode; _head_matmul)."""
    return _head_matmul(p, cfg, prec, q_nope, "uk", rowwise)


def o_unabsorb(
    p: MLAParams, cfg: ModelConfig, prec: Precision, o_lat: jax.Array, *, rowwise: bool = False
) -> jax.Array:
    """o_lat [M, H, R] -> o [M, H, dv] f32 (W_uv o_lat per head). rowwise: as q_absorb's."""
    return _head_matmul(p, cfg, prec, o_lat, "uv", rowwise)


def _write_span(cache: jax.Array, row: jax.Array, start: jax.Array, new: jax.Array) -> jax.Array:
    """cache [N, S, X] with new [T, X] written at row, positions start..start+T-1."""
    return lax.dynamic_update_slice(cache, new[None].astype(cache.dtype), (row, start, 0))


def _flash(
    cfg: ModelConfig,
    prec: Precision,
    q_score: jax.Array,
    q_rope: jax.Array,
    qpos: jax.Array,
    keys_of,
    n_kb: jax.Array | int,
    kb_size: int,
    out_dim: int,
    unroll: bool = False,
) -> jax.Array:
    """Online-softmax attention of one query block over key blocks 0..n_kb-1 (a static int
    n_kb gives a loop with a known trip count; unroll=True unrolls it: compile-time probes).
    q_score [Bq, H, E] and q_rope [Bq, H, dr] (f32); keys_of(kb) -> (k [Bk, H or 1, E],
    rope [Bk, dr], v [Bk, H or 1, out_dim]) -> out [Bq, H, out_dim] f32 (normalised)."""
    bq, h = q_score.shape[:2]
    scale = cfg.softmax_scale

    def body(kb, carry):
        m, l_sum, acc = carry
        k, rope, v = keys_of(kb)
        s = (
            _dot("qhe,khe->qhk", q_score, k, prec)
            if k.shape[1] == h
            else _dot("qhe,ke->qhk", q_score, k[:, 0], prec)
        )
        s = (s + _dot("qhd,kd->qhk", q_rope, rope, prec)) * scale
        kpos = kb * kb_size + jnp.arange(kb_size)
        s = jnp.where((kpos[None, :] <= qpos[:, None])[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        pr = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l_sum = l_sum * corr + pr.sum(-1)
        pv = _dot("qhk,khd->qhd", pr, v, prec) if v.shape[1] == h else _dot("qhk,kd->qhd", pr, v[:, 0], prec)
        return m_new, l_sum, acc * corr[..., None] + pv

    # Built from the queries so the carry has their type (under shard_map: varying over ranks).
    zero = jnp.zeros_like(q_score[..., 0], dtype=jnp.float32)  # [Bq, H]
    init = (zero - jnp.inf, zero, jnp.zeros((bq, h, out_dim), jnp.float32) + zero[..., None])
    _, l_sum, acc = lax.fori_loop(0, n_kb, body, init, unroll=unroll)
    return acc / l_sum[..., None]


def prefill_attention(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    cache_lat: jax.Array,
    cache_rope: jax.Array,
    row: jax.Array,
    start: jax.Array,
    *,
    prec: Precision = F32,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
    walk: str = "auto",
    unroll: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] (input-normed) of one sequence at positions start.. in cache row `row`;
    cache_lat [N, S, R], cache_rope [N, S, dr] -> (out [T, D] act dtype, caches).
    walk, unroll: attend_blocks'."""
    t = x.shape[0]
    row, start = jnp.asarray(row, jnp.int32), jnp.asarray(start, jnp.int32)
    x = x.astype(prec.act_dtype)
    latent, k_rope = _project_kv(p, cfg, prec, x, start + jnp.arange(t, dtype=jnp.int32))
    cache_lat = _write_span(cache_lat, row, start, latent)
    cache_rope = _write_span(cache_rope, row, start, k_rope)
    out = attend_blocks(
        p,
        cfg,
        x,
        cache_lat,
        cache_rope,
        row,
        start,
        prec=prec,
        form=form,
        q_block=q_block,
        k_block=k_block,
        walk=walk,
        unroll=unroll,
    )
    return out, cache_lat, cache_rope


def attend_blocks(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    cache_lat: jax.Array,
    cache_rope: jax.Array,
    row: jax.Array,
    start: jax.Array,
    *,
    prec: Precision = F32,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
    walk: str = "auto",
    unroll: bool = False,
) -> jax.Array:
    """The blocked attention of prefill_attention over a cache that already holds the keys:
    x [T, D] (input-normed) at positions start..start+T-1 attends to slots 0..(its position)
    of cache row `row` (cache_lat [N, S, R], cache_rope [N, S, dr]) -> out [T, D] act dtype
    (after o_proj). Query blocks of q_block (projections inside the block), key blocks of
    key_block(k_block, S) up to each query block's last position (clipped to the cache);
    slots past a query's position are masked, so a cache padded past the real tokens is fine.
    parallel/attention.py calls it for each rank's query chunks over the gathered cache.

    walk (expanded form only): "traced" is the CPU path and the reference of the other one:
    key blocks up to each query block's last position, a trip count from `start` (free on
    a CPU) and kv_b re-run for every query block. "static" is the accelerator's
    (_expanded_static): kv_b once per key block, static trip counts. "auto" stages both and
    lets lowering pick by platform (lax.platform_dependent: cpu -> traced, else static), so
    the CPU engine runs what it ran before and an export for CUDA holds only the static walk.
    unroll: unroll the static walk's loops (compile-time FLOP probes: XLA's cost analysis
    counts a loop body once)."""
    t = x.shape[0]
    s_len = cache_lat.shape[1]
    form = resolve_form(form, t)
    if walk not in WALKS:
        raise ValueError(f"attention walk {walk!r}: expected one of {WALKS}")
    bq = min(q_block, t)
    bk = key_block(k_block, s_len)
    row, start = jnp.asarray(row, jnp.int32), jnp.asarray(start, jnp.int32)
    x = x.astype(prec.act_dtype)
    if form == "expanded" and walk != "traced":
        args = (x, cache_lat, cache_rope, row, start)
        static = functools.partial(_expanded_static, p, cfg, prec, bq=bq, bk=bk, unroll=unroll)
        if walk == "static":
            return static(*args)
        traced = functools.partial(_traced, p, cfg, prec, form=form, bq=bq, bk=bk)
        return lax.platform_dependent(*args, cpu=traced, default=static)
    return _traced(p, cfg, prec, x, cache_lat, cache_rope, row, start, form=form, bq=bq, bk=bk)


def _traced(p, cfg, prec, x, cache_lat, cache_rope, row, start, *, form, bq, bk):
    """attend_blocks' traced walk (the CPU path; the absorbed form everywhere)."""
    t, d = x.shape
    s_len = cache_lat.shape[1]
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def key_slices(kb):
        lat = lax.dynamic_slice(cache_lat, (row, kb * bk, 0), (1, bk, r))[0]
        rope = lax.dynamic_slice(cache_rope, (row, kb * bk, 0), (1, bk, cfg.qk_rope_head_dim))[0]
        return lat, rope

    def expanded_keys(kb):
        lat, rope = key_slices(kb)
        kv = _lin(lat, p.kv_b, prec).reshape(bk, h, dn + dv)
        return kv[..., :dn], rope, kv[..., dn:]

    def absorbed_keys(kb):
        lat, rope = key_slices(kb)
        return lat[:, None], rope, lat[:, None]

    n_qb = -(-t // bq)
    xs = jnp.pad(x, ((0, n_qb * bq - t), (0, 0))).reshape(n_qb, bq, d)

    def q_block_out(args):
        qi, xb = args
        qpos = start + qi * bq + jnp.arange(bq, dtype=jnp.int32)
        q_nope, q_rope = _rope_q(cfg, _project_q(p, cfg, prec, xb), qpos)
        # key blocks up to this query block's last position (clipped to the cache)
        n_kb = jnp.minimum((start + (qi + 1) * bq - 1) // bk + 1, s_len // bk)
        if form == "expanded":
            o = _flash(cfg, prec, q_nope, q_rope, qpos, expanded_keys, n_kb, bk, dv)
        else:
            q_lat = q_absorb(p, cfg, prec, q_nope)
            o = o_unabsorb(p, cfg, prec, _flash(cfg, prec, q_lat, q_rope, qpos, absorbed_keys, n_kb, bk, r))
        return _lin(o.astype(prec.act_dtype).reshape(bq, h * dv), p.o, prec)

    out = lax.map(q_block_out, (jnp.arange(n_qb, dtype=jnp.int32), xs)).reshape(n_qb * bq, d)[:t]
    return out.astype(prec.act_dtype)


def _expanded_static(p, cfg, prec, x, cache_lat, cache_rope, row, start, *, bq, bk, unroll):
    """The expanded form for an accelerator. kv_b runs once per key block of the row (one
    lax.scan over the S / bk key blocks) into K_nope [S, H, dn] and V [S, H, dv] buffers in
    the dot dtype (bf16 under the bf16 policy: 2 GiB for a 32K row of DeepSeek-V3, live for
    the call), instead of once per (query block, key block) pair. Query blocks are unrolled
    (T / bq of them) so each one's key walk has a constant trip count (static_key_blocks):
    no loop bound depends on data, so XLA:GPU never copies a loop predicate to the host.
    Dots take dot-dtype operands with f32 accumulation; the online softmax statistics and
    the output accumulator are f32 (_flash)."""
    t, d = x.shape
    s_len = cache_lat.shape[1]
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    dr, dt = cfg.qk_rope_head_dim, prec.dot_dtype
    n_kb = s_len // bk
    lat_row = lax.dynamic_index_in_dim(cache_lat, row, keepdims=False)[: n_kb * bk]
    rope_row = lax.dynamic_index_in_dim(cache_rope, row, keepdims=False)[: n_kb * bk]

    def expand(lat):
        kv = _lin(lat, p.kv_b, prec).reshape(bk, h, dn + dv).astype(dt)
        return kv[..., :dn], kv[..., dn:]

    _, (k_nope, v) = lax.scan(  # [n_kb, bk, H, dn / dv]
        lambda c, lat: (c, expand(lat)), None, lat_row.reshape(n_kb, bk, r), unroll=unroll
    )
    rope = rope_row.reshape(n_kb, bk, dr).astype(dt)

    def keys_of(kb):
        return k_nope[kb], rope[kb], v[kb]

    n_qb = -(-t // bq)
    xp = jnp.pad(x, ((0, n_qb * bq - t), (0, 0)))
    out = jnp.zeros((n_qb * bq, d), prec.act_dtype)
    for i, n_i in enumerate(static_key_blocks(t, s_len, bq, bk)):
        # The barrier makes block i's queries wait for block i-1's output: without it the
        # scheduler may run all T / bq projections first and keep every block's q and
        # accumulator live (8.75 GiB instead of ~3 at 32K, measured on XLA:CPU).
        xb, out = lax.optimization_barrier((xp[i * bq : (i + 1) * bq], out))
        qpos = start + i * bq + jnp.arange(bq, dtype=jnp.int32)
        q_nope, q_rope = _rope_q(cfg, _project_q(p, cfg, prec, xb), qpos)
        o = _flash(cfg, prec, q_nope.astype(dt), q_rope.astype(dt), qpos, keys_of, n_i, bk, dv, unroll)
        o = _lin(o.astype(prec.act_dtype).reshape(bq, h * dv), p.o, prec)
        out = lax.dynamic_update_slice(out, o.astype(prec.act_dtype), (i * bq, 0))
    return out[:t]


def decode_attention(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    cache_lat: jax.Array,
    cache_rope: jax.Array,
    rows: jax.Array,
    pos: jax.Array,
    kv_len: int,
    *,
    prec: Precision = F32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One new token per row: x [B, D] (input-normed) of rows `rows` [B] at positions
    pos [B]; attends to slots 0..pos[b] of its row, read from the first kv_len (static,
    >= max(pos) + 1) slots -> (out [B, D] act dtype, caches)."""
    out, latent, k_rope = decode_attention_unwritten(
        p, cfg, x, cache_lat, cache_rope, rows, pos, kv_len, prec=prec
    )
    return (out, *write_kv_rows(cache_lat, cache_rope, rows, pos, latent, k_rope))


def decode_attention_unwritten(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    cache_lat: jax.Array,
    cache_rope: jax.Array,
    rows: jax.Array,
    pos: jax.Array,
    kv_len: int,
    *,
    prec: Precision = F32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """decode_attention without the cache write -> (out [B, D], latent [B, R], k_rope [B, dr]):
    the caches are only read, the new tokens' own keys (in the cache dtype, as a write and
    a read would give them) patched into the rows read, and the new keys returned for the
    caller to write (write_kv_rows). Why: XLA:CPU widens a bf16 write to f32 and cannot
    alias it, so a write inside the computation that reads the cache costs two passes over
    the whole pool per layer (1.9 ms of the bench twin's 45 ms batch-1 step at 4 rows x 4K
    slots, measured 2026-12-07; it grows with the pool), where a separate in-place write
    of the new rows costs one dispatch."""
    b = x.shape[0]
    h, dv = cfg.num_attention_heads, cfg.v_head_dim
    rows, pos = jnp.asarray(rows, jnp.int32), jnp.asarray(pos, jnp.int32)
    x = x.astype(prec.act_dtype)
    latent, k_rope = _project_kv(p, cfg, prec, x, pos)
    latent, k_rope = latent.astype(cache_lat.dtype), k_rope.astype(cache_rope.dtype)
    q_nope, q_rope = _rope_q(cfg, _project_q(p, cfg, prec, x), pos)
    q_lat = q_absorb(p, cfg, prec, q_nope, rowwise=True)  # [B, H, R]: rows of other sequences
    own = (jnp.arange(kv_len)[None, :] == pos[:, None])[..., None]  # [B, L, 1]: the new token's slot
    lat = jnp.where(own, latent[:, None], cache_lat[rows, :kv_len])  # [B, L, R]: the rows' valid prefix
    rope = jnp.where(own, k_rope[:, None], cache_rope[rows, :kv_len])
    s = _dot("bhr,blr->bhl", q_lat, lat, prec) + _dot("bhd,bld->bhl", q_rope, rope, prec)
    s = s * cfg.softmax_scale
    s = jnp.where((jnp.arange(kv_len)[None, :] <= pos[:, None])[:, None, :], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    o_lat = _dot("bhl,blr->bhr", probs, lat, prec)
    o = o_unabsorb(p, cfg, prec, o_lat, rowwise=True)  # [B, H, dv]
    out = _lin(o.astype(prec.act_dtype).reshape(b, h * dv), p.o, prec)
    return out.astype(prec.act_dtype), latent, k_rope


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def write_kv_rows(
    cache_lat: jax.Array,
    cache_rope: jax.Array,
    rows: jax.Array,
    pos: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The caches with decode_attention_unwritten's new keys written at (rows[b], pos[b]).
    One dynamic-update-slice per row (B is static and small) on the caches' raw bits: on
    integer words XLA:CPU keeps the writes in place in a donated cache (~0.06 ms), where a
    bf16 scatter or dynamic-update-slice is widened to f32 over the whole pool and copied.
    Bitcasts move no data on any backend, and the bits written are exactly the keys'."""
    rows, pos = jnp.asarray(rows, jnp.int32), jnp.asarray(pos, jnp.int32)
    zero = jnp.zeros((), jnp.int32)

    def write(cache, new):
        word = _BITS[cache.dtype.itemsize]
        bits = lax.bitcast_convert_type(cache, word)
        new = lax.bitcast_convert_type(new.astype(cache.dtype), word)
        for b in range(new.shape[0]):
            bits = lax.dynamic_update_slice(bits, new[b][None, None], (rows[b], pos[b], zero))
        return lax.bitcast_convert_type(bits, cache.dtype)

    return write(cache_lat, latent), write(cache_rope, k_rope)
