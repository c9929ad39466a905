"""Compile-only measurement of the engine's real pieces at real shapes: no weights, no
activations allocated. Operands are jax.ShapeDtypeStructs (FP8 weights as float8_e4m3fn
plus f32 block scales, the absorbed-attention copies in bf16, the pool layer in the
cache dtype); each piece is lowered and compiled for the default backend, and its
`memory_analysis()` (temporaries, arguments, outputs, donated aliases) and `cost_analysis()`
(flops) are read back. What `hmoe plan` reports as measured comes from here.

Backend caveat: on a machine without a GPU this compiles for XLA:CPU, which fuses and
schedules buffers differently from XLA:GPU; what a dot must store (score blocks, dot
outputs, a dequantised weight feeding a dot) shows up on both. XLA's cost analysis counts
the body of a while loop ONCE (the blocked attention's key-block loop, lax.map over query
blocks), so its flops are per-iteration figures for looped pieces (tests compare them with
the cost model at one query block and one key block). Two XLA:CPU upcasts a GPU does not
make (read from the buffer assignment, XLA_FLAGS=--xla_dump_to=DIR: the
*-buffer-assignment.txt and *-memory-usage-report.txt files): a bf16 dot inside a while
body becomes an f32 dot with converted operands, which loop-invariant code motion hoists
as whole f32 copies (CPU_DSLP_COMPILER_OPTIONS, the dslp probe avoids it); and an M = 1
bf16 dot (the last-token lm_head) converts its weight to f32 (the dslp `final` piece:
3.45 GiB for DeepSeek-V3's lm_head; cuBLAS reads bf16).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model import attention as A
from hmoe_jax.model.params import ExpertsParams, FFNParams, LayerParams, MLAParams, MoEParams
from hmoe_jax.model.precision import BF16, Precision
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, scale_grid_shape
from hmoe_jax.runtime import pieces

SDS = jax.ShapeDtypeStruct
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PieceProbe:
    """One compiled piece: XLA's memory and cost analysis of it."""

    name: str
    temp_bytes: int  # temporaries XLA allocates while the piece runs
    arg_bytes: int  # operands (weights, activations, the pool layer)
    out_bytes: int
    alias_bytes: int  # outputs that reuse donated operands (the pool layer, the accumulator)
    flops: float  # cost_analysis(); a while-loop body counted once
    compile_s: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _w(cfg: ModelConfig, *shape: int) -> Any:
    """A weight [..., N, K] as placed: Fp8Tensor (e4m3 + f32 scales) for FP8 models."""
    if cfg.quant is None:
        return SDS(shape, F32)
    q = cfg.quant
    return Fp8Tensor(
        w=SDS(shape, FP8_DTYPE),
        scale_inv=SDS(scale_grid_shape(shape, q.block_n, q.block_k), F32),
        block_n=q.block_n,
        block_k=q.block_k,
    )


def abstract_mla(cfg: ModelConfig, prec: Precision) -> MLAParams:
    """A layer's attention weights as the engine places them under `prec` (with the bf16
    absorbed copies w_uk [H, dn, R] / w_uv [H, dv, R] a non-exact policy derives)."""
    h, d, r = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    kw: dict[str, Any] = {}
    if cfg.q_lora_rank is None:
        kw["q"] = _w(cfg, h * cfg.qk_head_dim, d)
    else:
        kw.update(
            q_a=_w(cfg, cfg.q_lora_rank, d),
            q_a_norm=SDS((cfg.q_lora_rank,), F32),
            q_b=_w(cfg, h * cfg.qk_head_dim, cfg.q_lora_rank),
        )
    if not prec.exact:
        kw.update(w_uk=SDS((h, dn, r), prec.dot_dtype), w_uv=SDS((h, dv, r), prec.dot_dtype))
    return MLAParams(
        kv_a=_w(cfg, cfg.cache_dim, d),
        kv_a_norm=SDS((r,), F32),
        kv_b=_w(cfg, h * (dn + dv), r),
        o=_w(cfg, d, h * dv),
        **kw,
    )


def abstract_ffn(cfg: ModelConfig, inter: int) -> FFNParams:
    d = cfg.hidden_size
    return FFNParams(gate=_w(cfg, inter, d), up=_w(cfg, inter, d), down=_w(cfg, d, inter))


