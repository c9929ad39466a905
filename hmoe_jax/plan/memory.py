"""Accelerator memory of a plan: what stays resident, the staging ring's device side, the
latent cache and the peak temporaries, against the system's accelerator memory. Plain
arithmetic from the config (no jax): schedules refuse a plan whose budget does not fit,
`hmoe plan` prints it, and the engine's CLI sizes JAX's GPU memory fraction from it.

- resident_bytes: the non-expert weights as the engine places them on the first
  accelerator (runtime/state.py): FP8 matrices + f32 block scales, norms / router / bias
  counted f32, embeddings and lm_head bf16 as DeepSeek releases them (f32 models: 4 bytes
  everywhere), plus the absorbed-attention copies a bf16 policy derives from kv_b
  (absorbed_bytes: FP8 per-head w_uk / w_uv where the FP8 kernels take them, else bf16).
- ring_bytes: slp's device-side ring, ring_slots x plan.costs.slot_bytes (the GPU
  "inplace" device ring preallocates every slot); dslp: what a rank holds streamed at
  once (see dslp_budget: rank 0 one layer of experts, the others two layers + weights).
- cache_bytes: the KV pool, rows x cache_len(max_len) x layers x cache_dim x cache dtype.
- temp_bytes: the largest stage of one layer: the activations alive between pieces at
  that stage (h, x, the shared output, the f32 routed accumulator, routing) plus the
  running piece's own XLA temporaries. Piece temporaries are estimated here from the
  shapes the pieces build (runtime/pieces.py, model/attention.py) or measured by the
  caller (measure/compile_probe.py: memory_analysis() of the compiled piece) and passed in
  as `piece_temps`, which then replace the estimates piece by piece.

usable = acc_mem_bytes - RESERVE_BYTES; fits = resident + ring + cache + temp <= usable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.buckets import cache_len, expert_rows_bucket
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.plan.tensors import expected_tensors

GIB = 2**30
# Not available to XLA's buffers: the CUDA context, cuBLAS/cuDNN workspaces and allocator
# fragmentation (an allowance, not a measurement).
RESERVE_BYTES = 1 * GIB
# The slp ring's headroom: slots above the pipeline's minimum of 2 stop this fraction of the
# accelerator's memory short of full (0.96 GiB of a 32 GiB card), so an underestimated
# temporary (the estimates are not measurements) or allocator fragmentation costs ring
# slots instead of an out-of-memory error. A stated allowance, not a measurement.
RING_HEADROOM_FRACTION = 0.03
SLP_PIECES = ("attention", "dense_ffn", "route", "shared", "experts_group", "combine", "final")


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """One accelerator's memory under a plan (dslp: the rank that needs the most)."""

    schedule: str
    tokens: int
    acc_mem_bytes: int
    resident_bytes: int
    ring_bytes: int
    cache_bytes: int
    temp_bytes: int
    temp_measured: bool  # every piece temporary came from a compiled piece
    temp_stage: str  # the stage that sets temp_bytes
    ring_slots: int = 0
    slot_bytes: int = 0
    kv_rows: int = 1
    max_len: int = 0
    rank: int = 0
    ranks: int = 1
    min_ring_slots: int = 0
    reserve_bytes: int = RESERVE_BYTES
    detail: str = ""  # what the ring / streamed bytes are made of

    @property
    def usable_bytes(self) -> int:
        return self.acc_mem_bytes - self.reserve_bytes

    @property
    def acc_peak_bytes(self) -> int:
        return self.resident_bytes + self.ring_bytes + self.cache_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        return self.ring_slots >= self.min_ring_slots and self.acc_peak_bytes <= self.usable_bytes

    @property
    def message(self) -> str:
        where = f" on rank {self.rank} of {self.ranks}" if self.ranks > 1 else ""
        kind = "measured" if self.temp_measured else "estimated"
        parts = (
            f"resident {_g(self.resident_bytes)} + ring {_g(self.ring_bytes)}"
            + (f" ({self.detail})" if self.detail else "")
            + f" + cache {_g(self.cache_bytes)} ({self.kv_rows} x {self.max_len}-token rows)"
            + f" + temporaries {_g(self.temp_bytes)} ({self.temp_stage}, {kind})"
        )
        limit = (
            f"{_g(self.usable_bytes)} usable ({_g(self.acc_mem_bytes)} - {_g(self.reserve_bytes)} reserve)"
        )
        head = f"{self.schedule} at {self.tokens} tokens{where}"
        if self.ring_slots < self.min_ring_slots:
            fixed = self.resident_bytes + self.cache_bytes + self.temp_bytes
            left = self.usable_bytes - fixed
            if left < 0:
                return f"{head} does not fit: {_g(fixed)} before any ring slot = {parts} > {limit}"
            return (
                f"{head} does not fit: {self.ring_slots} ring slots of {_g(self.slot_bytes)} fit in the "
                f"{_g(left)} left of {limit} after {parts}; it needs >= {self.min_ring_slots}"
            )
        peak = f"peak {_g(self.acc_peak_bytes)} = {parts}"
        if not self.fits:
            return f"{head} does not fit: {peak} > {limit}"
        return f"{head} fits: {peak} <= {limit}"

    def meta(self) -> dict[str, Any]:
        """The numbers a plan's meta carries (plans are data; traces keep their meta)."""
        keys = ("resident_bytes", "ring_bytes", "cache_bytes", "temp_bytes", "temp_measured", "temp_stage")
        return {"acc_peak_bytes": self.acc_peak_bytes, **{k: getattr(self, k) for k in keys}}

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            acc_peak_bytes=self.acc_peak_bytes,
            usable_bytes=self.usable_bytes,
            fits=self.fits,
            message=self.message,
        )
        return d


