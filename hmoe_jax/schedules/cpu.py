"""`cpu`: the paper's decode placement, also used for short (chunked) prefill.

Attention (MLA + latent cache), dense layers, shared experts, embeddings and lm_head run on
the accelerator; routed experts run on the host CPU (ExpertFn with M = chunk tokens); per
MoE layer the normed hidden states hop accelerator -> host and the expert output hops back.
The shared expert has no dependency on the hop, so it runs on the accelerator while the
host computes the routed experts.
"""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs, memory
from hmoe_jax.plan.format import Plan, PlanBuilder
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import COMMON_OPTIONS, Schedule, ScheduleError


def touched_experts(cfg: ModelConfig, tokens: int) -> int:
    """Upper bound of distinct experts `tokens` tokens route to (weights the CPU reads)."""
    return min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)


def chunks(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(t, min(t + chunk, num_tokens)) for t in range(0, num_tokens, chunk)]


def add_attention(
    b: PlanBuilder,
    cfg: ModelConfig,
    layer: int,
    t0: int,
    t1: int,
    start_pos: int,
    dep: int,
    acc: str = "acc:0",
    *,
    rows: int = 1,
    cache_slots: int | None = None,
    attn: dict | None = None,
    fp8: bool = False,
) -> int:
    """An attention op priced as model/attention.py runs it (form, blocks, the pool row's
    cache_slots; attn: the engine's form / q_block / k_block options; fp8: FP8 weights run
    as FP8 GEMMs, costs.fp8_gemms)."""
    kw = dict(rows=rows, cache_len=cache_slots, **attn_kw(attn))
    return b.add(
        "attn",
        acc,
        layer=layer,
        flops=costs.attn_flops(cfg, t1 - t0, start_pos + t0, **kw),
        deps=[dep],
        tokens=[t0, t1],
        form=costs.attn_form(attn_kw(attn).get("form", "auto"), t1 - t0),
        **fp8_args(fp8, costs.attn_fp8_flops(cfg, t1 - t0, start_pos + t0, **kw) if fp8 else 0),
    )


def fp8_args(fp8: bool, fp8_flops: int) -> dict:
    """An accelerator op's args.fp8_flops (sim/pricing.py) when FP8 GEMMs run, else none
    (plans of the f32 policy or of unquantised models stay as they were)."""
    return {"fp8_flops": int(fp8_flops)} if fp8 else {}


def shared_fp8_flops(cfg: ModelConfig, tokens: int) -> int:
    """The shared expert(s)' FLOPs that run as FP8 GEMMs (one SwiGLU of intermediate
    moe_intermediate_size x n_shared_experts)."""
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    return costs.ffn_fp8_flops(cfg, costs.shared_flops(cfg, tokens), inter)


def attn_kw(attn: dict | None) -> dict:
    """The attention options that change what runs (and so its FLOPs)."""
    return {k: v for k, v in (attn or {}).items() if k in ("form", "q_block", "k_block")}