def abstract_experts(cfg: ModelConfig, count: int) -> ExpertsParams:
    """`count` routed experts stacked: one ring slot's contents."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return ExpertsParams(gate=_w(cfg, count, i, d), up=_w(cfg, count, i, d), down=_w(cfg, count, d, i))


def abstract_layer(cfg: ModelConfig, layer: int, prec: Precision) -> LayerParams:
    """A layer without its routed experts (what stays resident on the accelerator)."""
    d = cfg.hidden_size
    if cfg.is_moe_layer(layer):
        e = cfg.n_routed_experts
        shared = (
            abstract_ffn(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        ffn: Any = MoEParams(router=SDS((e, d), F32), router_bias=SDS((e,), F32), experts=None, shared=shared)
    else:
        ffn = abstract_ffn(cfg, cfg.intermediate_size)
    return LayerParams(
        attn_norm=SDS((d,), F32), attn=abstract_mla(cfg, prec), ffn_norm=SDS((d,), F32), ffn=ffn
    )


def _probe(
    name: str, fn: Any, *args: Any, compiler_options: dict[str, str] | None = None, **kwargs: Any
) -> PieceProbe:
    t0 = time.perf_counter()
    compiled = fn.lower(*args, **kwargs).compile(compiler_options=compiler_options)
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return PieceProbe(
        name=name,
        temp_bytes=int(m.temp_size_in_bytes),
        arg_bytes=int(m.argument_size_in_bytes),
        out_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        flops=float((cost or {}).get("flops", 0.0)),
        compile_s=secs,
    )


def probe_attention(
    cfg: ModelConfig,
    tokens: int,
    *,
    max_len: int | None = None,
    rows: int = 1,
    start_pos: int = 0,
    prec: Precision = BF16,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
) -> PieceProbe:
    """pieces.attention of one layer: `tokens` new tokens of one sequence (a prefill chunk)
    at start_pos, or a decode step of `rows` rows (tokens == 1: pieces.attention_decode,
    which reads the pool and leaves its write to pieces.write_kv), over a pool layer of
    `rows` x max_len slots."""
    s = cache_len(max_len or start_pos + tokens)
    b = 1 if tokens > 1 else rows
    d = cfg.hidden_size
    lat = SDS((rows, s, cfg.kv_lora_rank), prec.cache_dtype)
    rope = SDS((rows, s, cfg.qk_rope_head_dim), prec.cache_dtype)
    i32 = jnp.int32
    kw: dict[str, Any] = dict(cfg=cfg, prec=prec, form=form, q_block=q_block, k_block=k_block)
    if tokens == 1:
        kw["kv_len"] = s
    return _probe(
        "attention",
        pieces.attention_decode if tokens == 1 else pieces.attention,
        SDS((d,), F32),
        abstract_mla(cfg, prec),
        h=SDS((b, tokens, d), prec.act_dtype),
        lat=lat,
        rope=rope,
        rows=SDS((b,), i32),
        pos=SDS((b,), i32),
        **kw,
    )


def probe_prefill_attention_math(
    cfg: ModelConfig,
    tokens: int,
    *,
    max_len: int,
    prec: Precision = BF16,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
    walk: str = "auto",
    unroll: bool = False,
) -> PieceProbe:
    """model.attention.prefill_attention alone (no norm, no residual): what the cost
    model's attention FLOPs price. walk="static", unroll=True: the accelerator's walk with
    its loops unrolled, so cost_analysis() (one count per loop body) sees every block."""
    s = cache_len(max_len)

    def f(p, x, lat, rope, row, start):
        return A.prefill_attention(
            p,
            cfg,
            x,
            lat,
            rope,
            row,
            start,
            prec=prec,
            form=form,
            q_block=q_block,
            k_block=k_block,
            walk=walk,
            unroll=unroll,
        )

    i32 = jnp.int32
    return _probe(
        "prefill_attention",
        jax.jit(f),
        abstract_mla(cfg, prec),
        SDS((tokens, cfg.hidden_size), prec.act_dtype),
        SDS((1, s, cfg.kv_lora_rank), prec.cache_dtype),
        SDS((1, s, cfg.qk_rope_head_dim), prec.cache_dtype),
        SDS((), i32),
        SDS((), i32),
    )


def probe_decode_attention_math(
    cfg: ModelConfig, batch: int, kv_len: int, *, prec: Precision = BF16
) -> PieceProbe:
    """model.attention.decode_attention of `batch` rows over the first kv_len slots."""

    def f(p, x, lat, rope, rows, pos):
        return A.decode_attention(p, cfg, x, lat, rope, rows, pos, kv_len, prec=prec)

    i32 = jnp.int32
    return _probe(
        "decode_attention",
        jax.jit(f),
        abstract_mla(cfg, prec),
        SDS((batch, cfg.hidden_size), prec.act_dtype),
        SDS((batch, kv_len, cfg.kv_lora_rank), prec.cache_dtype),
        SDS((batch, kv_len, cfg.qk_rope_head_dim), prec.cache_dtype),
        SDS((batch,), i32),
        SDS((batch,), i32),
    )


def probe_dense_ffn(cfg: ModelConfig, tokens: int, prec: Precision = BF16) -> PieceProbe:
    layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i))
    h = SDS((1, tokens, cfg.hidden_size), prec.act_dtype)
    return _probe("dense_ffn", pieces.dense_ffn, abstract_layer(cfg, layer, prec), cfg, h, prec)


def _moe_layer(cfg: ModelConfig) -> int:
    return next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))


def probe_route(cfg: ModelConfig, tokens: int, prec: Precision = BF16) -> PieceProbe:
    h = SDS((1, tokens, cfg.hidden_size), prec.act_dtype)
    return _probe("route", pieces.route_tokens, abstract_layer(cfg, _moe_layer(cfg), prec), cfg, h, prec)


def probe_shared(cfg: ModelConfig, tokens: int, prec: Precision = BF16) -> PieceProbe:
    x = SDS((tokens, cfg.hidden_size), prec.act_dtype)
    p = abstract_ffn(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return _probe("shared", pieces.shared, p, x, prec)


def probe_experts_group(
    cfg: ModelConfig, tokens: int, experts_per_slot: int = 1, prec: Precision = BF16
) -> PieceProbe:
    """pieces.experts_group over one ring slot at its worst-case row bucket: a token picks
    an expert at most once, so a slot of G experts gets at most min(G, k) * T rows."""
    k = cfg.num_experts_per_tok
    rows = pieces.row_bucket(min(experts_per_slot, k) * tokens)
    d, i32 = cfg.hidden_size, jnp.int32
    return _probe(
        "experts_group",
        pieces.experts_group,
        SDS((tokens, d), prec.act_dtype),  # x
        SDS((tokens, d), F32),  # acc (donated)
        SDS((tokens * k,), i32),  # token
        SDS((tokens * k,), F32),  # wts
        SDS((), i32),  # off
        SDS((experts_per_slot,), i32),  # sizes
        abstract_experts(cfg, experts_per_slot),
        rows=rows,
        prec=prec,
    )


def probe_combine(cfg: ModelConfig, tokens: int, prec: Precision = BF16) -> PieceProbe:
    d = cfg.hidden_size
    return _probe(
        "combine",
        pieces.combine,
        SDS((1, tokens, d), prec.act_dtype),
        SDS((tokens, d), F32),
        SDS((tokens, d), prec.act_dtype) if cfg.n_shared_experts else None,
        prec,
    )


def probe_final(cfg: ModelConfig, tokens: int, prec: Precision = BF16, last_only: bool = True) -> PieceProbe:
    """final norm + lm_head; lm_head as DeepSeek releases it (bf16; f32 for f32 models)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    head = SDS((v, d), jnp.bfloat16 if cfg.quant is not None else F32)
    h = SDS((1, tokens, d), prec.act_dtype)
    return _probe("final", pieces.final, SDS((d,), F32), head, cfg, h, last_only, prec)


