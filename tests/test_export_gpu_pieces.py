"""Item 8's checks without a GPU: every accelerator piece under the bf16 policy as
engine.precision_for builds it on a GPU (the Pallas FP8 GEMMs, interpret=False: their real
Triton lowering) exported for platforms=("cuda",) at the tiny model's shapes and at real
DeepSeek-V3 shapes (abstract ShapeDtypeStructs, one layer, no weights), and the cost model
pinned to what the export holds.

Read from the exported StableHLO (private functions expanded by their call counts; the
attention is exported with its loops unrolled, so nothing runs a data-dependent number of
times): only allowlisted custom calls; every FP8 weight the kernels' tiling covers enters a
Triton call as f8E4M3FN and is never widened; activation x activation dots are bf16 x bf16
-> f32; no ragged_dot where FP8 experts run. Then per op kind, the FLOPs of the Triton calls
are the op's args.fp8_flops in the plan and the FLOPs of the bf16 dots the rest of its flops
(exact at M a multiple of the row tile; the router is the one f32 dot, see below)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.kernels import fp8_gemm as F
from hmoe_jax.measure import compile_probe as C
from hmoe_jax.model import attention as A
from hmoe_jax.model.precision import policy
from hmoe_jax.plan import costs
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor
from hmoe_jax.runtime import pieces
from hmoe_jax.schedules.cpu import shared_fp8_flops
from tests.hlo_read import TRITON, functions, types

SDS = jax.ShapeDtypeStruct
# custom calls a CUDA export of a piece may hold: Pallas' Triton kernels. XLA's own cuBLAS /
# cuDNN calls are chosen after export (at compile time on the device), so none appear here.
ALLOWED_CUSTOM_CALLS = {TRITON}
GPU = policy(
    "bf16",
    cpu=False,
    accel_fp8_matmul=F.fp8_linear,
    accel_fp8_grouped_matmul=F.fp8_grouped_linear,
    accel_fp8_head_matmul=F.fp8_head_linear,
)
TINY, V3 = named_model_config("deepseek_v3_tiny"), named_model_config("deepseek_v3")


# --- reading an export ----------------------------------------------------------------------


def _ops(text: str) -> Counter:
    """(kind, details) -> how many times it runs: every op line of every function times the
    number of times the function is reached from main (exports hold no loops here)."""
    funcs = functions(text)

    @functools.cache
    def expand(fn: str) -> Counter:
        out: Counter = Counter()
        for line in funcs[fn]:
            call = re.search(r"(?:^|\s)(?:func\.)?call @([\w$.]+)\(", line)
            if call and call.group(1) in funcs:
                out.update(expand(call.group(1)))
            elif "stablehlo.dot_general" in line:
                lhs_c = [
                    int(i) for i in re.search(r"contracting_dims = \[([\d, ]*)\]", line).group(1).split(",")
                ]
                (a, ta), (_, tb), (res, tr) = types(line[line.rindex(": (") :])[:3]
                out[("dot", (ta, tb, tr), 2 * math.prod(res) * math.prod(a[i] for i in lhs_c))] += 1
            elif "custom_call @" in line:
                target = re.search(r"custom_call @([\w$.]+)", line).group(1)
                sig = types(line[line.rindex(": (") :])
                if target == TRITON:
                    w = [s for s, dt in sig[:-1] if dt == "f8E4M3FN"][
                        -1
                    ]  # operands: x_q, ..., weight, scales
                    (m_pad, n), _ = sig[-1]
                    fp8_in = tuple(dt for _, dt in sig[:-1] if dt == "f8E4M3FN")
                    out[("triton", (w, fp8_in), 2 * m_pad * n * w[-1])] += 1
                else:
                    out[("custom_call", target, 0)] += 1
            elif "ragged_dot" in line:
                out[("ragged_dot", "", 0)] += 1
            elif "stablehlo.while" in line:
                out[("while", "", 0)] += 1
        return out

    return expand("main")


def _export(fn, *args) -> tuple[str, Counter]:
    with F.cuda_lowering_target():
        exp = jax.export.export(
            jax.jit(fn),
            platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
        )(*args)
    text = exp.mlir_module()
    ops = _ops(text)
    calls = {k[1] for k in ops if k[0] == "custom_call"} | (
        {TRITON} if any(k[0] == "triton" for k in ops) else set()
    )
    assert calls <= ALLOWED_CUSTOM_CALLS, calls - ALLOWED_CUSTOM_CALLS
    return text, ops


def _flops(ops: Counter, kind: str, dtypes=None) -> int:
    return sum(n * k[2] for k, n in ops.items() if k[0] == kind and (dtypes is None or k[1] == dtypes))


BF16_DOT = ("bf16", "bf16", "f32")


# --- the accelerator's weights as placed under the GPU policy -------------------------------


def _fp8(*shape: int) -> Fp8Tensor:
    return Fp8Tensor(w=SDS(shape, FP8_DTYPE), scale_inv=SDS(C.scale_grid_shape(shape, 128, 128), jnp.float32))


def gpu_mla(cfg):
    """A layer's attention weights as runtime/state.py places them under the GPU policy: the
    absorbed halves of kv_b as FP8 per-head tensors (w_uk [H, R, dn], w_uv [H, dv, R]) where
    the 128 blocks fit, else bf16 arrays."""
    mla = C.abstract_mla(cfg, GPU)
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if dn % 128 == 0 and dv % 128 == 0:
        return mla.replace(w_uk=_fp8(h, r, dn), w_uv=_fp8(h, dv, r))
    return mla


def _prefill_attention(cfg, t: int):
    """The attention piece's prefill computation (model.attention.prefill_attention, what
    pieces.attention runs for T > 1) with its loops unrolled: t new tokens, a t-slot row."""
    s = t
    args = (
        gpu_mla(cfg),
        SDS((t, cfg.hidden_size), jnp.bfloat16),
        SDS((1, s, cfg.kv_lora_rank), jnp.bfloat16),
        SDS((1, s, cfg.qk_rope_head_dim), jnp.bfloat16),
    )
    fn = lambda p, x, lat, rope: A.prefill_attention(p, cfg, x, lat, rope, 0, 0, prec=GPU, unroll=True)  # noqa: E731
    return _export(fn, *args)


def _decode_attention(cfg, b: int, kv: int):
    args = (
        gpu_mla(cfg),
        SDS((b, cfg.hidden_size), jnp.bfloat16),
        SDS((b, kv, cfg.kv_lora_rank), jnp.bfloat16),
        SDS((b, kv, cfg.qk_rope_head_dim), jnp.bfloat16),
        SDS((b,), jnp.int32),
        SDS((b,), jnp.int32),
    )
    fn = lambda p, x, lat, rope, rows, pos: A.decode_attention(p, cfg, x, lat, rope, rows, pos, kv, prec=GPU)  # noqa: E731
    return _export(fn, *args)


def _ffn_piece(cfg, kind: str, t: int):
    if kind == "dense_ffn":
        layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i))
        args = (C.abstract_layer(cfg, layer, GPU), SDS((1, t, cfg.hidden_size), jnp.bfloat16))
        return _export(lambda lp, h: pieces.dense_ffn(lp, cfg, h, GPU), *args)
    p = C.abstract_ffn(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return _export(lambda p, x: pieces.shared(p, x, GPU), p, SDS((t, cfg.hidden_size), jnp.bfloat16))


def _experts_group(cfg, t: int, g: int, fp8: bool = True):
    k, d = cfg.num_experts_per_tok, cfg.hidden_size
    rows = pieces.row_bucket(min(g, k) * t)
    experts = C.abstract_experts(cfg if fp8 else _plain(cfg), g)
    args = (
        SDS((t, d), jnp.bfloat16),
        SDS((t, d), jnp.float32),
        SDS((t * k,), jnp.int32),
        SDS((t * k,), jnp.float32),
        SDS((), jnp.int32),
        SDS((g,), jnp.int32),
        experts,
    )
    fn = lambda x, acc, tok, w, off, sizes, grp: pieces.experts_group.__wrapped__(  # noqa: E731
        x, acc, tok, w, off, sizes, grp, rows=rows, prec=GPU
    )
    return _export(fn, *args)


def _plain(cfg):
    return dataclasses.replace(cfg, quant=None)


def _route_final(cfg, t: int):
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    d = cfg.hidden_size
    _, route = _export(
        lambda lp, h: pieces.route_tokens(lp, cfg, h, GPU),
        C.abstract_layer(cfg, layer, GPU),
        SDS((1, t, d), jnp.bfloat16),
    )
    head = SDS((cfg.vocab_size, d), jnp.bfloat16)
    _, final = _export(
        lambda n, w, h: pieces.final(n, w, cfg, h, True, GPU),
        SDS((d,), jnp.float32),
        head,
        SDS((1, t, d), jnp.bfloat16),
    )
    return route, final


# --- tiny shapes: structure ------------------------------------------------------------------


def test_tiny_pieces_export_with_fp8_kernels_and_bf16_activation_dots():
    cfg = TINY
    _, ops = _prefill_attention(cfg, 256)  # expanded form, static walk
    assert _flops(ops, "triton") > 0  # (one-trip loops remain at these shapes: no count here)
    assert all(k[1] == BF16_DOT for k in ops if k[0] == "dot"), [k for k in ops if k[0] == "dot"]
    _, ops = _decode_attention(cfg, 2, 64)
    assert _flops(ops, "triton") > 0 and all(k[1] == BF16_DOT for k in ops if k[0] == "dot")
    for kind in ("dense_ffn", "shared"):
        _, ops = _ffn_piece(cfg, kind, 16)
        assert _flops(ops, "triton") > 0 and not any(k[0] == "dot" for k in ops), kind
    _, ops = _experts_group(cfg, 16, 2)
    assert _flops(ops, "triton") > 0 and not any(k[0] in ("dot", "ragged_dot") for k in ops)
    # every FP8 operand enters the kernel as e4m3 (weights and activations)
    assert all(k[1][1] == ("f8E4M3FN", "f8E4M3FN") for k in ops if k[0] == "triton")


def test_bf16_expert_weights_keep_one_ragged_dot_per_gemm():
    """Unquantised experts (no FP8 kernel applies) go through ragged_dot: one op per GEMM
    (gate, up, down), which XLA:GPU lowers as one grouped GEMM, never a dense dot per group."""
    _, ops = _experts_group(TINY, 16, 2, fp8=False)
    assert ops[("ragged_dot", "", 0)] == 3 and not any(k[0] in ("dot", "triton") for k in ops)


# --- real DeepSeek-V3 shapes: what runs in FP8 is what the plan prices as fp8_flops ---------


def test_v3_prefill_attention_fp8_and_bf16_flops_are_the_priced_split():
    t = 1024  # one query block, two key blocks of the static walk, expanded form
    text, ops = _prefill_attention(V3, t)
    assert not any(k[0] == "while" for k in ops)  # unrolled: every op's count is its run count
    total, fp8 = costs.attn_flops(V3, t, cache_len=t), costs.attn_fp8_flops(V3, t, cache_len=t)
    assert _flops(ops, "triton") == fp8
    assert _flops(ops, "dot", BF16_DOT) == total - fp8 == _flops(ops, "dot")
    # kv_a (N = 576, no 128 tile) is the one weight dequantised to bf16; the others never are
    for n, k in ((1536, 7168), (24576, 1536), (32768, 512), (7168, 16384)):
        assert f"tensor<{n}x{k}xbf16>" not in text and f"tensor<{n}x{k}xf8E4M3FN>" in text


def test_v3_decode_attention_runs_projections_and_absorbed_heads_in_fp8():
    b, kv = 4, 4096
    _, ops = _decode_attention(V3, b, kv)
    weights = {k[1][0] for k in ops if k[0] == "triton"}
    h, r, dn, dv = V3.num_attention_heads, V3.kv_lora_rank, V3.qk_nope_head_dim, V3.v_head_dim
    assert weights == {(1536, 7168), (24576, 1536), (7168, 16384), (h, r, dn), (h, dv, r)}
    # the rest (scores, P.V, kv_a) is bf16 x bf16 -> f32 and is what the plan prices at bf16
    total = costs.attn_flops(V3, 1, kv - 1, rows=b, cache_len=kv)
    fp8 = costs.attn_fp8_flops(V3, 1, kv - 1, rows=b, cache_len=kv)
    assert _flops(ops, "dot") == _flops(ops, "dot", BF16_DOT) == total - fp8


@pytest.mark.parametrize("kind", ["dense_ffn", "shared"])
def test_v3_ffn_pieces_are_all_fp8(kind):
    t = 1024
    _, ops = _ffn_piece(V3, kind, t)
    priced = costs.dense_ffn_flops(V3, t) if kind == "dense_ffn" else costs.shared_flops(V3, t)
    fp8 = (
        costs.ffn_fp8_flops(V3, priced, V3.intermediate_size)
        if kind == "dense_ffn"
        else shared_fp8_flops(V3, t)
    )
    assert _flops(ops, "triton") == priced == fp8 and not any(k[0] == "dot" for k in ops)


def test_v3_expert_slot_is_the_grouped_fp8_kernel():
    t = 4096
    _, ops = _experts_group(V3, t, 1)
    i, d = V3.moe_intermediate_size, V3.hidden_size
    assert {k[1][0] for k in ops if k[0] == "triton"} == {(1, i, d), (1, d, i)}
    assert not any(k[0] in ("dot", "ragged_dot") for k in ops)
    # the kernel's rows: the bucket padded by at most one 64-row tile per group
    rows = pieces.row_bucket(t)
    useful = costs.expert_flops(V3, rows)
    assert useful <= _flops(ops, "triton") <= costs.expert_flops(V3, rows + 64)


def test_v3_router_and_lm_head_dtypes():
    """route: the router's f32 dot (the one f32 GEMM of the bf16 policy, as HF; priced at
    compute_dtype: 0.4% of a 20K-token MoE layer's FLOPs); final: lm_head bf16 x bf16 -> f32."""
    t = 1024
    route, final = _route_final(V3, t)
    assert _flops(route, "dot") == _flops(route, "dot", ("f32", "f32", "f32")) == costs.router_flops(V3, t)
    assert _flops(final, "dot") == _flops(final, "dot", BF16_DOT) == costs.lm_head_flops(V3, 1)


