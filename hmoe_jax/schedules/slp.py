"""`slp`: stream-loading prefill (PAPER.md technique 1).

Everything runs on the accelerator. Non-expert weights stay resident there; each MoE
layer's routed experts (FP8 as stored) stream host -> accelerator through a ring of R
slots, `experts_per_slot` experts per slot. Three workers run concurrently: the loader
(resource h2d:0) fills slot g % R with expert group g as soon as the unloader released it,
the compute worker (acc:0) runs the grouped GEMM of group g once it is loaded, and the
unloader (unload:0) releases the slot when that GEMM is done. Group numbering runs across
layers, so the loader streams layer i+1's experts while layer i computes.

Ring size policy: per MoE layer, copy time = expert bytes / h2d rate, compute time = layer
FLOPs / accelerator rate. Transfer-bound (copy >= compute): R = one full layer of groups,
so the loader never waits for the compute worker; compute-bound: R = 2 (ping-pong), which
is all the overlap that is needed and leaves memory for activations. Option ring_slots
overrides.
"""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Plan, PlanBuilder
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import Schedule, ScheduleError
from hmoe_jax.schedules.cpu import add_attention


def layer_times_s(cfg: ModelConfig, system: SystemSpec, num_tokens: int) -> tuple[float, float]:
    """(copy_s, compute_s) of one MoE layer under SLP: the cost estimate of the ring policy."""
    copy_s = cfg.n_routed_experts * costs.expert_bytes(cfg) / (system.h2d_gbps * 1e9)
    flops = (
        costs.attn_flops(cfg, num_tokens)
        + costs.router_flops(cfg, num_tokens)
        + costs.shared_flops(cfg, num_tokens)
        + costs.expert_flops(cfg, num_tokens * cfg.num_experts_per_tok)
    )
    return copy_s, flops / (system.acc_tflops * 1e12)


def ring_policy(
    cfg: ModelConfig, system: SystemSpec, num_tokens: int, groups_per_layer: int
) -> tuple[int, str]:
    copy_s, compute_s = layer_times_s(cfg, system, num_tokens)
    if copy_s >= compute_s:
        return groups_per_layer, "transfer-bound"
    return min(2, groups_per_layer), "compute-bound"


class SlpSchedule(Schedule):
    """Options: ring_slots (override the policy), experts_per_slot (default
    system.slp_experts_per_slot), all_logits (False: lm_head on the last token only)."""

    name = "slp"

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        self.check_devices(self.uses_devices(devices))
        per_slot = int(self.options.get("experts_per_slot", system.slp_experts_per_slot))
        if not 1 <= per_slot <= cfg.n_routed_experts:
            raise ScheduleError(
                f"slp: experts_per_slot={per_slot} must be in [1, n_routed_experts={cfg.n_routed_experts}]"
            )
        all_logits = bool(self.options.get("all_logits", False))
        e_total = cfg.n_routed_experts
        groups = [(lo, min(lo + per_slot, e_total)) for lo in range(0, e_total, per_slot)]
        ring, bound = ring_policy(cfg, system, num_tokens, len(groups))
        if "ring_slots" in self.options:
            ring = int(self.options["ring_slots"])
            if ring < 1:
                raise ScheduleError(f"slp: ring_slots={ring} must be >= 1")
        n, k = num_tokens, cfg.num_experts_per_tok
        b = PlanBuilder(self.name, num_tokens)
        unloads: list[int] = []  # by global group number
        h = b.add("embed", "acc:0", tokens=[0, n])
        for layer in range(cfg.num_hidden_layers):
            h = add_attention(b, cfg, layer, 0, n, start_pos, h)
            if not cfg.is_moe_layer(layer):
                h = b.add(
                    "dense_ffn",
                    "acc:0",
                    layer=layer,
                    flops=costs.dense_ffn_flops(cfg, n),
                    deps=[h],
                    tokens=[0, n],
                )
                continue
            r = b.add(
                "route", "acc:0", layer=layer, flops=costs.router_flops(cfg, n), deps=[h], tokens=[0, n]
            )
            s = (
                b.add(
                    "shared", "acc:0", layer=layer, flops=costs.shared_flops(cfg, n), deps=[r], tokens=[0, n]
                )
                if cfg.n_shared_experts
                else None
            )
            prev = r
            for lo, hi in groups:
                g = len(unloads)
                slot = g % ring
                free = unloads[g - ring] if g >= ring else None
                ld = b.add(
                    "load",
                    "h2d:0",
                    layer=layer,
                    bytes=(hi - lo) * costs.expert_bytes(cfg),
                    deps=[free],
                    slot=slot,
                    experts=[lo, hi],
                )
                # Expected rows: tokens * k spread evenly over experts (the plan's estimate;
                # the executor computes the actual routing).
                rows = n * k * (hi - lo) // e_total
                prev = b.add(
                    "experts_acc",
                    "acc:0",
                    layer=layer,
                    flops=costs.expert_flops(cfg, rows),
                    bytes=(hi - lo) * costs.expert_bytes(cfg),
                    deps=[ld, prev],
                    slot=slot,
                    experts=[lo, hi],
                    tokens=[0, n],
                )
                unloads.append(b.add("unload", "unload:0", layer=layer, deps=[prev], slot=slot))
            h = b.add("combine", "acc:0", layer=layer, deps=[h, prev, s], tokens=[0, n])
        b.add(
            "final",
            "acc:0",
            flops=costs.lm_head_flops(cfg, n if all_logits else 1),
            deps=[h],
            tokens=[0, n],
            rows="all" if all_logits else "last",
        )
        copy_s, compute_s = layer_times_s(cfg, system, num_tokens)
        return b.build(
            devices=1,
            start_pos=start_pos,
            ring_slots=ring,
            experts_per_slot=per_slot,
            slot_bytes=costs.slot_bytes(cfg, per_slot),
            bound=bound,
            est_layer_copy_s=copy_s,
            est_layer_compute_s=compute_s,
            all_logits=all_logits,
        )
