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
    parts = _attn_parts(cfg, tokens, start_pos, rows, form, q_block, k_block, cache_len, walk)
    return sum(parts.values())


def attn_fp8_flops(
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
    """The part of attn_flops (same arguments) that runs as FP8 GEMMs when FP8 weights run
    through the GPU's kernels (fp8_gemms): the projections whose weights the kernels' 128
    tiling covers (q_a, q_b or q, o_proj; not kv_a_proj_with_mqa, N = R + dr = 576, which
    kernels/fp8_gemm.fp8_linear dequantises to bf16), kv_b in the expanded form, and the
    absorbed form's per-head W_uk / W_uv. Scores and P.V (activation x activation) stay
    bf16."""
    parts = _attn_parts(cfg, tokens, start_pos, rows, form, q_block, k_block, cache_len, walk)
    h, r = cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    out = parts["q_o"] if _q_o_tiled(cfg) else 0
    out += parts["kv_a"] if fp8_tiled(cfg.cache_dim, cfg.hidden_size) else 0
    out += parts["kv_b"] if fp8_tiled(h * (dn + dv), r) else 0
    out += parts["absorb"] if fp8_tiled(r, dn) and fp8_tiled(dv, r) else 0
    return out


def _q_o_tiled(cfg: ModelConfig) -> bool:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = fp8_tiled(h * qk, d)
    else:
        q = fp8_tiled(cfg.q_lora_rank, d) and fp8_tiled(h * qk, cfg.q_lora_rank)
    return q and fp8_tiled(d, h * v)


def _attn_parts(cfg, tokens, start_pos, rows, form, q_block, k_block, cache_len, walk) -> dict[str, int]:
    """attn_flops by GEMM: q_o (q projections and o_proj), kv_a, kv_b (expanded form's key
    expansion), absorb (absorbed form's W_uk / W_uv), core (scores and P.V)."""
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    parts = {"q_o": 0, "kv_a": 0, "kv_b": 0, "absorb": 0, "core": 0}
    if tokens == 1:
        slots = decode_kv_len(start_pos + 1, cache_len)
        parts["q_o"] = rows * (attn_proj_flops(cfg, 1, 0))
        parts["kv_a"] = rows * 2 * cfg.hidden_size * cfg.cache_dim
        parts["absorb"] = rows * 2 * h * (dn * r + r * dv)
        parts["core"] = rows * 2 * h * slots * (2 * r + dr)
        return parts
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
    parts["q_o"] = attn_proj_flops(cfg, n_qb * bq, 0)
    parts["kv_a"] = 2 * tokens * cfg.hidden_size * cfg.cache_dim
    if static:
        parts["kv_b"] = 2 * (s // bk) * bk * r * h * (dn + dv)  # kv_b once per key of the row
        blocks = static_key_blocks(tokens, s, bq, bk)
    else:
        blocks = [min(-(-(start_pos + (i + 1) * bq) // bk), s // bk) for i in range(n_qb)]
    for n_kb in blocks:
        keys = n_kb * bk
        if form == "expanded":
            parts["kv_b"] += 0 if static else 2 * keys * r * h * (dn + dv)
            parts["core"] += 2 * bq * keys * h * (dn + dr + dv)
        else:
            parts["absorb"] += 2 * bq * h * (dn * r + r * dv)
            parts["core"] += 2 * bq * keys * h * (2 * r + dr)
    return parts


def static_key_blocks(tokens: int, cache_len: int, bq: int, bk: int) -> list[int]:
    """Key blocks each query block of model.attention's static walk visits (the walk and
    this cost model use this one function): query block i (positions start + i bq ..) can
    see keys up to start + (i + 1) bq - 1 <= S - T + (i + 1) bq - 1, since a chunk of T
    tokens fits its row (start + T <= S). The bound needs no `start`, so every trip count
    is a constant; the blocks past a query's real position are masked (S - T slots of slack
    per query block: the row's room beyond the chunk)."""
    n_kb = cache_len // bk
    return [min(n_kb, -(-(cache_len - tokens + (i + 1) * bq) // bk)) for i in range(-(-tokens // bq))]


# parallel/attention.py's expanded context-parallel walk: query and key blocks of the same
# size (at most CP_BLOCK tokens), K/V expanded into buffers of the rank's whole gathered
# row, in head groups small enough that one group's buffer stays under CP_KV_BUFFER_BYTES.
CP_BLOCK = 512
CP_KV_BUFFER_BYTES = 1 << 30


def cp_block(chunk: int, block: int = CP_BLOCK) -> int:
    """The CP walk's query = key block for zig-zag chunks of `chunk` tokens: the largest
    divisor of chunk in [block/2, block] (whole blocks per chunk: the walk's trip counts are
    then exact), else min(block, chunk) (the chunk's last query block is padded)."""
    if chunk < 1 or block < 1:
        raise ValueError(f"cp_block: chunk={chunk} and block={block} must be >= 1")
    if chunk <= block:
        return chunk
    for b in range(block, (block + 1) // 2 - 1, -1):
        if chunk % b == 0:
            return b
    return block


def cp_key_blocks(chunk: int, ranks: int, block: int) -> list[int]:
    """Key blocks the CP walk visits for each pair of query blocks i (block i of the rank's
    chunk r and block i of its chunk 2N-1-r, walked as one loop): a constant per i, the
    same on every rank. Chunk c's block i needs ceil((c C + (i+1) b) / b) key blocks; for
    the pair the sum is (2N-1) C / b + 2 (i+1) whatever r is (zig-zag balance) when b
    divides C, and at most one more otherwise. Clipped to the gathered row (2 n_kb)."""
    n, c, b = int(ranks), int(chunk), int(block)
    n_kb = -(-2 * n * c // b)
    n_qb = -(-c // b)
    if c % b == 0:
        trips = [(2 * n - 1) * c // b + 2 * (i + 1) for i in range(n_qb)]
    else:
        trips = [-(-((2 * n - 1) * c + 2 * (i + 1) * b) // b) + 1 for i in range(n_qb)]
    return [min(t, 2 * n_kb) for t in trips]


def cp_head_groups(cfg: ModelConfig, padded_tokens: int, act_bytes: int = 2) -> int:
    """Head groups of the CP walk: the fewest (a divisor of H) whose K_nope / V buffer of
    the padded row [S, H / G, dn + dv] in the act dtype fits CP_KV_BUFFER_BYTES."""
    h = cfg.num_attention_heads
    per_head = padded_tokens * (cfg.qk_nope_head_dim + cfg.v_head_dim) * act_bytes
    for g in range(1, h + 1):
        if h % g == 0 and per_head * (h // g) <= CP_KV_BUFFER_BYTES:
            return g
    return h


def cp_attn_flops(cfg: ModelConfig, padded_tokens: int, ranks: int, *, block: int = CP_BLOCK) -> int:
    """Per-rank FLOPs of parallel/attention.py (context-parallel, expanded form, from
    position 0), dots only. The rank's 2C tokens (C = padded_tokens / 2N) are projected
    (q on whole query blocks: n_qb b rows per chunk; kv_a on 2C rows); kv_b expands every
    key block of the gathered row once (n_kb b keys, R H (dn + dv) each); each pair of query
    blocks i walks cp_key_blocks(...)[i] key blocks of b keys: scores H (dn + dr) and P.V
    H dv per query-key pair. Head groups split every per-head GEMM, so they change no
    count."""
    return sum(_cp_attn_parts(cfg, padded_tokens, ranks, block).values())


def cp_attn_fp8_flops(cfg: ModelConfig, padded_tokens: int, ranks: int, *, block: int = CP_BLOCK) -> int:
    """The part of cp_attn_flops an FP8 model runs as FP8-weight GEMMs (the FP8 GEMM hook):
    q_a / q_b (or q), kv_b and o_proj; not kv_a (its N = 576 is not a whole number of
    128-row blocks, so the hook's bf16 fallback runs it) and not the scores / P.V dots
    (activations x activations, bf16). 0 for an unquantised model."""
    if cfg.quant is None:
        return 0
    parts = _cp_attn_parts(cfg, padded_tokens, ranks, block)
    return parts["q_o"] + parts["kv_b"]


def _cp_attn_parts(cfg: ModelConfig, padded_tokens: int, ranks: int, block: int) -> dict[str, int]:
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    c = padded_tokens // (2 * ranks)
    if c * 2 * ranks != padded_tokens or c < 1:
        raise ValueError(f"cp_attn_flops: padded_tokens={padded_tokens} is not 2N C for N={ranks}")
    b = cp_block(c, block)
    n_qb, n_kb = -(-c // b), -(-padded_tokens // b)
    q_rows = 2 * n_qb * b
    kv_a = 2 * 2 * c * cfg.hidden_size * cfg.cache_dim
    return {
        "q_o": attn_proj_flops(cfg, q_rows, 2 * c) - kv_a,
        "kv_a": kv_a,
        "kv_b": 2 * n_kb * b * r * h * (dn + dv),
        "pairs": sum(cp_key_blocks(c, ranks, b)) * 2 * b * b * h * (dn + dr + dv),
    }


# The dtype an accelerator's GEMMs run in under each precision policy (model/precision.py),
# the plan's compute_dtype. bf16: activation x activation dots (attention scores, P.V) and
# bf16-weight GEMMs (lm_head) as bf16 x bf16 -> f32, and the router in f32 (small): the
# bf16 tensor rate. FP8 weights on a GPU run as FP8 GEMMs (kernels/fp8_gemm.py through the
# policy's hooks: e4m3 x e4m3 -> f32): plans put those FLOPs in an op's args.fp8_flops
# (fp8_gemms / fp8_flops below), priced at the fp8 rate (sim/pricing.py). FP8 weights the
# kernels' tiling does not cover (N or K not a multiple of 128: kv_a_proj_with_mqa) are
# dequantised to bf16 inside their piece and stay at compute_dtype. On the CPU stand-in the
# same FLOPs run in our FFI kernels, whose measured rate the profile gives as both bf16 and
# fp8 (configs/systems/local.toml). f32: the fp32 rate, fp8_flops 0 (dslp included: it runs
# under the same policy, schedules/dslp.py).
POLICY_GEMM_DTYPE = {"bf16": "bf16", "f32": "fp32"}
# kernels/fp8_gemm.QBLOCK: the FP8 kernels' tile (N and K multiples of it, 128x128 weight
# blocks); restated because plan/ imports no kernel code (tests/test_fp8_pricing.py pins it)
FP8_GEMM_TILE = 128


def fp8_gemms(cfg: ModelConfig, precision: str) -> bool:
    """Whether the model's FP8 weights run as FP8 GEMMs on an accelerator under `precision`:
    the bf16 policy (engine.precision_for on a GPU) with FP8 weights in 128x128 blocks."""
    if precision not in POLICY_GEMM_DTYPE:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(POLICY_GEMM_DTYPE)}")
    q = cfg.quant
    return precision == "bf16" and q is not None and (q.block_n, q.block_k) == (FP8_GEMM_TILE,) * 2


def fp8_tiled(n: int, k: int) -> bool:
    """The FP8 kernels take an [N, K] weight (else fp8_linear's bf16 fallback)."""
    return n % FP8_GEMM_TILE == 0 and k % FP8_GEMM_TILE == 0


def ffn_fp8_flops(cfg: ModelConfig, flops: int, intermediate: int) -> int:
    """`flops` of a SwiGLU (gate/up [I, D], down [D, I]) if its weights run as FP8 GEMMs."""
    return (
        flops if fp8_tiled(intermediate, cfg.hidden_size) and fp8_tiled(cfg.hidden_size, intermediate) else 0
    )


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
