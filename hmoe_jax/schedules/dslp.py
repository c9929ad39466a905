"""`dslp`: distributed stream-loading prefill over N accelerators (PAPER.md technique 2).

Per layer: each rank r streams ITS share of the layer's routed experts ([r E/N, (r+1) E/N),
FP8 as stored) through a slot of the staging ring (loader track h2d:r) plus the layer's
non-expert weights (rank 0 reuses the engine's resident ones and holds one layer of experts
at a time); attention runs by context parallelism over the zig-zag split of the
sequence (only the latent cache is all-gathered); the MoE by SmallEP (all-gather the
unsorted hidden states, every rank routes every token, computes its local experts, one
weighted partial per token, reduce-scatter back to the owners); dense layers and shared
experts on the owners. The ring holds two layers of per-rank slots (2N): rank r's load of
layer i+1 overlaps the compute of layer i. Output: last-token (or all) logits and the latent
cache where single-device decode expects it.

Options: all_logits (False), staging ("ring": C++ staging ring, the default; "direct":
jax.device_put from the host copy), ep_capacity (ep only: pair slots per rank pair; None =
no drop possible), acc_experts ("grouped": grouped GEMMs, the default; "ref":
experts_ref, every local expert on every token), precision ("bf16", the default, or "f32":
the policy the plan is priced and budgeted for; the executor runs the engine's own policy).
Prefill from position 0 only (chunked continuation uses `cpu`).
Memory budget (plan/memory.py, checked by plan()): kv_rows, max_len, piece_temps.

The plan is data for the simulator: each dslp_load's bytes is what crosses rank r's
host link; each compute op's flops are PER RANK (all ranks run it in lock-step), and its
args.comm gives the bytes its collectives move between ranks (CommVolume.as_dict(); the EP
figure is the balanced-routing expectation, the executor records the actual one) in the
policy's activation / cache dtype (2 bytes under bf16). meta.compute_dtype is the policy's
GEMM dtype (bf16) and each compute op's args.fp8_flops is the part of its flops an FP8
model runs as FP8-weight GEMMs (attention projections and kv_b, shared experts, routed
experts, dense FFNs; sim/pricing.py prices it at the FP8 rate). dslp_attn carries the
walk's block and head_groups (plan.costs.cp_block / cp_head_groups), which the executor
passes to parallel/attention.py.
"""

from __future__ import annotations

from typing import ClassVar

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs, memory
from hmoe_jax.plan.dist import ZigzagLayout, cp_attention_comm, ep_comm_expected, smallep_comm
from hmoe_jax.plan.format import Plan, PlanBuilder
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import COMMON_OPTIONS, Schedule, ScheduleError

ACC = "acc:all"  # collective ops: every rank in lock-step