_CACHE: dict[tuple, dict[str, PieceProbe]] = {}


def probe_slp_pieces(
    cfg: ModelConfig,
    tokens: int,
    *,
    max_len: int | None = None,
    experts_per_slot: int = 1,
    prec: Precision = BF16,
    attn: dict[str, Any] | None = None,
) -> dict[str, PieceProbe]:
    """Every accelerator piece one prefill of `tokens` tokens runs under slp (or the
    accelerator part of a cpu chunk): attention, dense_ffn, route, shared, experts_group,
    combine, final. Cached in-process per (config, tokens, options)."""
    attn = dict(attn or {})
    key = (cfg, int(tokens), max_len, experts_per_slot, prec, tuple(sorted(attn.items())))
    if key not in _CACHE:
        out = {"attention": probe_attention(cfg, tokens, max_len=max_len, prec=prec, **attn)}
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            out["dense_ffn"] = probe_dense_ffn(cfg, tokens, prec)
        if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            out["route"] = probe_route(cfg, tokens, prec)
            if cfg.n_shared_experts:
                out["shared"] = probe_shared(cfg, tokens, prec)
            out["experts_group"] = probe_experts_group(cfg, tokens, experts_per_slot, prec)
            out["combine"] = probe_combine(cfg, tokens, prec)
        out["final"] = probe_final(cfg, tokens, prec)
        _CACHE[key] = out
    return _CACHE[key]


