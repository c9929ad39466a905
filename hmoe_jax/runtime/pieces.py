"""The jitted per-layer pieces the executor dispatches: the model API's blocks, split where
the hybrid placement cuts them (after gating, around the routed experts), plus the
accelerator's grouped-GEMM expert kernel for SLP. `cfg` is static everywhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model import attention as A
from hmoe_jax.model import model as M
from hmoe_jax.model.layers import dense_weight, policy_linear, rms_norm, swiglu
from hmoe_jax.model.moe import route
from hmoe_jax.model.params import ExpertsParams, FFNParams, LayerParams, MLAParams, ModelParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.plan.buckets import expert_rows_bucket
from hmoe_jax.plan.memory import FFN_CHUNK_TOKENS
from hmoe_jax.quant.fp8 import Fp8Tensor

ATTN_STATIC = ("cfg", "prec", "kv_len", "form", "q_block", "k_block")


@functools.partial(jax.jit, static_argnames=("prec",))
def embed(embed_w: jax.Array, tokens: jax.Array, prec: Precision = F32) -> jax.Array:
    """tokens [B, T] -> h [B, T, D] in the policy's activation dtype."""
    return jnp.take(embed_w, tokens, axis=0).astype(prec.act_dtype)


def _residual(h: jax.Array, out: jax.Array, prec: Precision) -> jax.Array:
    return (h.astype(jnp.float32) + out.astype(jnp.float32)).astype(prec.act_dtype)


def _attention_block(
    attn_norm, attn: MLAParams, cfg, h, lat, rope, rows, pos, prec, kv_len, form, q_block, k_block
):
    """h [B, T, D] -> (h + MLA(input_norm(h)), lat, rope). T == 1: a decode step of B rows at
    positions pos [B] (attention over each row's first kv_len slots), the caches only read
    and (lat, rope) the new keys [B, R], [B, dr] for write_kv (decode_attention_unwritten
    says why); T > 1: a prefill chunk of one sequence (B == 1) at positions pos[0]..
    (blocked attention), the caches written."""
    b, t, _ = h.shape
    x = rms_norm(h, attn_norm, cfg.rms_norm_eps).astype(prec.act_dtype)
    if t == 1:
        out, lat, rope = A.decode_attention_unwritten(
            attn, cfg, x[:, 0], lat, rope, rows, pos, kv_len, prec=prec
        )
        # the new keys leave widened to f32 (exact: they are already rounded to the cache
        # dtype): write_kv's narrowing convert is what lets XLA:CPU emit its update in place
        # (with a bf16 operand it rewrites the whole pool: 0.35 vs 0.08 ms at 4 x 4K x 512)
        lat, rope = lat.astype(jnp.float32), rope.astype(jnp.float32)
        out = out[:, None]
    else:
        if b != 1:
            raise ValueError(f"attention: a prefill chunk is one sequence (B=1), got B={b}")
        out, lat, rope = A.prefill_attention(
            attn,
            cfg,
            x[0],
            lat,
            rope,
            rows[0],
            pos[0],
            prec=prec,
            form=form,
            q_block=q_block,
            k_block=k_block,
        )
        out = out[None]
    return _residual(h, out, prec), lat, rope