class DslpSchedule(Schedule):
    name = "dslp"
    moe_scheme: ClassVar[str] = "smallep"
    min_devices = 1
    max_devices = None
    known_options = COMMON_OPTIONS | {"staging", "ep_capacity", "acc_experts", "precision"}

    def _precision(self) -> str:
        precision = str(self.options.get("precision", "bf16"))
        if precision not in costs.POLICY_GEMM_DTYPE:
            raise ScheduleError(
                f"{self.name}: precision={precision!r}, expected one of {sorted(costs.POLICY_GEMM_DTYPE)}"
            )
        return precision

    def budget(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> memory.MemoryBudget:
        """Per rank (the rank with the highest peak): plan/memory.py dslp_budget. Options
        kv_rows (1) / max_len (num_tokens) size the KV pool on rank 0; piece_temps replace
        the per-rank estimates (attention, moe, dense_ffn, final)."""
        n = self.uses_devices(devices)
        try:
            return memory.dslp_budget(
                cfg,
                system,
                num_tokens,
                ranks=n,
                padded_tokens=ZigzagLayout.for_sequence(num_tokens, n).padded_len,
                kv_rows=self.options.get("kv_rows"),
                max_len=self.options.get("max_len"),
                piece_temps=self.options.get("piece_temps"),
                schedule=self.name,
                precision=self._precision(),
            )
        except ValueError as e:
            raise ScheduleError(f"{self.name}: {e}") from None

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        n = self.uses_devices(devices)
        self.check_devices(n)
        if start_pos != 0:
            raise ScheduleError(f"{self.name}: prefills from position 0 only, got start_pos={start_pos}")
        if cfg.n_routed_experts % n:
            raise ScheduleError(
                f"{self.name}: n_routed_experts={cfg.n_routed_experts} is not divisible by devices={n}"
            )
        staging = str(self.options.get("staging", "ring"))
        if staging not in ("ring", "direct"):
            raise ScheduleError(f"{self.name}: staging={staging!r}, expected 'ring' or 'direct'")
        all_logits = bool(self.options.get("all_logits", False))
        capacity = self.options.get("ep_capacity")
        acc_experts = str(self.options.get("acc_experts", "grouped"))
        if acc_experts not in ("grouped", "ref"):
            raise ScheduleError(f"{self.name}: acc_experts={acc_experts!r}, expected 'grouped' or 'ref'")
        budget = self.budget(cfg, system, num_tokens, devices=n)
        if not budget.fits:
            raise ScheduleError(f"{self.name}: {budget.message}")
        precision = self._precision()
        act_bytes = 4 if precision == "f32" else 2  # activations, payloads and the cache
        fp8 = cfg.quant is not None and precision != "f32"  # FP8 weights through FP8 GEMMs
        layout = ZigzagLayout.for_sequence(num_tokens, n)
        t_pad, k, el = layout.padded_len, cfg.num_experts_per_tok, cfg.n_routed_experts // n
        per_rank_tokens = t_pad // n
        block = costs.cp_block(layout.chunk)
        head_groups = costs.cp_head_groups(cfg, t_pad, act_bytes)
        b = PlanBuilder(self.name, num_tokens)
        h = embed = b.add(
            "dslp_embed",
            ACC,
            ranks=n,
            scheme=self.moe_scheme,
            ep_capacity=capacity,
            acc_experts=acc_experts,
            tokens=[0, num_tokens],
        )
        slot_free: dict[int, int] = {}  # slot -> the unload that last freed it
        rank0_free = None  # rank 0's unload of the previous MoE layer
        moe_layers = 0
        for layer in range(cfg.num_hidden_layers):
            moe = cfg.is_moe_layer(layer)
            loads = []
            for r in range(n):
                slot = (moe_layers % 2) * n + r if (moe and staging == "ring") else -1
                # Rank 0 is the engine's decode accelerator: the layer's non-expert weights are
                # resident there (reused, not streamed), and it holds ONE layer of experts at
                # a time (its copy of layer i+1 waits for layer i's MoE and overlaps layer
                # i+1's attention); the other ranks stream everything, two layers in flight.
                rest = "resident" if r == 0 else "stream"
                deps = [embed, slot_free.get(slot)]  # embed creates the run state the loaders use
                if r == 0 and moe:
                    deps.append(rank0_free)
                loads.append(
                    b.add(
                        "dslp_load",
                        f"h2d:{r}",
                        layer=layer,
                        bytes=(costs.layer_rest_bytes(cfg, layer) if rest == "stream" else 0)
                        + (el * costs.expert_bytes(cfg) if moe else 0),
                        deps=deps,
                        rank=r,
                        slot=slot,
                        rest=rest,
                        experts=[r * el, (r + 1) * el] if moe else None,
                    )
                )
            # Per rank: projections of its T/N tokens + its 2N+1 chunk pairs of causal attention.
            # It needs the non-expert weights only: not rank 0's expert copy of an MoE layer.
            h = b.add(
                "dslp_attn",
                ACC,
                layer=layer,
                flops=costs.cp_attn_flops(cfg, t_pad, n, block=block),
                fp8_flops=costs.cp_attn_fp8_flops(cfg, t_pad, n, block=block) if fp8 else 0,
                deps=[h, *(loads[1:] if moe else loads)],
                comm=cp_attention_comm(n, t_pad, cfg.cache_dim, act_bytes).as_dict(),
                block=block,
                head_groups=head_groups,
            )
            if not moe:
                ffn_flops = costs.dense_ffn_flops(cfg, per_rank_tokens)
                h = b.add(
                    "dslp_ffn",
                    ACC,
                    layer=layer,
                    flops=ffn_flops,
                    fp8_flops=ffn_flops if fp8 else 0,
                    deps=[h],
                )
                continue
            comm = (
                smallep_comm(n, t_pad, cfg.hidden_size, act_bytes)
                if self.moe_scheme == "smallep"
                else ep_comm_expected(n, t_pad, cfg.hidden_size, k, act_bytes)
            )
            # SmallEP routes all T tokens on every rank; EP only its own. Experts: T k / N rows per rank.
            route_tokens = t_pad if self.moe_scheme == "smallep" else per_rank_tokens
            # routed + shared experts are FP8-weight GEMMs; the router is an f32 dot
            weight_flops = costs.expert_flops(cfg, t_pad * k // n) + costs.shared_flops(cfg, per_rank_tokens)
            h = b.add(
                "dslp_moe",
                ACC,
                layer=layer,
                flops=costs.router_flops(cfg, route_tokens) + weight_flops,
                fp8_flops=weight_flops if fp8 else 0,
                bytes=el * costs.expert_bytes(cfg),
                deps=[h, loads[0]],
                scheme=self.moe_scheme,
                comm=comm.as_dict(),
            )
            for r in range(n):
                slot = loads[r]
                s = b.ops[slot].args["slot"]
                u = b.add("dslp_unload", f"unload:{r}", layer=layer, deps=[h], slot=s, rank=r)
                if s >= 0:
                    slot_free[s] = u
                if r == 0:
                    rank0_free = u
            moe_layers += 1
        b.add(
            "dslp_final",
            ACC,
            flops=costs.lm_head_flops(cfg, num_tokens if all_logits else 1),
            deps=[h],
            rows="all" if all_logits else "last",
        )
        meta = dict(
            devices=n,
            start_pos=0,
            compute_dtype=costs.POLICY_GEMM_DTYPE[precision],
            precision=precision,
            attn_block=block,
            attn_head_groups=head_groups,
            memory=budget.meta(),
            moe_scheme=self.moe_scheme,
            staging=staging,
            acc_experts=acc_experts,
            padded_tokens=t_pad,
            experts_per_rank=el,
            all_logits=all_logits,
            smallep_beats_ep=n <= k,
        )
        if staging == "ring" and moe_layers:
            meta.update(ring_slots=2 * n, slot_bytes=costs.slot_bytes(cfg, el))
        return b.build(**meta)