# XLA:CPU runs a bf16 x bf16 -> f32 dot_general inside a while body (the CP walk's key-block
# loop) as an f32 dot: it converts the operands to f32, and while-loop-invariant code motion
# then hoists the convert of a loop-invariant operand out of the loop, a full f32 copy of it.
# For the CP walk these are the K_nope and V buffers of a head group (2 x 1 GiB at 32K on 2
# ranks) and the FP8 weights' f16 dequantisation. XLA:GPU runs bf16 dots natively (cuBLAS,
# no convert) and the bf16 policy's FP8 GEMM hook reads FP8, so neither copy exists there.
# The dslp probe compiles for XLA:CPU without that pass: the converts stay inside the loop,
# fused into the dot's operand (one key block's worth), as the loop a GPU runs.
CPU_DSLP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def _dslp_mesh(ranks: int) -> Any:
    from hmoe_jax.parallel.mesh import make_mesh

    devs = jax.devices()
    if len(devs) < ranks:
        raise ValueError(
            f"probe_dslp_pieces: {ranks} ranks need {ranks} devices, the backend has {len(devs)}"
        )
    return make_mesh(ranks, devs)


def _dslp_options() -> dict[str, str] | None:
    return CPU_DSLP_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu" else None


def _placed(mesh: Any, tree: Any, spec: Any) -> Any:
    from jax.sharding import NamedSharding

    sh = NamedSharding(mesh, spec)
    return jax.tree_util.tree_map(lambda x: SDS(x.shape, x.dtype, sharding=sh), tree)


def _zigzag_hidden(mesh: Any, cfg: ModelConfig, padded: int, prec: Precision) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hmoe_jax.parallel.mesh import AXIS

    return SDS((1, padded, cfg.hidden_size), prec.act_dtype, sharding=NamedSharding(mesh, P(None, AXIS)))


def probe_dslp_attention(
    cfg: ModelConfig, tokens: int, ranks: int, prec: Precision = BF16, head_groups: int | None = None
) -> PieceProbe:
    """parallel.prefill.attn_fn per rank (see probe_dslp_pieces) with the plan's walk block
    and head groups (plan.costs.cp_block / cp_head_groups, as schedules/dslp.py), or
    `head_groups` to compare groupings."""
    from jax.sharding import PartitionSpec as P

    from hmoe_jax.parallel.prefill import attn_fn
    from hmoe_jax.plan import costs
    from hmoe_jax.plan.dist import ZigzagLayout

    mesh = _dslp_mesh(ranks)
    lay = ZigzagLayout.for_sequence(tokens, ranks)
    act_bytes = jnp.dtype(prec.act_dtype).itemsize
    groups = head_groups or costs.cp_head_groups(cfg, lay.padded_len, act_bytes)
    layer = _placed(mesh, abstract_layer(cfg, _moe_layer(cfg) if _has_moe(cfg) else 0, prec), P())
    f = attn_fn(mesh, cfg, lay, prec, costs.cp_block(lay.chunk), groups)
    h = _zigzag_hidden(mesh, cfg, lay.padded_len, prec)
    return _probe("attention", f, layer, h, compiler_options=_dslp_options())