def _attention(
    attn_norm: jax.Array,
    attn: MLAParams,
    cfg: ModelConfig,
    h: jax.Array,
    lat: jax.Array,
    rope: jax.Array,
    rows: jax.Array,
    pos: jax.Array,
    *,
    prec: Precision = F32,
    kv_len: int = 0,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> (h [B, T, D], lat [N, S, R], rope [N, S, dr]): the pool layer arrays
    are donated (updated in place); under attention_decode (T == 1) they are only read and
    (lat, rope) are the new keys for write_kv. Takes only the attention weights so dense
    and MoE layers share one compilation."""
    return _attention_block(
        attn_norm, attn, cfg, h, lat, rope, rows, pos, prec, kv_len, form, q_block, k_block
    )


attention = jax.jit(_attention, static_argnames=ATTN_STATIC, donate_argnames=("lat", "rope"))
attention_decode = jax.jit(_attention, static_argnames=ATTN_STATIC)


@functools.partial(jax.jit, donate_argnames=("lat", "rope"))
def write_kv(
    lat: jax.Array, rope: jax.Array, rows: jax.Array, pos: jax.Array, new_lat: jax.Array, new_rope: jax.Array
):
    """A decode step's new keys (attention_decode's / attn_route_decode's) written into the
    layer's donated pool arrays in place: model.attention.write_kv_rows."""
    return A.write_kv_rows(lat, rope, rows, pos, new_lat, new_rope)


@functools.partial(jax.jit, static_argnames=("cfg", "prec"))
def dense_ffn(layer: LayerParams, cfg: ModelConfig, h: jax.Array, prec: Precision = F32) -> jax.Array:
    """Post-attention norm + dense SwiGLU + residual. Long prefills run in token chunks of
    FFN_CHUNK_TOKENS so the [T, intermediate] gate/up activations (two f32 [32K, 18432]
    = 4.5 GiB for DeepSeek-V3 at 32K tokens) exist for one chunk at a time."""
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps).astype(prec.act_dtype)
    return _residual(h, chunked_tokens(lambda xc: swiglu(layer.ffn, xc, prec), x), prec)


def chunked_tokens(fn, x: jax.Array, chunk: int = FFN_CHUNK_TOKENS) -> jax.Array:
    """fn over x [B, T, D] in chunks of `chunk` tokens (lax.map; the last chunk zero-padded,
    its padding rows dropped): the same values as fn(x) for a row-wise fn, with fn's
    temporaries bounded by one chunk. Short inputs run fn directly."""
    b, t, d = x.shape
    if b * t <= chunk:
        return fn(x)
    flat = x.reshape(b * t, d)
    n = -(-(b * t) // chunk)
    xs = jnp.pad(flat, ((0, n * chunk - b * t), (0, 0))).reshape(n, chunk, d)
    out = jax.lax.map(fn, xs)
    return out.reshape(n * chunk, -1)[: b * t].reshape(b, t, -1)


def _route(layer: LayerParams, cfg: ModelConfig, h: jax.Array, prec: Precision):
    """h [B, T, D] -> x [B*T, D] (post-attention-normed, act dtype), ids [B*T, k], weights."""
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps).astype(prec.act_dtype)
    x = x.reshape(-1, x.shape[-1])
    ids, w = route(layer.ffn, cfg, x)  # the router runs in f32 (as HF's)
    return x, ids, w


@functools.partial(jax.jit, static_argnames=("cfg", "prec"))
def route_tokens(layer: LayerParams, cfg: ModelConfig, h: jax.Array, prec: Precision = F32):
    return _route(layer, cfg, h, prec)


def _hop_word(x_dtype) -> jnp.dtype:
    """The word a hop is packed in: the hidden dtype's width (bf16 -> uint16, f32 -> uint32),
    so x crosses at its own size and ids / weights (32-bit) as 2 or 1 words each."""
    return jnp.dtype(jnp.uint16) if jnp.dtype(x_dtype).itemsize == 2 else jnp.dtype(jnp.uint32)


def _as_words(a: jax.Array, word: jnp.dtype) -> jax.Array:
    """a [M, n] -> its raw bits as [M, n * a.itemsize / word.itemsize] words (no rounding)."""
    w = jax.lax.bitcast_convert_type(a, word)  # [M, n] or [M, n, ratio]
    return w.reshape(a.shape[0], -1)


def _from_words(w: jax.Array, dtype) -> jax.Array:
    """Inverse of _as_words: [M, n * ratio] words -> [M, n] dtype, bit for bit."""
    ratio = jnp.dtype(dtype).itemsize // w.dtype.itemsize
    if ratio > 1:
        w = w.reshape(w.shape[0], -1, ratio)
    return jax.lax.bitcast_convert_type(w, dtype)


