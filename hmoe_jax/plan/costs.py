"""Bytes and FLOPs of the model's pieces, for plans and for the SLP ring policy.
FLOPs count a multiply-add as 2. Weight bytes are as stored (FP8: 1 byte/weight plus the
f32 block scales; f32 models: 4 bytes/weight)."""

from __future__ import annotations

import functools
import math

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan.system import SystemSpec


def _w_bytes(cfg: ModelConfig, n: int, k: int) -> int:
    if cfg.quant is None:
        return 4 * n * k
    q = cfg.quant
    return n * k + 4 * (-(-n // q.block_n)) * (-(-k // q.block_k))


def expert_bytes(cfg: ModelConfig) -> int:
    """One routed expert: gate, up [I, D] and down [D, I]."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * _w_bytes(cfg, i, d) + _w_bytes(cfg, d, i)


def expert_flops(cfg: ModelConfig, rows: int) -> int:
    """`rows` token-expert assignments through one expert's SwiGLU."""
    return 2 * rows * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def dense_ffn_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * 3 * cfg.hidden_size * cfg.intermediate_size


def shared_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.n_shared_experts


# model/attention.py's form threshold and key-block rule, restated here because the plan
# layer imports no model code (tests/test_plan_memory.py pins them equal).
EXPANDED_MIN_TOKENS = 256


def attn_form(form: str, tokens: int) -> str:
    """The attention form a chunk of `tokens` new tokens runs: model.attention.resolve_form."""
    if form == "auto":
        return "expanded" if tokens >= EXPANDED_MIN_TOKENS else "absorbed"
    if form not in ("absorbed", "expanded"):
        raise ValueError(f"attention form {form!r}: expected auto, absorbed or expanded")
    return form


def key_block(k_block: int, cache_len: int) -> int:
    """The key block prefill attention uses: a divisor of the cache length."""
    return math.gcd(int(k_block), int(cache_len))


def decode_kv_len(tokens: int, max_len: int | None = None) -> int:
    """Cache slots a decode step reads (runtime.executor.decode_kv_len): `tokens` rounded up
    to a power of two >= 64, capped at the row length."""
    n = max(64, 1 << (max(tokens, 1) - 1).bit_length())
    return n if max_len is None else min(int(max_len), n)


def attn_proj_flops(cfg: ModelConfig, q_rows: int, kv_rows: int) -> int:
    """MLA projections: q (LoRA or plain) and o_proj on q_rows rows, kv_a on kv_rows rows."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    return 2 * (q_rows * (q + h * v * d) + kv_rows * d * cfg.cache_dim)


def attn_flops(
    cfg: ModelConfig,
    tokens: int,
    start_pos: int = 0,
    *,
    rows: int = 1,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
    cache_len: int | None = None,
    walk: str = "static",
) -> int:
    """FLOPs of model/attention.py exactly as it runs (dots only; a multiply-add = 2).

    tokens == 1: a decode step of `rows` rows at position start_pos, absorbed form over
    decode_kv_len(start_pos + 1) slots: q -> latent (W_uk), scores H (R + dr) and P.V H R per
    slot, latent -> v (W_uv). tokens > 1: a prefill chunk of one sequence at start_pos in a
    cache row of cache_len slots (default: the chunk's end, bucketed). Query blocks of
    bq = min(q_block, T) tokens (the last one padded: its projections run on bq rows) each
    walk the causal key blocks: block i visits ceil((start + (i+1) bq) / bk) blocks of
    bk = key_block(k_block, cache_len) keys (clipped to the cache). Expanded form (T >= 256
    under "auto"): scores H (dn + dr) and P.V H dv per query-key pair, and kv_b
    (R H (dn + dv) per key) as the walk runs it. walk "static" (the accelerator's, priced by
    default: plans price the accelerator): kv_b once on each of the row's S keys, query
    block i visits static_key_blocks(...)[i] key blocks (a bound that holds for any start).
    walk "traced" (the CPU path): block i visits ceil((start + (i+1) bq) / bk) key blocks
    and re-expands each one. Absorbed form (either walk): per query W_uk and W_uv
    (H dn R each), per pair H (R + dr) + H R."""
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    if tokens == 1:
        slots = decode_kv_len(start_pos + 1, cache_len)
        per_row = 2 * h * (dn * r + slots * (2 * r + dr) + r * dv)
        return rows * (attn_proj_flops(cfg, 1, 1) + per_row)
    if rows != 1:
        raise ValueError(f"attn_flops: a prefill chunk is one sequence, got rows={rows}")
    from hmoe_jax.plan.buckets import cache_len as bucket

    s = bucket(cache_len if cache_len is not None else start_pos + tokens)
    form = attn_form(form, tokens)
    bq = min(q_block, tokens)
    bk = key_block(k_block, s)
    n_qb = -(-tokens // bq)
    if walk not in ("static", "traced"):
        raise ValueError(f"attn_flops: walk {walk!r}, expected static or traced")
    static = form == "expanded" and walk == "static"
    total = attn_proj_flops(cfg, n_qb * bq, tokens)
    if static:
        total += 2 * (s // bk) * bk * r * h * (dn + dv)  # kv_b once per key of the row
        blocks = static_key_blocks(tokens, s, bq, bk)
    else:
        blocks = [min(-(-(start_pos + (i + 1) * bq) // bk), s // bk) for i in range(n_qb)]
    for n_kb in blocks:
        keys = n_kb * bk
        if form == "expanded":
            total += 0 if static else 2 * keys * r * h * (dn + dv)
            total += 2 * bq * keys * h * (dn + dr + dv)
        else:
            total += 2 * bq * h * (dn * r + r * dv) + 2 * bq * keys * h * (2 * r + dr)
    return total


def static_key_blocks(tokens: int, cache_len: int, bq: int, bk: int) -> list[int]:
    """Key blocks each query block of model.attention's static walk visits (the walk and
    this cost model use this one function): query block i (positions start + i bq ..) can
    see keys up to start + (i + 1) bq - 1 <= S - T + (i + 1) bq - 1, since a chunk of T
    tokens fits its row (start + T <= S). The bound needs no `start`, so every trip count
    is a constant; the blocks past a query's real position are masked (S - T slots of slack
    per query block: the row's room beyond the chunk)."""
    n_kb = cache_len // bk
    return [min(n_kb, -(-(cache_len - tokens + (i + 1) * bq) // bk)) for i in range(-(-tokens // bq))]


def cp_attn_flops(cfg: ModelConfig, padded_tokens: int, ranks: int) -> int:
    """Per-rank FLOPs of parallel/attention.py (context-parallel, absorbed form, from
    position 0): a rank's 2C tokens (C = padded_tokens / 2N) are projected and absorbed,
    its query chunks r and 2N-1-r visit r+1 and 2N-r key chunks of C keys: 2N+1 chunk pairs.
    W_uk / W_uv are applied per token; scores H (R + dr) and P.V H R per pair."""
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    c = padded_tokens // (2 * ranks)
    local = 2 * c
    pairs = (2 * ranks + 1) * c * c
    return (
        attn_proj_flops(cfg, local, local) + 2 * local * h * (dn * r + r * dv) + 2 * pairs * h * (2 * r + dr)
    )


# The dtype an accelerator's GEMMs run in under each precision policy (model/precision.py).
# bf16: activations x activations in bf16 and FP8 weights dequantised to bf16 inside the
# computation that uses them, so bf16 x bf16 -> f32 dots: the bf16 tensor rate. No true FP8
# GEMM runs on the accelerator path today (the FP8 kernels are the CPU stand-in's hooks), so
# acc_fp8_tflops prices nothing the engine runs; it is the rate an FP8 GEMM would reach.
# f32 (and the dslp path in parallel/, which computes in f32): the fp32 rate.
POLICY_GEMM_DTYPE = {"bf16": "bf16", "f32": "fp32"}


def acc_flops_per_s(system: SystemSpec, dtype: str) -> float:
    """One accelerator's dense rate for GEMMs in `dtype` ("fp32" | "bf16" | "fp8")."""
    rates = {"fp32": system.acc_fp32_tflops, "bf16": system.acc_bf16_tflops, "fp8": system.acc_fp8_tflops}
    if dtype not in rates:
        raise ValueError(f"acc_flops_per_s: dtype {dtype!r}, expected one of {sorted(rates)}")
    return rates[dtype] * 1e12


def router_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * cfg.hidden_size * cfg.n_routed_experts


def lm_head_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * cfg.hidden_size * cfg.vocab_size


# Bytes per hidden value on a decode hop (attn_route -> host -> combine) under each precision
# policy: the hidden states cross in the policy's activation dtype (model/precision.py).
HOP_ACT_BYTES = {"bf16": 2, "f32": 4}
# Bytes per routed (token, expert) pair on the hop to the host: the id as int32 and the
# routing weight as f32. The weight stays f32 because the CPU MoE op takes f32 weights
# (kernels/moe.py) and multiplies each expert's f32 output by it; a bf16 weight would save
# 2 bytes per pair (16 of a DeepSeek-V3 token's 14,400 hop bytes) and round the combine.
ROUTE_PAIR_BYTES = 4 + 4


def hop_act_bytes(precision: str) -> int:
    """Bytes per hidden value a hop moves under `precision` ("bf16" | "f32")."""
    if precision not in HOP_ACT_BYTES:
        raise ValueError(f"hop bytes: precision {precision!r}, expected one of {sorted(HOP_ACT_BYTES)}")
    return HOP_ACT_BYTES[precision]


def hidden_bytes(cfg: ModelConfig, tokens: int, precision: str = "bf16") -> int:
    """Hidden states of `tokens` tokens as a decode hop moves them: the policy's activation
    dtype (bf16: 2 bytes, f32: 4 bytes per value; runtime/pieces.py pack_hop)."""
    return hop_act_bytes(precision) * tokens * cfg.hidden_size


def route_bytes(cfg: ModelConfig, tokens: int) -> int:
    """ids (int32) + weights (f32) of `tokens` tokens (ROUTE_PAIR_BYTES per pair)."""
    return ROUTE_PAIR_BYTES * tokens * cfg.num_experts_per_tok


def _stored_bytes(cfg: ModelConfig, shape: tuple[int, ...], quantized: bool) -> int:
    """A checkpoint tensor's bytes as placed: quantized matrices FP8 + f32 block scales
    (_w_bytes), everything else f32."""
    if quantized and cfg.quant is not None:
        return _w_bytes(cfg, *shape)
    n = 1
    for s in shape:
        n *= int(s)
    return 4 * n


def layer_rest_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of a layer's non-expert weights as stored (FP8 + f32 scales for quantized
    tensors, f32 for the rest): what dslp streams to every rank per layer."""
    return rest_bytes_by_layer(cfg)[layer]


@functools.lru_cache(maxsize=16)
def rest_bytes_by_layer(cfg: ModelConfig) -> tuple[int, ...]:
    """layer_rest_bytes of every layer, from one pass over the tensor list (cached: the
    list of a DeepSeek-V3 config has ~47K entries, and plans ask per layer and rank)."""
    from hmoe_jax.plan.tensors import expected_tensors

    out = [0] * cfg.num_hidden_layers
    for s in expected_tensors(cfg):
        if s.name.startswith("model.layers.") and ".mlp.experts." not in s.name:
            out[int(s.name.split(".")[2])] += _stored_bytes(cfg, s.shape, s.quantized)
    return tuple(out)


# Sub-array alignment inside a staging-ring slot (>= 64 for zero-copy device_put on CPU);
# runtime/staging.py lays slots out with this value.
SLOT_ALIGN_BYTES = 256


def slot_bytes(cfg: ModelConfig, experts_per_slot: int) -> int:
    """Bytes of one ring slot holding `experts_per_slot` routed experts, laid out as
    runtime/staging.slot_layout does: each stacked array (w and scale of gate, up, down)
    rounded up to SLOT_ALIGN_BYTES."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    arrays: list[int] = []
    for n, k in ((i, d), (i, d), (d, i)):
        if cfg.quant is None:
            arrays.append(4 * n * k)
        else:
            q = cfg.quant
            arrays += [n * k, 4 * (-(-n // q.block_n)) * (-(-k // q.block_k))]
    a = SLOT_ALIGN_BYTES
    return sum(-(-(b * experts_per_slot) // a) * a for b in arrays)