def _has_moe(cfg: ModelConfig) -> bool:
    return any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def probe_dslp_pieces(
    cfg: ModelConfig, tokens: int, ranks: int, prec: Precision = BF16
) -> dict[str, PieceProbe]:
    """dslp's per-rank pieces (parallel/prefill.py) compiled over a mesh of the first `ranks`
    devices of the default backend, operands sharded as the executor shards them (layer
    weights replicated, the rank's E/N experts, the zig-zag hidden states), under `prec`
    (default BF16: the GPU policy's dtypes, bf16 activations, cache, K/V buffers and dot
    operands with f32 accumulation; FP8 weights without a hook are dequantised to bf16 one
    matrix at a time inside the piece; the executor's expert function for the policy) and
    with the plan's walk block and head groups: attention, moe (SmallEP), dense_ffn, final.
    memory_analysis() of an SPMD executable is per device. On XLA:CPU without
    while-loop-invariant code motion (CPU_DSLP_COMPILER_OPTIONS says why). Needs `ranks`
    devices (on CPU: jax_num_cpu_devices set before jax starts). Cached."""
    from jax.sharding import PartitionSpec as P

    from hmoe_jax.parallel.mesh import AXIS
    from hmoe_jax.parallel.prefill import ffn_fn, grouped_expert_fn, last_logits_fn
    from hmoe_jax.plan.dist import ZigzagLayout

    key = ("dslp", cfg, int(tokens), int(ranks), prec)
    if key in _CACHE:
        return _CACHE[key]
    mesh = _dslp_mesh(ranks)
    lay = ZigzagLayout.for_sequence(tokens, ranks)
    opts = _dslp_options()
    h = _zigzag_hidden(mesh, cfg, lay.padded_len, prec)
    out: dict[str, PieceProbe] = {"attention": probe_dslp_attention(cfg, tokens, ranks, prec)}
    expert_fn = grouped_expert_fn(prec)
    if _has_moe(cfg):
        # FP8 leaves as the executor passes them (uint8 views, parallel.moe.expert_bytes_view)
        as_bytes = lambda a: SDS(a.shape, jnp.uint8) if a.dtype == FP8_DTYPE else a
        experts = _placed(
            mesh, jax.tree_util.tree_map(as_bytes, abstract_experts(cfg, cfg.n_routed_experts)), P(AXIS)
        )
        layer = _placed(mesh, abstract_layer(cfg, _moe_layer(cfg), prec), P())
        f = ffn_fn(mesh, cfg, True, "smallep", expert_fn, None, prec)
        out["moe"] = _probe("moe", f, layer, experts, h, compiler_options=opts)
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense:
        f = ffn_fn(mesh, cfg, False, "smallep", expert_fn, None, prec)
        layer = _placed(mesh, abstract_layer(cfg, dense[0], prec), P())
        out["dense_ffn"] = _probe("dense_ffn", f, layer, None, h, compiler_options=opts)
    head = SDS((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16 if cfg.quant is not None else F32)
    rank, local = lay.owner_of_last
    fin = last_logits_fn(cfg, rank * lay.local_len + local, prec)
    norm = _placed(mesh, SDS((cfg.hidden_size,), F32), P())
    out["final"] = _probe("final", fin, norm, _placed(mesh, head, P()), h, compiler_options=opts)
    _CACHE[key] = out
    return out


def piece_temps(probes: dict[str, PieceProbe]) -> dict[str, int]:
    """name -> temp bytes, the form plan.memory takes measured temporaries in."""
    return {k: p.temp_bytes for k, p in probes.items()}


__all__ = [
    "CPU_DSLP_COMPILER_OPTIONS",
    "PieceProbe",
    "abstract_experts",
    "abstract_layer",
    "abstract_mla",
    "piece_temps",
    "probe_attention",
    "probe_decode_attention_math",
    "probe_dslp_attention",
    "probe_dslp_pieces",
    "probe_prefill_attention_math",
    "probe_slp_pieces",
]