def _g(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


# ------------------------------------------------------------------ weights and cache


def _placed_bytes(cfg: ModelConfig, name: str, shape: tuple[int, ...], quantized: bool) -> int:
    if quantized and cfg.quant is not None:
        return costs._w_bytes(cfg, *shape)
    n = 1
    for s in shape:
        n *= int(s)
    table = name in ("model.embed_tokens.weight", "lm_head.weight")
    return n * (2 if table and cfg.quant is not None else 4)


def absorbed_bytes(cfg: ModelConfig, precision: str = "bf16") -> int:
    """Per layer: the absorbed halves of kv_b a non-f32 policy keeps (runtime/state.py
    absorbed_weights): FP8 per-head tensors w_uk [H, R, dn] + w_uv [H, dv, R] with their f32
    block scales where the per-head FP8 kernels take them (FP8 weights in 128 blocks, dn and
    dv multiples of 128: the bf16 policy on a GPU and the CPU stand-in), else bf16 copies."""
    if precision == "f32":
        return 0
    h, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    if costs.fp8_gemms(cfg, precision) and dn % 128 == 0 and dv % 128 == 0:
        return h * (dn + dv) * r + 4 * h * ((dn + dv) // 128) * (-(-r // 128))
    return 2 * h * (dn + dv) * r


@functools.lru_cache(maxsize=16)
def resident_bytes(cfg: ModelConfig, precision: str = "bf16") -> int:
    """Every non-expert weight as placed on the accelerator, plus the absorbed copies."""
    rest = sum(
        _placed_bytes(cfg, s.name, s.shape, s.quantized)
        for s in expected_tensors(cfg)
        if ".mlp.experts." not in s.name
    )
    return rest + cfg.num_hidden_layers * absorbed_bytes(cfg, precision)


def cache_bytes(cfg: ModelConfig, rows: int, max_len: int, dtype_bytes: int = 2) -> int:
    """The KV pool (runtime/kvpool.py): rows x cache_len(max_len) slots per layer."""
    return cfg.num_hidden_layers * rows * cache_len(max_len) * cfg.cache_dim * dtype_bytes


# ------------------------------------------------------------------ piece temporaries


def _dequant_bytes(cfg: ModelConfig, n: int, k: int, wb: int) -> int:
    """A weight's copy dequantised for a dot (FP8 models only; f32 weights feed it as stored).
    Under the bf16 policy (wb = 2) an FP8 [N, K] weight the FP8 kernels tile is consumed as
    stored (kernels/fp8_gemm.py on a GPU: no copy); one they do not tile (kv_a, N = 576) is
    dequantised to bf16."""
    if cfg.quant is None or (wb == 2 and costs.fp8_gemms(cfg, "bf16") and costs.fp8_tiled(n, k)):
        return 0
    return n * k * wb


def attention_temp(
    cfg: ModelConfig,
    tokens: int,
    *,
    cache_slots: int,
    rows: int = 1,
    act: int = 2,
    form: str = "auto",
    q_block: int = 1024,
    k_block: int = 512,
    walk: str = "static",
) -> int:
    """Estimated temporaries of pieces.attention (model/attention.py). Prefill: the padded
    input and the stacked block outputs [T, D], kv_a's output and the new latents [T, 576]
    in f32, one (query block, key block) pair's working set (two f32 score blocks
    [bq, H, bk], the f32 accumulator carried twice, the block's q, the expanded keys of one
    key block) and the dequantised attention weights (_dequant_bytes: under the bf16
    policy only kv_a); the expanded form's static walk (the accelerator's, planned by
    default) adds the row's K_nope / V buffers [S, H, dn + dv]
    in the act dtype (2.03 GiB bf16 for a 33280-slot DeepSeek-V3 row) and no per-block
    expansion; walk="traced" is the CPU walk. Decode: two f32 score rows [B, H, kv] and the
    gathered cache rows."""
    d, h, r, cd = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.cache_dim
    qk, dn, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    wb = 2 if act == 2 else 4
    w = _dequant_bytes(cfg, cd, d, wb) + _dequant_bytes(cfg, h * (dn + dv), r, wb)
    w += _dequant_bytes(cfg, d, h * dv, wb)
    if cfg.q_lora_rank is None:
        w += _dequant_bytes(cfg, h * qk, d, wb)
    else:
        w += _dequant_bytes(cfg, cfg.q_lora_rank, d, wb) + _dequant_bytes(cfg, h * qk, cfg.q_lora_rank, wb)
    if tokens == 1:
        slots = costs.decode_kv_len(cache_slots, cache_slots)
        return w + rows * (2 * h * slots * 4 + slots * cd * act + h * (r + qk) * 4 * 3)
    form = costs.attn_form(form, tokens)
    bq, bk = min(q_block, tokens), costs.key_block(k_block, cache_slots)
    t_pad = -(-tokens // bq) * bq
    per_token = 2 * t_pad * d * act + 2 * tokens * cd * 4
    width = dv if form == "expanded" else r
    block = 2 * bq * h * bk * 4 + 2 * bq * h * width * 4 + bq * h * qk * (4 + act) + bq * h * qk * 4
    if form != "expanded":
        block += bq * h * r * 4
    elif walk == "static":
        block += (cache_slots // bk) * bk * h * (dn + dv) * act
    else:
        block += bk * h * (dn + dv) * (4 + act)
    return w + per_token + block


def ffn_temp(cfg: ModelConfig, tokens: int, inter: int, act: int = 2) -> int:
    """A SwiGLU on [T, D] (dense FFN, shared expert): gate and up outputs f32 [T, I], their
    product in the act dtype, the down output (XLA fuses its f32 -> act cast), the
    dequantised weights."""
    d, wb = cfg.hidden_size, (2 if act == 2 else 4)
    return tokens * inter * (8 + act) + tokens * d * act + 3 * _dequant_bytes(cfg, inter, d, wb)


# runtime/pieces.dense_ffn runs long prefills in token chunks of this many tokens
FFN_CHUNK_TOKENS = 4096


def dense_ffn_temp(cfg: ModelConfig, tokens: int, act: int = 2) -> int:
    """pieces.dense_ffn: one chunk's SwiGLU, plus (when chunked) the padded input and the
    stacked chunk outputs in the act dtype and the f32 residual sum, all [T, D]."""
    chunk = min(tokens, FFN_CHUNK_TOKENS)
    extra = tokens * cfg.hidden_size * (2 * act + 4) if tokens > FFN_CHUNK_TOKENS else 0
    return ffn_temp(cfg, chunk, cfg.intermediate_size, act) + extra


def experts_group_temp(cfg: ModelConfig, tokens: int, experts_per_slot: int = 1, act: int = 2) -> int:
    """pieces.experts_group at its worst-case bucket (a slot of G experts gets at most
    min(G, k) T rows): gathered rows [rows, D], gate / up f32 [rows, I], the product, the f32
    output rows [rows, D], the slot's dequantised weights (none under the bf16 policy: the grouped FP8 kernel)."""
    d, i, wb = cfg.hidden_size, cfg.moe_intermediate_size, (2 if act == 2 else 4)
    n = min(experts_per_slot, cfg.num_experts_per_tok) * tokens
    rows = expert_rows_bucket(n)  # pieces.row_bucket
    return rows * (d * act + i * (8 + act) + d * 4) + 3 * experts_per_slot * _dequant_bytes(cfg, i, d, wb)


def slp_piece_temps(
    cfg: ModelConfig,
    tokens: int,
    *,
    cache_slots: int,
    experts_per_slot: int = 1,
    act: int = 2,
    attn: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Estimated temporaries of every accelerator piece of a prefill chunk of `tokens`."""
    d, e = cfg.hidden_size, cfg.n_routed_experts
    return {
        "attention": attention_temp(cfg, tokens, cache_slots=cache_slots, act=act, **(attn or {})),
        "dense_ffn": dense_ffn_temp(cfg, tokens, act),
        "route": tokens * d * 4 + 3 * tokens * e * 4,
        "shared": ffn_temp(cfg, tokens, cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1), act),
        "experts_group": experts_group_temp(cfg, tokens, experts_per_slot, act),
        "combine": tokens * d * 4,
        "final": cfg.vocab_size * 4,
    }


def slp_stages(cfg: ModelConfig, tokens: int, act: int = 2) -> dict[str, tuple[str, int]]:
    """stage -> (its piece, the activations alive outside that piece while it runs), for
    one sequence of `tokens` tokens through an slp layer (or a cpu chunk on the accelerator)."""
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    hid = tokens * d * act  # h, x, the shared output: [T, D] act dtype
    routing = tokens * k * 8  # ids int32 + weights f32 [T, k]
    acc = tokens * d * 4  # the f32 routed accumulator
    stages = {"attention": ("attention", 2 * hid), "final": ("final", hid + cfg.vocab_size * 4)}
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        stages["dense_ffn"] = ("dense_ffn", 2 * hid)
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        shared = hid if cfg.n_shared_experts else 0
        stages["route"] = ("route", 2 * hid + routing)
        if cfg.n_shared_experts:
            stages["shared"] = ("shared", 3 * hid + routing)
        stages["experts_group"] = ("experts_group", 2 * hid + shared + 2 * routing + acc)
        stages["combine"] = ("combine", 2 * hid + shared + acc)
    return stages


def peak_temp(
    stages: dict[str, tuple[str, int]], estimates: dict[str, int], measured: dict[str, int] | None
) -> tuple[int, str, bool]:
    """(largest stage's live activations + piece temporaries, that stage, all measured?)."""
    measured = dict(measured or {})
    best, name = -1, ""
    for stage, (piece, live) in stages.items():
        total = live + measured.get(piece, estimates[piece])
        if total > best:
            best, name = total, stage
    return best, name, all(p in measured for p, _ in stages.values())


# ------------------------------------------------------------------ budgets per schedule


def _pool(tokens: int, start_pos: int, kv_rows: int | None, max_len: int | None) -> tuple[int, int]:
    rows = 1 if kv_rows is None else int(kv_rows)
    length = cache_len(max_len if max_len is not None else start_pos + tokens)
    if rows < 1 or length < start_pos + tokens:
        raise ValueError(
            f"memory: kv_rows={rows} must be >= 1 and max_len={length} >= start_pos + tokens = {start_pos + tokens}"
        )
    return rows, length


def ring_headroom_bytes(system: SystemSpec) -> int:
    """Memory the slp ring policy leaves unused beyond RESERVE_BYTES before it adds a slot
    above the minimum: RING_HEADROOM_FRACTION of the accelerator's memory."""
    return int(RING_HEADROOM_FRACTION * system.acc_mem_bytes)


def slp_budget(
    cfg: ModelConfig,
    system: SystemSpec,
    tokens: int,
    *,
    groups_per_layer: int,
    experts_per_slot: int,
    start_pos: int = 0,
    kv_rows: int | None = None,
    max_len: int | None = None,
    ring_slots: int | None = None,
    precision: str = "bf16",
    piece_temps: dict[str, int] | None = None,
    attn: dict[str, Any] | None = None,
) -> MemoryBudget:
    """slp's budget and ring size. The ring is sized from memory alone: it gets the memory
    the plan leaves (usable minus resident weights, KV cache and the largest stage's
    temporaries) less ring_headroom_bytes, as many slots as that holds, at most one layer
    of groups (a layer's experts all in flight: the loader never waits on the compute
    worker) and at least the minimum: 2 slots (1 if a layer is one group), the ping-pong
    the pipeline needs. The headroom only trims slots above the minimum, so whether a plan
    fits is decided without it. No rate enters: the size changes with the prompt only as
    the cache and temporaries grow (so it never grows for a longer prompt) and not at all
    with the link or compute rates (a faster link never gets a different plan). Fewer than
    the minimum left: the plan does not fit. ring_slots forces a size (then it must fit as
    it is)."""
    rows, length = _pool(tokens, start_pos, kv_rows, max_len)
    act = 2 if precision != "f32" else 4
    est = slp_piece_temps(
        cfg, tokens, cache_slots=length, experts_per_slot=experts_per_slot, act=act, attn=attn
    )
    temp, stage, measured = peak_temp(slp_stages(cfg, tokens, act), est, piece_temps)
    resident = resident_bytes(cfg, precision)
    cache = cache_bytes(cfg, rows, length, act)
    slot = costs.slot_bytes(cfg, experts_per_slot)
    left = system.acc_mem_bytes - RESERVE_BYTES - resident - cache - temp
    need = min(2, groups_per_layer)
    if ring_slots is not None:
        slots, need = int(ring_slots), int(ring_slots)
    elif left < need * slot:  # does not fit: report what does
        slots = max(0, left // slot)
    else:
        spare = max(0, left - ring_headroom_bytes(system))
        slots = max(need, min(groups_per_layer, spare // slot))
    return MemoryBudget(
        schedule="slp",
        tokens=tokens,
        acc_mem_bytes=system.acc_mem_bytes,
        resident_bytes=resident,
        ring_bytes=slots * slot,
        cache_bytes=cache,
        temp_bytes=temp,
        temp_measured=measured,
        temp_stage=stage,
        ring_slots=slots,
        slot_bytes=slot,
        kv_rows=rows,
        max_len=length,
        min_ring_slots=need,
        detail=f"{slots} x {slot / 2**20:.1f} MiB slots",
    )


def cpu_budget(
    cfg: ModelConfig,
    system: SystemSpec,
    tokens: int,
    *,
    chunk_tokens: int,
    batch: int = 1,
    start_pos: int = 0,
    kv_rows: int | None = None,
    max_len: int | None = None,
    precision: str = "bf16",
    piece_temps: dict[str, int] | None = None,
    attn: dict[str, Any] | None = None,
) -> MemoryBudget:
    """cpu: resident weights + cache + one chunk's temporaries (the routed experts run on
    the host; nothing is streamed). Decode steps: `batch` rows of one token."""
    rows, length = _pool(tokens, start_pos, kv_rows if kv_rows is not None else batch, max_len)
    act = 2 if precision != "f32" else 4
    n = batch if tokens == 1 else min(chunk_tokens, tokens)
    est = slp_piece_temps(cfg, n, cache_slots=length, act=act, attn=attn)
    if tokens == 1:
        est["attention"] = attention_temp(cfg, 1, cache_slots=length, rows=batch, act=act)
    stages = {k: v for k, v in slp_stages(cfg, n, act).items() if k != "experts_group"}
    temp, stage, measured = peak_temp(stages, est, piece_temps)
    return MemoryBudget(
        schedule="cpu",
        tokens=tokens,
        acc_mem_bytes=system.acc_mem_bytes,
        resident_bytes=resident_bytes(cfg, precision),
        ring_bytes=0,
        cache_bytes=cache_bytes(cfg, rows, length, act),
        temp_bytes=temp,
        temp_measured=measured,
        temp_stage=stage,
        kv_rows=rows,
        max_len=length,
    )


def dslp_attention_temp(
    cfg: ModelConfig,
    padded_tokens: int,
    ranks: int,
    act: int = 2,
    dot: int | None = None,
    head_groups: int | None = None,
) -> int:
    """Temporaries of parallel/attention.cp_attention_block on one rank (B = 1), act = 2
    for the bf16 policy on a GPU (activations, cache and dot operands bf16), 4 for F32.
    The walk phase holds: the f32 output accumulator over head groups [2 n_qb b, D], q's
    input rows [2 n_qb b, q_lora] (act), the gathered cache (gathered, permuted, padded
    to whole key blocks: [S, 576] each, the permuted one is the piece's output), one head
    group's K_nope / V buffers [n_kb b, H/G, dn + dv] (the dot dtype), and one pair of
    query blocks' working set: q [2b, H/G, qk] f32 and its dot-dtype copy, three f32 score
    blocks [b, H/G, b] (scores, masked, probabilities), the f32 carry twice plus P.V
    [2, b, H/G, dv]. The projection phase: the normed rows [2C, D], kv_a's f32 output
    [2C, 576], q_a's f32 output of one chunk. The end: the accumulator, the output rows and
    their residual sum [2C, D]. Without an FP8 hook (F32) every attention weight's f32
    copy adds (the dequantised weight of each dot). dot: the dot dtype's bytes when it
    differs from act (the CPU stand-in's bf16 policy computes dots in f32: 4); head groups
    are the plan's (cp_head_groups at act) unless given. The groups run as a loop (one
    group's buffers live at a time) and the query-block pairs one after another: measured
    on XLA:CPU at 32K on 2 ranks (compile_probe.probe_dslp_attention, bf16 dots, 2 groups)
    1.79 GiB against 1.94 GiB here; at 46080 (4 groups) 1.53 against 1.69."""
    dot = act if dot is None else dot
    d, h, cd, r = cfg.hidden_size, cfg.num_attention_heads, cfg.cache_dim, cfg.kv_lora_rank
    dn, dv, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    c = padded_tokens // (2 * ranks)
    b = costs.cp_block(c)
    n_qb, n_kb = -(-c // b), -(-padded_tokens // b)
    hg = h // (head_groups or costs.cp_head_groups(cfg, padded_tokens, act))
    q_in = cfg.q_lora_rank or d
    rows = 2 * n_qb * b
    acc = rows * d * 4
    gathered = 2 * padded_tokens * cd * act + n_kb * b * cd * act
    kv_buf = n_kb * b * hg * (dn + dv) * dot
    block = 2 * b * hg * qk * (4 + dot) + 3 * b * hg * b * 4 + 3 * 2 * b * hg * dv * 4
    walk = acc + rows * q_in * act + gathered + kv_buf + block
    proj = 2 * c * d * act + 2 * c * cd * 4 + c * q_in * 4 + gathered
    end = acc + 2 * 2 * c * d * act + gathered
    weights = 0
    if act == 4:
        w = cd * d + h * (dn + dv) * r + d * h * dv
        w += h * qk * d if cfg.q_lora_rank is None else q_in * d + h * qk * q_in
        weights = _dequant_bytes(cfg, 1, w, 4)
    return max(walk, proj, end) + weights


def dslp_rank_temps(
    cfg: ModelConfig, padded_tokens: int, ranks: int, act: int = 2, probe_dequant: bool = False
) -> dict[str, int]:
    """Estimated per-rank temporaries of the dslp stages as parallel/ computes them under
    a policy (act = 2: bf16 activations, payloads and cache with FP8 GEMM hooks, a GPU;
    4: the F32 path). attention: dslp_attention_temp. moe (SmallEP in blocks of
    SMALLEP_LOCAL_BLOCK local rows, parallel/moe.py; grouped experts in blocks of <= 8192
    pairs): the normed local tokens and the routed output [T_l, D] (act); then the larger
    of: per block the gathered rows and the partials [N b, D] (act, and the partials' f32
    sum), routing, and one block of pairs (rows [P, D] act, gate / up / product [P, I] f32,
    outputs [P, D] f32), with one chunk of 2 experts' f32 weights when no grouped FP8 hook
    reads the FP8 stack (F32); the shared expert's SwiGLU on [T_l, D] (it runs after the
    blocks, XLA reuses their buffers). dense: the SwiGLU in blocks of DENSE_FFN_BLOCK
    tokens plus [2C, D] in and out. final: the f32 logits row, and under F32 the lm_head's
    f32 copy. probe_dequant: the form compile_probe compiles on XLA:CPU, where the FP8 hooks'
    stand-ins dequantise the dense FFN's three FP8 weights to bf16 inside the piece (Pallas
    kernels do not compile for XLA:CPU); a GPU makes no such copy, so plans leave it False."""
    d, e, i, k = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    local = padded_tokens // ranks
    lb = min(1024, local)
    rows = ranks * lb
    pairs = min(rows * k, 8192)
    dequant = 2 * 3 * i * d * 4 if act == 4 else 0
    block = rows * d * (2 * act + 4) + 3 * rows * e * 4 + pairs * (d * (act + 4) + 3 * i * 4) + dequant
    shared = ffn_temp(cfg, local, i * max(cfg.n_shared_experts, 1), act)  # runs after the blocks
    moe = 2 * local * d * act + max(block, shared)
    dense = ffn_temp(cfg, min(2048, local), cfg.intermediate_size, act) + 2 * local * d * act
    if probe_dequant and act == 2 and cfg.quant is not None:
        dense += 3 * cfg.intermediate_size * d * 2
    final = cfg.vocab_size * 4 + (cfg.vocab_size * d * 4 if act == 4 else 0)
    return {
        "attention": dslp_attention_temp(cfg, padded_tokens, ranks, act),
        "moe": moe,
        "dense_ffn": dense,
        "final": final,
    }


def dslp_budget(
    cfg: ModelConfig,
    system: SystemSpec,
    tokens: int,
    *,
    ranks: int,
    padded_tokens: int,
    kv_rows: int | None = None,
    max_len: int | None = None,
    precision: str = "bf16",
    piece_temps: dict[str, int] | None = None,
    schedule: str = "dslp",
) -> MemoryBudget:
    """dslp per rank; returns the rank with the highest peak (schedules/dslp.py's plan).
    Rank 0 is the engine's decode accelerator: the resident non-expert weights (placed
    once, whatever the schedule; dslp reuses them instead of streaming a replica: layers,
    embedding, norm and lm_head) and the KV pool live there, and it holds ONE MoE layer of
    its E/N experts at a time (its copy of layer i+1 waits for layer i's MoE). Every other
    rank holds what its loader has streamed and not yet consumed: the dense layers'
    non-expert weights (their loads wait for nothing but the embed, so they all land at the
    start) and two MoE layers in flight (the ring's two layers of per-rank slots: E/N
    experts plus the layer's non-expert weights); the final stage streams it the replicated
    embedding-sized lm_head (nothing else is in flight then)."""
    rows, length = _pool(tokens, 0, kv_rows, max_len)
    el = cfg.n_routed_experts // ranks
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    dense_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    rest = costs.rest_bytes_by_layer(cfg)
    experts = el * costs.expert_bytes(cfg) if moe_layers else 0
    per_layer = max(rest[i] for i in moe_layers) + experts if moe_layers else 0
    table = cfg.vocab_size * cfg.hidden_size * (2 if cfg.quant is not None else 4)
    local = padded_tokens // ranks
    act = 4 if precision == "f32" else 2
    est = dslp_rank_temps(cfg, padded_tokens, ranks, act)
    hid = 2 * local * cfg.hidden_size * act  # h in and out
    stages = {"attention": ("attention", hid), "moe": ("moe", hid)}
    if dense_layers:
        stages["dense_ffn"] = ("dense_ffn", hid)
    temp, stage, measured = peak_temp(stages, est, piece_temps)
    final_temp = local * cfg.hidden_size * act + dict(piece_temps or {}).get("final", est["final"])

    def budget(r: int) -> MemoryBudget:
        if r == 0:
            streamed, head = experts, 0
            detail = (
                f"in flight: 1 MoE layer of {el} experts; non-expert weights resident" if moe_layers else ""
            )
        else:
            streamed = sum(rest[i] for i in dense_layers) + min(2, len(moe_layers)) * per_layer
            head = table
            detail = f"in flight: {len(dense_layers)} dense layers + 2 MoE layers of {el} experts"
        ring, t, st = streamed, temp, stage
        if final_temp + head > streamed + temp:
            ring, t, st, detail = 0, final_temp + head, "final", ""
        return MemoryBudget(
            schedule=schedule,
            tokens=tokens,
            acc_mem_bytes=system.acc_mem_bytes,
            resident_bytes=resident_bytes(cfg, precision) if r == 0 else 0,
            ring_bytes=ring,
            cache_bytes=cache_bytes(cfg, rows, length, act) if r == 0 else 0,
            temp_bytes=t,
            temp_measured=measured,
            temp_stage=st,
            ring_slots=2 if moe_layers else 0,
            slot_bytes=costs.slot_bytes(cfg, el),
            kv_rows=rows,
            max_len=length,
            rank=r,
            ranks=ranks,
            detail=detail,
        )

    return max((budget(r) for r in range(ranks)), key=lambda b: b.acc_peak_bytes)


def gpu_mem_fraction(budget: MemoryBudget, system: SystemSpec, headroom: float = 0.05) -> float:
    """XLA_PYTHON_CLIENT_MEM_FRACTION for a plan: its peak plus `headroom` of the card,
    rounded up to 0.01, at least JAX's default 0.75 and at most what the reserve leaves.
    JAX reads it once, when its GPU backend initialises: set it in the environment before
    the first jax call (hmoe generate does, from the plan of its --schedule)."""
    need = math.ceil((budget.acc_peak_bytes / system.acc_mem_bytes + headroom) * 100) / 100
    cap = math.floor((system.acc_mem_bytes - RESERVE_BYTES) / system.acc_mem_bytes * 100) / 100
    return min(cap, max(0.75, need))
