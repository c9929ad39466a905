"""`slp`: stream-loading prefill (PAPER.md technique 1).

Everything runs on the accelerator. Non-expert weights stay resident there; each MoE
layer's routed experts (FP8 as stored) stream host -> accelerator through a ring of R
slots, `experts_per_slot` experts per slot. Four workers run concurrently: the stager
(resource stage:0) queues the host memcpy of expert group g into host slot g % R as soon as
the unloader released it (the C++ copy threads run the queued copies back to back), the
loader (h2d:0) hands each filled slot to the accelerator, the compute worker (acc:0) runs
the grouped GEMM of group g once it is loaded, and the unloader (unload:0) releases the slot
when that GEMM is done. So the memcpy of group g+1 overlaps the host->device transfer of
group g (double buffering, up to R groups deep), and since group numbering runs across
layers, the loader streams layer i+1's experts while layer i computes. Option
double_buffer=False drops the stage ops: each load then fills, waits and transfers in
sequence (the loader before the double buffering).

Ring size policy (plan/memory.slp_budget): from memory alone. The ring gets the memory the
plan leaves on the accelerator (usable memory minus resident weights, KV cache and the
largest stage's temporaries) less a stated headroom (memory.RING_HEADROOM_FRACTION of the
card), as many slots as that holds, at most one layer of groups and at least 2 (the
ping-pong the pipeline needs). A slot only lets a load start earlier, and layer i+1's copies
overlap layer i's attention only as far as the ring reaches ahead, so a ring cut to 2 by a
compute/transfer guess loses that overlap (the policy before 2026-12-06: DeepSeek-V3 on one
RTX 5090 went from 162 slots at 18K tokens to 2 at 20K, 1,037 -> 767 tok/s simulated). Sized
from memory, a longer prompt gets at most a slightly smaller ring (its cache and temporaries
grow) and a faster link the same plan (tests/test_ring_policy.py). Fewer than 2 slots left: the plan does not fit and plan()
raises ScheduleError naming the numbers. Option ring_slots overrides the size (it must
still fit). The plan's meta still carries an overlap estimate (bound, est_layer_copy_s,
est_layer_compute_s: layer_times_s at the profile's effective rates) for `hmoe plan`; it
sizes nothing.
"""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs, memory
from hmoe_jax.plan.buckets import expected_expert_rows_bucket
from hmoe_jax.plan.format import Plan, PlanBuilder
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import COMMON_OPTIONS, Schedule, ScheduleError
from hmoe_jax.schedules.cpu import add_attention, fp8_args, shared_fp8_flops


def layer_times_s(
    cfg: ModelConfig, system: SystemSpec, num_tokens: int, precision: str = "bf16", start_pos: int = 0
) -> tuple[float, float]:
    """(copy_s, compute_s) of one MoE layer under SLP, the plan's overlap estimate, at the
    effective rates the simulator prices: the link's h2d rate (a measured transfer rate) and,
    x acc_compute_efficiency, the fp8 dense peak for the FLOPs that run as FP8 GEMMs
    (layer_fp8_flops: FP8 weights under the bf16 policy) and the policy's GEMM dtype's for
    the rest (attention scores and P.V, the router)."""
    copy_s = cfg.n_routed_experts * costs.expert_bytes(cfg) / (system.h2d_gbps * 1e9)
    flops, fp8 = layer_flops(cfg, num_tokens, precision, start_pos)
    eff = system.acc_compute_efficiency
    rate = costs.acc_flops_per_s(system, costs.POLICY_GEMM_DTYPE[precision]) * eff
    return copy_s, (flops - fp8) / rate + fp8 / (costs.acc_flops_per_s(system, "fp8") * eff)


