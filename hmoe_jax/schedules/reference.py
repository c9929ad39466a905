"""`reference`: the plain model forward (hmoe_jax.model.model.forward with experts_ref) as a
single op on the first accelerator. The yardstick the other schedules are compared with."""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Plan, PlanBuilder
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import Schedule


def forward_flops(cfg: ModelConfig, tokens: int, start_pos: int = 0) -> int:
    k = cfg.num_experts_per_tok
    total = costs.lm_head_flops(cfg, tokens)
    for layer in range(cfg.num_hidden_layers):
        total += costs.attn_flops(cfg, tokens, start_pos)
        if cfg.is_moe_layer(layer):
            total += costs.router_flops(cfg, tokens) + costs.shared_flops(cfg, tokens)
            total += costs.expert_flops(cfg, tokens * k)
        else:
            total += costs.dense_ffn_flops(cfg, tokens)
    return total


class ReferenceSchedule(Schedule):
    """Options: the common ones only (schedules/base.py). Its forward returns every
    position's logits, so all_logits changes nothing; it checks no memory budget."""

    name = "reference"

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        self.check_devices(self.uses_devices(devices))
        b = PlanBuilder(self.name, num_tokens)
        b.add("forward", "acc:0", flops=forward_flops(cfg, num_tokens, start_pos), start_pos=start_pos)
        return b.build(devices=1, start_pos=start_pos)
