"""The accelerator-memory bytes each compute op of a plan reads, from the model config.

Plans (plan/format.py) define an op's `bytes` as what it moves over its resource, "or the
weight bytes a compute op reads", but the schedules fill it only for the ops that stream
experts (experts_acc, dslp_moe's local experts): attention, dense FFN, router, shared expert
and lm_head ops carry bytes = 0. At decode those ops are bound by the accelerator's memory
bandwidth (one DeepSeek-V3 layer's attention weights are ~190 MB), so a simulator that took
bytes = 0 would price them at their FLOPs only. `with_reads` returns the plan with each
compute op's bytes raised to what it reads, as the engine places the weights (plan/memory.py:
FP8 matrices + f32 block scales, norms and router f32, embeddings and lm_head bf16), plus the
latent cache a decode step reads. Activations are not counted (T x D per op: small against
weights at decode, and prefill ops are compute-bound).

What each kind reads:
- attn / dslp_attn: the layer's attention tensors (a bf16 decode reads the absorbed bf16 w_uk /
  w_uv copies instead of kv_b) and the latent cache (decode: rows x decode_kv_len slots;
  a prefill chunk: the cache up to its end, once);
- attn_route: attn + the router (+ the shared expert when args.with_shared);
- route: the router; shared: the shared expert; dense_ffn / dslp_ffn: the dense FFN;
- dslp_moe: the plan's expert bytes + router + shared expert;
- final / dslp_final: final norm + lm_head; embed / dslp_embed: the rows of the table;
- forward (reference): every weight, experts included; combine, experts_acc: as planned.

experts_cpu: the plan counts min(E, rows k) experts (an upper bound: the executor only learns
the real routing when it runs); a simulated op reads the EXPECTED distinct experts of `rows`
independent uniformly routed tokens, E (1 - (1 - k/E)^rows) (B = 4 rows of top-8 of 32: 21.9
of the bound's 32; e22 counted 20 from the bench twin's real routing). With expert_format
"int4" the experts are priced at INT4's bytes (0.5 byte/weight + a bf16 scale per 64).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Op, Plan
from hmoe_jax.plan.memory import absorbed_bytes
from hmoe_jax.plan.tensors import expected_tensors


def placed_bytes(cfg: ModelConfig, name: str, shape: tuple[int, ...], quantized: bool) -> int:
    """A tensor's bytes as the engine places it on the accelerator (= plan.memory's rule)."""
    n = 1
    for s in shape:
        n *= int(s)
    if quantized and cfg.quant is not None:
        q = cfg.quant
        rows, cols = shape
        return n + 4 * (-(-rows // q.block_n)) * (-(-cols // q.block_k))
    table = name in ("model.embed_tokens.weight", "lm_head.weight")
    return n * (2 if table and cfg.quant is not None else 4)


def _role(name: str) -> tuple[int, str]:
    """(layer or -1, role) of a tensor name."""
    if not name.startswith("model.layers."):
        return -1, {"model.embed_tokens.weight": "embed"}.get(name, "final")
    parts = name.split(".")
    layer, rest = int(parts[2]), ".".join(parts[3:])
    if rest.startswith("self_attn.") or rest.endswith("layernorm.weight"):
        return layer, "kv_b" if rest.startswith("self_attn.kv_b_proj.") else "attn"
    if rest.startswith("mlp.experts."):
        return layer, "experts"
    if rest.startswith("mlp.shared_experts."):
        return layer, "shared"
    if rest.startswith("mlp.gate."):
        return layer, "router"
    return layer, "dense"


@functools.lru_cache(maxsize=8)
def weight_bytes_by_role(cfg: ModelConfig) -> dict[tuple[int, str], int]:
    """(layer, role) -> placed bytes; roles attn, kv_b, router, shared, dense, experts,
    embed, final (layer -1 for the last two)."""
    out: dict[tuple[int, str], int] = {}
    for s in expected_tensors(cfg):
        key = _role(s.name)
        out[key] = out.get(key, 0) + placed_bytes(cfg, s.name, s.shape, s.quantized)
    return out


def _cache_value_bytes(plan: Plan) -> int:
    return 4 if str(plan.meta.get("compute_dtype", "bf16")) == "fp32" else 2


def op_read_bytes(cfg: ModelConfig, plan: Plan, op: Op) -> int:
    """Bytes `op` reads from accelerator memory (see the module docstring)."""
    w = weight_bytes_by_role(cfg)
    layer, kind = op.layer, op.kind
    t0, t1 = op.args.get("tokens", (0, plan.num_tokens))
    tokens = int(t1) - int(t0)
    rows = int(plan.meta.get("batch", 1))
    start = int(plan.meta.get("start_pos", 0)) + int(t0)
    value_bytes = _cache_value_bytes(plan)

    def attention() -> int:
        decode = tokens == 1
        kv_b = w.get((layer, "kv_b"), 0)
        if decode and value_bytes == 2:  # the bf16 absorbed copies replace kv_b
            kv_b = absorbed_bytes(cfg, "bf16")
        slots = costs.decode_kv_len(start + 1) * rows if decode else start + tokens
        return w.get((layer, "attn"), 0) + kv_b + slots * cfg.cache_dim * value_bytes

    base = kind.removeprefix("dslp_")
    if base == "attn":
        return attention()
    if kind == "attn_route":
        extra = w.get((layer, "shared"), 0) if op.args.get("with_shared") else 0
        return attention() + w.get((layer, "router"), 0) + extra
    if kind == "route":
        return w.get((layer, "router"), 0)
    if kind == "shared":
        return w.get((layer, "shared"), 0)
    if kind in ("dense_ffn", "dslp_ffn"):
        return w.get((layer, "dense"), 0)
    if kind == "dslp_moe":
        return op.bytes + w.get((layer, "router"), 0) + w.get((layer, "shared"), 0)
    if base == "final":
        return w.get((-1, "final"), 0)
    if base == "embed":
        return max(tokens, 1) * rows * cfg.hidden_size * 2
    if kind == "forward":
        return sum(w.values())
    return op.bytes


INT4_GROUP = 64  # hmoe_jax/quant/int4.py's default group


def expected_experts(cfg: ModelConfig, rows: int) -> float:
    """Expected distinct routed experts `rows` tokens touch under uniform routing."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** max(int(rows), 0))