class CpuSchedule(Schedule):
    """Options: chunk_tokens (default system.cpu_prefill_chunk_tokens), all_logits (False:
    lm_head on the last token only), fused (True: a MoE layer's attention + gating are one
    `attn_route` op whose hop is one packed transfer; False: separate attn / route ops),
    fuse_shared_tokens (16: chunks of at most this many tokens, i.e. decode, also compute the
    shared expert inside attn_route; longer chunks keep it a separate op that overlaps the
    host's routed experts); for the memory budget (plan/memory.py): kv_rows (batch) and
    max_len (start_pos + num_tokens) of the KV pool, precision ("bf16"), attn (the engine's
    prefill attention options), piece_temps (measured piece temporaries)."""

    name = "cpu"
    known_options = COMMON_OPTIONS | {
        "chunk_tokens",
        "fused",
        "fuse_shared_tokens",
        "batch",
        "precision",
        "attn",
    }

    def budget(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> memory.MemoryBudget:
        try:
            return memory.cpu_budget(
                cfg,
                system,
                num_tokens,
                chunk_tokens=int(self.options.get("chunk_tokens", system.cpu_prefill_chunk_tokens)),
                batch=int(self.options.get("batch", 1)),
                start_pos=start_pos,
                kv_rows=self.options.get("kv_rows"),
                max_len=self.options.get("max_len"),
                precision=str(self.options.get("precision", "bf16")),
                piece_temps=self.options.get("piece_temps"),
                attn=self.options.get("attn"),
            )
        except ValueError as e:
            raise ScheduleError(f"cpu: {e}") from None

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        self.check_devices(self.uses_devices(devices))
        chunk = int(self.options.get("chunk_tokens", system.cpu_prefill_chunk_tokens))
        all_logits = bool(self.options.get("all_logits", False))
        fused = bool(self.options.get("fused", True))
        fuse_shared_tokens = int(self.options.get("fuse_shared_tokens", 16))
        # batch: rows decoded together (num_tokens == 1 each); costs count batch * n tokens.
        batch = int(self.options.get("batch", 1))
        if batch < 1 or (batch > 1 and num_tokens != 1):
            raise ScheduleError(
                f"cpu: batch={batch} needs num_tokens == 1 (batched decode), got {num_tokens}"
            )
        budget = self.budget(cfg, system, num_tokens, devices=devices, start_pos=start_pos)
        if not budget.fits:
            raise ScheduleError(f"cpu: {budget.message}")
        attn = self.options.get("attn")
        precision = str(self.options.get("precision", "bf16"))
        fp8 = costs.fp8_gemms(cfg, precision)
        b = PlanBuilder(self.name, num_tokens)
        k = cfg.num_experts_per_tok
        prev_chunk_last = None
        spans = chunks(num_tokens, chunk)
        for ci, (t0, t1) in enumerate(spans):
            n = (t1 - t0) * batch  # token rows this chunk moves through each layer
            # A chunk's attention at layer l reads the cache the previous chunk wrote at l:
            # serialising chunks through h keeps that order (one accelerator stream).
            h = b.add("embed", "acc:0", deps=[prev_chunk_last], tokens=[t0, t1])
            for layer in range(cfg.num_hidden_layers):
                with_shared = fused and bool(cfg.n_shared_experts) and n <= fuse_shared_tokens
                if cfg.is_moe_layer(layer) and fused:
                    # one computation and one hop per layer: what decode needs most
                    kw = dict(rows=batch, cache_len=budget.max_len, **attn_kw(attn))
                    flops = costs.attn_flops(cfg, t1 - t0, start_pos + t0, **kw)
                    flops += costs.router_flops(cfg, n)
                    f8 = costs.attn_fp8_flops(cfg, t1 - t0, start_pos + t0, **kw) if fp8 else 0
                    r = h = b.add(
                        "attn_route",
                        "acc:0",
                        layer=layer,
                        flops=flops + (costs.shared_flops(cfg, n) if with_shared else 0),
                        deps=[h],
                        tokens=[t0, t1],
                        form=costs.attn_form(attn_kw(attn).get("form", "auto"), t1 - t0),
                        with_shared=with_shared,
                        **fp8_args(fp8, f8 + (shared_fp8_flops(cfg, n) if with_shared else 0)),
                    )
                else:
                    h = add_attention(
                        b,
                        cfg,
                        layer,
                        t0,
                        t1,
                        start_pos,
                        h,
                        rows=batch,
                        cache_slots=budget.max_len,
                        attn=attn,
                        fp8=fp8,
                    )
                    if not cfg.is_moe_layer(layer):
                        ffn = costs.dense_ffn_flops(cfg, n)
                        h = b.add(
                            "dense_ffn",
                            "acc:0",
                            layer=layer,
                            flops=ffn,
                            deps=[h],
                            tokens=[t0, t1],
                            **fp8_args(fp8, costs.ffn_fp8_flops(cfg, ffn, cfg.intermediate_size)),
                        )
                        continue
                    r = b.add(
                        "route",
                        "acc:0",
                        layer=layer,
                        flops=costs.router_flops(cfg, n),
                        deps=[h],
                        tokens=[t0, t1],
                    )
                # the hop moves x in the policy's activation dtype + ids + weights (pack_hop)
                hop = costs.hidden_bytes(cfg, n, precision) + costs.route_bytes(cfg, n)
                d = b.add("d2h", "d2h:0", layer=layer, bytes=hop, deps=[r], tokens=[t0, t1])
                s = (
                    b.add(
                        "shared",
                        "acc:0",
                        layer=layer,
                        flops=costs.shared_flops(cfg, n),
                        deps=[r],
                        tokens=[t0, t1],
                        **fp8_args(fp8, shared_fp8_flops(cfg, n)),
                    )
                    if cfg.n_shared_experts and not with_shared
                    else None
                )
                e = b.add(
                    "experts_cpu",
                    "cpu_experts",
                    layer=layer,
                    flops=costs.expert_flops(cfg, n * k),
                    bytes=touched_experts(cfg, n) * costs.expert_bytes(cfg),
                    deps=[d],
                    tokens=[t0, t1],
                )
                u = b.add(
                    "h2d",
                    "h2d:0",
                    layer=layer,
                    bytes=costs.hidden_bytes(cfg, n, precision),
                    deps=[e],
                    tokens=[t0, t1],
                )
                h = b.add("combine", "acc:0", layer=layer, deps=[h, u, s], tokens=[t0, t1])
            last = ci == len(spans) - 1
            if all_logits or last:
                rows = n if all_logits else batch
                h = b.add(
                    "final",
                    "acc:0",
                    flops=costs.lm_head_flops(cfg, rows),
                    deps=[h],
                    tokens=[t0, t1],
                    rows="all" if all_logits else "last",
                )
            prev_chunk_last = h
        return b.build(
            devices=1,
            start_pos=start_pos,
            compute_dtype=costs.POLICY_GEMM_DTYPE[precision],
            fp8_gemms=fp8,
            memory=budget.meta(),
            chunk_tokens=chunk,
            all_logits=all_logits,
            fused=fused,
            batch=batch,
        )