def pack_hop(x: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, D] (the policy's activation dtype) | ids [M, k] int32 | weights [M, k] f32 as
    ONE array of raw words (uint16 for bf16 x, uint32 for f32 x): the hop to the host is one
    transfer of exactly the bytes the plan prices (plan.costs.hidden_bytes + route_bytes),
    with no value rounded or widened (a bitcast, not a cast)."""
    word = _hop_word(x.dtype)
    return jnp.concatenate(
        [_as_words(x, word), _as_words(ids.astype(jnp.int32), word), _as_words(w.astype(jnp.float32), word)],
        axis=-1,
    )


def unpack_hop(packed: jax.Array, hidden: int, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inverse of pack_hop: words [M, W] -> x [M, D] (bf16 if the words are uint16, else
    f32), ids [M, k] int32, weights [M, k] f32."""
    x_dtype = jnp.bfloat16 if packed.dtype == jnp.uint16 else jnp.float32
    per32 = 4 // packed.dtype.itemsize  # words per 32-bit value
    x_end = hidden * jnp.dtype(x_dtype).itemsize // packed.dtype.itemsize
    if packed.shape[-1] != x_end + 2 * k * per32:
        raise ValueError(
            f"unpack_hop: {packed.shape[-1]} {packed.dtype} words per row, expected {x_end + 2 * k * per32} "
            f"for hidden {hidden} and k {k}"
        )
    x = _from_words(packed[:, :x_end], x_dtype)
    ids = _from_words(packed[:, x_end : x_end + k * per32], jnp.int32)
    w = _from_words(packed[:, x_end + k * per32 :], jnp.float32)
    return x, ids, w


def _attn_route(
    layer: LayerParams,
    cfg: ModelConfig,
    h,
    lat,
    rope,
    rows,
    pos,
    *,
    prec: Precision = F32,
    kv_len=0,
    form="auto",
    q_block=1024,
    k_block=512,
    with_shared: bool = False,
):
    """Attention, post-attention norm and gating of a MoE layer as ONE computation (one
    dispatch instead of two per layer in decode) -> (h [B, T, D], lat, rope, x [B*T, D] or,
    with_shared, the shared expert(s)' output [B*T, D] (decode: everything the accelerator
    does before the hop in one dispatch), packed [B*T, W] words): the routed experts' inputs
    x | ids | weights packed bit for bit in one array (pack_hop), so the hop to the host is
    one transfer, not three, of x in the policy's activation dtype. The pool arrays are
    donated; under attn_route_decode (T == 1) they are only read and (lat, rope) are the new
    keys for write_kv, as attention's."""
    h, lat, rope = _attention_block(
        layer.attn_norm, layer.attn, cfg, h, lat, rope, rows, pos, prec, kv_len, form, q_block, k_block
    )
    x, ids, w = _route(layer, cfg, h, prec)
    side = swiglu(layer.ffn.shared, x, prec) if with_shared else x
    return h, lat, rope, side, pack_hop(x, ids, w)


attn_route = jax.jit(
    _attn_route, static_argnames=(*ATTN_STATIC, "with_shared"), donate_argnames=("lat", "rope")
)
attn_route_decode = jax.jit(_attn_route, static_argnames=(*ATTN_STATIC, "with_shared"))


@functools.partial(jax.jit, static_argnames=("prec",))
def shared(p: FFNParams, x: jax.Array, prec: Precision = F32) -> jax.Array:
    return swiglu(p, x, prec)


@functools.partial(jax.jit, static_argnames=("prec",))
def combine(
    h: jax.Array, routed: jax.Array, shared_out: jax.Array | None, prec: Precision = F32
) -> jax.Array:
    """h [B, T, D] + (routed + shared) [B*T, D], summed in moe_block's order (f32)."""
    out = routed.astype(jnp.float32)
    if shared_out is not None:
        out = out + shared_out.astype(jnp.float32)
    return _residual(h, out.reshape(h.shape), prec)


@functools.partial(jax.jit, static_argnames=("cfg", "last_only", "prec"))
def final(
    norm_w: jax.Array,
    lm_head,
    cfg: ModelConfig,
    h: jax.Array,
    last_only: bool,
    prec: Precision = F32,
    last_at: jax.Array | None = None,
) -> jax.Array:
    """h [B, T, D] -> logits [B, T or 1, V] f32. last_only with last_at (a traced index):
    the logits of position last_at, not T - 1 (a padded chunk's last real token; traced,
    so every real length of one padded shape shares the program)."""
    if last_only:
        h = h[:, -1:] if last_at is None else jax.lax.dynamic_slice_in_dim(h, last_at, 1, axis=1)
    if prec.exact:
        return M.final_logits(ModelParams(embed=None, layers=(), norm=norm_w, lm_head=lm_head), cfg, h)
    x = rms_norm(h, norm_w, cfg.rms_norm_eps).astype(prec.act_dtype)
    return policy_linear(x, lm_head, prec)  # f32 logits, lm_head consumed as stored


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
    """Static row count for a group of n token-expert rows (plan/buckets.expert_rows_bucket:
    powers of two up to 4,096, then multiples of 4,096), so a prefill compiles a handful of
    shapes, never one per count."""
    return expert_rows_bucket(n)


@functools.partial(jax.jit, static_argnames=("rows", "prec"), donate_argnames=("acc",))
def experts_group(
    x: jax.Array,
    acc: jax.Array,
    token: jax.Array,
    wts: jax.Array,
    off: jax.Array,
    sizes: jax.Array,
    group: ExpertsParams,
    rows: int,
    prec: Precision = F32,
) -> jax.Array:
    """acc [T, D] += the routed output of the G experts held in one ring slot.

    Grouped GEMM over exactly the group's token-expert rows: they are contiguous in the
    expert-sorted order, starting at `off` (host-known from the layer's offsets), sizes [G]
    rows per expert, padded to the static `rows` (row_bucket) and masked. The rows run
    through jax.lax.ragged_dot (gate, up, down) with the per-expert sizes; FP8 weights are
    dequantized inside this computation (no f32 copy of the weights outlives it); on CPU
    ragged_dot is dense per group (G x the rows' FLOPs), which only the stand-in pays.
    Under a policy with a grouped FP8 hook (the bf16 policy on a GPU) FP8 groups instead go
    through it (kernels/fp8_gemm.fp8_grouped_linear: e4m3 activations per token per 128
    channels, each expert's rows against its own FP8 weight, no bf16 weight copy, no dense
    expansion). `acc` (f32) is donated: updated in place, never copied per group. Under a
    bf16 policy without the hook the weights are dequantised to bf16 and the dots
    accumulate in f32 (f32 on XLA:CPU, which has no bf16 x bf16 -> f32 dot).
    """
    wdt = jnp.float32 if prec.exact else prec.dot_dtype
    m = token.shape[0]
    n = sizes.sum()
    idx = jnp.minimum(off + jnp.arange(rows, dtype=jnp.int32), m - 1)  # [rows]
    tok = token[idx]
    f32 = jnp.float32
    hid_dt = f32 if prec.exact else prec.act_dtype
    if prec.fp8_grouped_matmul is not None and isinstance(group.gate, Fp8Tensor):
        mm = prec.fp8_grouped_matmul
        xs = x[tok].astype(prec.act_dtype)  # [rows, D]
        g, u = mm(xs, group.gate, sizes), mm(xs, group.up, sizes)  # [rows, I] f32
        y = mm((jax.nn.silu(g) * u).astype(hid_dt), group.down, sizes)  # [rows, D] f32
    else:
        xs = x[tok].astype(wdt)  # [rows, D]
        gw = dense_weight(group.gate, wdt).transpose(0, 2, 1)  # [G, D, I]
        uw = dense_weight(group.up, wdt).transpose(0, 2, 1)
        dw = dense_weight(group.down, wdt).transpose(0, 2, 1)  # [G, I, D]
        g = jax.lax.ragged_dot(xs, gw, sizes, preferred_element_type=f32)
        u = jax.lax.ragged_dot(xs, uw, sizes, preferred_element_type=f32)
        hid = (jax.nn.silu(g) * u).astype(hid_dt).astype(wdt)  # [rows, I]
        y = jax.lax.ragged_dot(hid, dw, sizes, preferred_element_type=f32)  # [rows, D]
    keep = jnp.arange(rows) < n
    y = y * jnp.where(keep, wts[idx], 0.0)[:, None]
    return acc.at[tok].add(jnp.where(keep[:, None], y, 0.0))