def layer_flops(
    cfg: ModelConfig, num_tokens: int, precision: str = "bf16", start_pos: int = 0
) -> tuple[int, int]:
    """(FLOPs, of which FP8 GEMM FLOPs) of one MoE layer's ops in an SLP plan: attention,
    router, shared and routed experts, the same numbers the plan's ops carry."""
    n, fp8 = num_tokens, costs.fp8_gemms(cfg, precision)
    rows = n * cfg.num_experts_per_tok
    experts = costs.expert_flops(cfg, rows)
    flops = costs.attn_flops(cfg, n, start_pos) + costs.router_flops(cfg, n) + costs.shared_flops(cfg, n)
    if not fp8:
        return flops + experts, 0
    f8 = costs.attn_fp8_flops(cfg, n, start_pos) + shared_fp8_flops(cfg, n)
    return flops + experts, f8 + costs.ffn_fp8_flops(cfg, experts, cfg.moe_intermediate_size)


def overlap_bound(copy_s: float, compute_s: float) -> str:
    """What the overlap estimate says binds a layer (reported, not used to size the ring)."""
    return "transfer-bound" if copy_s >= compute_s else "compute-bound"


class SlpSchedule(Schedule):
    """Options: ring_slots (override the policy), experts_per_slot (default
    system.slp_experts_per_slot), all_logits (False: lm_head on the last token only),
    double_buffer (True: a stage op per group queues its memcpy ahead of the load); for the
    memory budget: kv_rows (1) and max_len (start_pos + num_tokens) of the KV pool,
    precision ("bf16"), attn (the engine's prefill attention options), piece_temps
    (measured piece temporaries, measure/compile_probe.py, replacing the estimates)."""

    name = "slp"
    known_options = COMMON_OPTIONS | {"ring_slots", "experts_per_slot", "double_buffer", "precision", "attn"}

    def _groups(self, cfg: ModelConfig, system: SystemSpec) -> tuple[int, list[tuple[int, int]]]:
        per_slot = int(self.options.get("experts_per_slot", system.slp_experts_per_slot))
        if not 1 <= per_slot <= cfg.n_routed_experts:
            raise ScheduleError(
                f"slp: experts_per_slot={per_slot} must be in [1, n_routed_experts={cfg.n_routed_experts}]"
            )
        e = cfg.n_routed_experts
        return per_slot, [(lo, min(lo + per_slot, e)) for lo in range(0, e, per_slot)]

    def budget(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> memory.MemoryBudget:
        per_slot, groups = self._groups(cfg, system)
        precision = str(self.options.get("precision", "bf16"))
        ring = self.options.get("ring_slots")
        if ring is not None and int(ring) < 1:
            raise ScheduleError(f"slp: ring_slots={ring} must be >= 1")
        try:
            return memory.slp_budget(
                cfg,
                system,
                num_tokens,
                groups_per_layer=len(groups),
                experts_per_slot=per_slot,
                start_pos=start_pos,
                kv_rows=self.options.get("kv_rows"),
                max_len=self.options.get("max_len"),
                ring_slots=None if ring is None else int(ring),
                precision=precision,
                piece_temps=self.options.get("piece_temps"),
                attn=self.options.get("attn"),
            )
        except ValueError as e:
            raise ScheduleError(f"slp: {e}") from None

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        self.check_devices(self.uses_devices(devices))
        per_slot, groups = self._groups(cfg, system)
        all_logits = bool(self.options.get("all_logits", False))
        double_buffer = bool(self.options.get("double_buffer", True))
        e_total = cfg.n_routed_experts
        precision = str(self.options.get("precision", "bf16"))
        budget = self.budget(cfg, system, num_tokens, devices=devices, start_pos=start_pos)
        if not budget.fits:
            raise ScheduleError(f"slp: {budget.message}")
        fp8 = costs.fp8_gemms(cfg, precision)  # FP8 weights run as FP8 GEMMs (args.fp8_flops)
        ring = budget.ring_slots
        n, k = num_tokens, cfg.num_experts_per_tok
        b = PlanBuilder(self.name, num_tokens)
        unloads: list[int] = []  # by global group number
        h = b.add("embed", "acc:0", tokens=[0, n])
        for layer in range(cfg.num_hidden_layers):
            attn = self.options.get("attn")
            h = add_attention(
                b, cfg, layer, 0, n, start_pos, h, cache_slots=budget.max_len, attn=attn, fp8=fp8
            )
            if not cfg.is_moe_layer(layer):
                ffn = costs.dense_ffn_flops(cfg, n)
                h = b.add(
                    "dense_ffn",
                    "acc:0",
                    layer=layer,
                    flops=ffn,
                    deps=[h],
                    tokens=[0, n],
                    **fp8_args(fp8, costs.ffn_fp8_flops(cfg, ffn, cfg.intermediate_size)),
                )
                continue
            r = b.add(
                "route", "acc:0", layer=layer, flops=costs.router_flops(cfg, n), deps=[h], tokens=[0, n]
            )
            s = (
                b.add(
                    "shared",
                    "acc:0",
                    layer=layer,
                    flops=costs.shared_flops(cfg, n),
                    deps=[r],
                    tokens=[0, n],
                    **fp8_args(fp8, shared_fp8_flops(cfg, n)),
                )
                if cfg.n_shared_experts
                else None
            )
            prev = r
            for lo, hi in groups:
                g = len(unloads)
                slot = g % ring
                free = unloads[g - ring] if g >= ring else None
                nbytes = (hi - lo) * costs.expert_bytes(cfg)
                st = (
                    b.add(
                        "stage",
                        "stage:0",
                        layer=layer,
                        bytes=nbytes,
                        deps=[free],
                        slot=slot,
                        experts=[lo, hi],
                    )
                    if double_buffer
                    else None
                )
                # The load also waits for `free` itself: on a GPU it overwrites the device-side
                # slot, which the previous group's GEMM reads until its unload.
                ld = b.add(
                    "load",
                    "h2d:0",
                    layer=layer,
                    bytes=nbytes,
                    deps=[st, free],
                    slot=slot,
                    experts=[lo, hi],
                )
                # Expected rows: tokens * k spread evenly over experts (the plan's estimate;
                # the executor computes the actual routing).
                rows = n * k * (hi - lo) // e_total
                ef = costs.expert_flops(cfg, rows)
                # The executor runs the group at a bucketed row count (pieces.row_bucket of its
                # routed rows) and a dense grouped GEMM (XLA:CPU's ragged_dot: the stand-in)
                # computes every expert of the group over all of them: the rows it pays for,
                # in expectation under the same routing (the GPU kernel skips padded tiles).
                dense = (hi - lo) * expected_expert_rows_bucket(n, hi - lo, k, e_total)
                prev = b.add(
                    "experts_acc",
                    "acc:0",
                    layer=layer,
                    flops=ef,
                    **fp8_args(fp8, costs.ffn_fp8_flops(cfg, ef, cfg.moe_intermediate_size)),
                    bytes=(hi - lo) * costs.expert_bytes(cfg),
                    deps=[ld, prev],
                    slot=slot,
                    experts=[lo, hi],
                    tokens=[0, n],
                    rows=rows,
                    dense_rows=round(dense, 3),
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
        copy_s, compute_s = layer_times_s(cfg, system, num_tokens, precision, start_pos)
        bound = overlap_bound(copy_s, compute_s)
        return b.build(
            devices=1,
            compute_dtype=costs.POLICY_GEMM_DTYPE[precision],
            fp8_gemms=fp8,
            memory=budget.meta(),
            start_pos=start_pos,
            ring_slots=ring,
            experts_per_slot=per_slot,
            slot_bytes=costs.slot_bytes(cfg, per_slot),
            bound=bound,
            est_layer_copy_s=copy_s,
            est_layer_compute_s=compute_s,
            all_logits=all_logits,
            double_buffer=double_buffer,
        )