# --- real DeepSeek-V3 shapes: XLA's own FLOP count of the compiled pieces -------------------

DEQUANT = policy("bf16", cpu=True)  # the CPU-compilable form: FP8 weights dequantised, f32 dots


def _compiled_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def test_v3_pieces_cost_analysis_within_10pct_of_the_cost_model():
    """XLA's cost_analysis() of each piece compiled on CPU at real shapes (1024 tokens) in
    the dequantised form (DEQUANT: the same GEMMs as the GPU policy's FP8 kernels, whose
    Pallas interpret form would count its emulation instead), against plan/costs. XLA also
    counts the elementwise work (dequantisation, norms, softmax, SiLU), so 1 <= ratio < 1.1."""
    t, d = 1024, V3.hidden_size
    h = SDS((1, t, d), jnp.bfloat16)
    dense_layer = next(i for i in range(V3.num_hidden_layers) if not V3.is_moe_layer(i))
    moe_layer = next(i for i in range(V3.num_hidden_layers) if V3.is_moe_layer(i))
    shared = C.abstract_ffn(V3, V3.moe_intermediate_size * V3.n_shared_experts)
    rows = pieces.row_bucket(t)
    mla = C.abstract_mla(V3, DEQUANT)
    cases = {
        "attention": (
            lambda p, x, lat, rope: A.prefill_attention(
                p, V3, x, lat, rope, 0, 0, prec=DEQUANT, walk="static", unroll=True
            ),
            (
                mla,
                SDS((t, d), jnp.bfloat16),
                SDS((1, t, V3.kv_lora_rank), jnp.bfloat16),
                SDS((1, t, V3.qk_rope_head_dim), jnp.bfloat16),
            ),
            costs.attn_flops(V3, t, cache_len=t),
        ),
        "dense_ffn": (
            lambda lp, h: pieces.dense_ffn(lp, V3, h, DEQUANT),
            (C.abstract_layer(V3, dense_layer, DEQUANT), h),
            costs.dense_ffn_flops(V3, t),
        ),
        "shared": (
            lambda p, x: pieces.shared(p, x, DEQUANT),
            (shared, SDS((t, d), jnp.bfloat16)),
            costs.shared_flops(V3, t),
        ),
        "route": (
            lambda lp, h: pieces.route_tokens(lp, V3, h, DEQUANT),
            (C.abstract_layer(V3, moe_layer, DEQUANT), h),
            costs.router_flops(V3, t),
        ),
        "experts_group": (
            lambda x, acc, tok, w, off, sizes, grp: pieces.experts_group.__wrapped__(
                x, acc, tok, w, off, sizes, grp, rows=rows, prec=DEQUANT
            ),
            (
                SDS((t, d), jnp.bfloat16),
                SDS((t, d), jnp.float32),
                SDS((t * 8,), jnp.int32),
                SDS((t * 8,), jnp.float32),
                SDS((), jnp.int32),
                SDS((1,), jnp.int32),
                C.abstract_experts(V3, 1),
            ),
            costs.expert_flops(V3, rows),  # one expert per slot: ragged_dot is one dense dot
        ),
    }
    ratios = {}
    for name, (fn, args, model) in cases.items():
        ratios[name] = _compiled_flops(fn, *args) / model
    print({k: round(v, 4) for k, v in ratios.items()})
    assert all(1.0 <= r < 1.1 for r in ratios.values()), ratios