def int4_expert_bytes(cfg: ModelConfig, group: int = INT4_GROUP) -> int:
    """One routed expert in our INT4 format (gate, up, down): packed nibbles + bf16 scales."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * (d * i // 2 + 2 * d * i // group)


def expert_read_bytes(cfg: ModelConfig, plan: Plan, op: Op, expert_format: str = "fp8") -> int:
    """Bytes an experts_cpu op reads: expected distinct experts x one expert's bytes."""
    t0, t1 = op.args.get("tokens", (0, plan.num_tokens))
    rows = (int(t1) - int(t0)) * int(plan.meta.get("batch", 1))
    one = int4_expert_bytes(cfg) if expert_format == "int4" else costs.expert_bytes(cfg)
    return round(expected_experts(cfg, rows) * one)


READ_KINDS = frozenset(
    {"attn", "attn_route", "route", "shared", "dense_ffn", "final", "embed", "forward"}
    | {"dslp_attn", "dslp_ffn", "dslp_moe", "dslp_final", "dslp_embed"}
)


def with_reads(plan: Plan, cfg: ModelConfig, expert_format: str = "fp8") -> Plan:
    """The plan with every accelerator compute op's bytes raised to what it reads (never
    lowered) and each experts_cpu op's bytes set to its expected reads; meta["sim_reads"]
    records that it was done, meta["expert_format"] which expert format is priced."""
    if expert_format not in ("fp8", "int4"):
        raise ValueError(f"with_reads: expert_format {expert_format!r}, expected 'fp8' or 'int4'")

    def read(op: Op) -> Op:
        if op.kind in READ_KINDS:
            return dataclasses.replace(op, bytes=max(op.bytes, op_read_bytes(cfg, plan, op)))
        if op.kind == "experts_cpu":
            return dataclasses.replace(op, bytes=expert_read_bytes(cfg, plan, op, expert_format))
        return op

    ops = tuple(read(op) for op in plan.ops)
    meta: dict[str, Any] = {**plan.meta, "sim_reads": "hmoe_jax.sim.reads", "expert_format": expert_format}
    return Plan(plan.schedule, plan.num_tokens, ops, meta)
