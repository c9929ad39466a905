"""`auto`: the paper's policy. Decode steps and prompts shorter than
system.auto_slp_min_tokens (4096 by default) use `cpu`; longer prompts use `dslp` when at
least two accelerators are available (and the schedule is registered), else `slp`.

Options: those of cpu, slp and dslp; each goes to the chosen schedule when that schedule
knows it (ring_slots reaches slp, and is not an error when auto picks cpu)."""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.memory import MemoryBudget
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.base import Schedule
from hmoe_jax.schedules.cpu import CpuSchedule
from hmoe_jax.schedules.dslp import DslpSchedule
from hmoe_jax.schedules.slp import SlpSchedule


class AutoSchedule(Schedule):
    name = "auto"
    max_devices = None
    known_options = CpuSchedule.known_options | SlpSchedule.known_options | DslpSchedule.known_options

    def choose(self, system: SystemSpec, num_tokens: int, devices: int, start_pos: int = 0) -> str:
        from hmoe_jax.schedules.registry import SCHEDULES

        if start_pos > 0 or num_tokens < system.auto_slp_min_tokens:
            return "cpu"
        if devices >= 2 and "dslp" in SCHEDULES and num_tokens >= system.auto_dslp_min_tokens:
            return "dslp"
        return "slp"

    def inner(self, system: SystemSpec, num_tokens: int, devices: int, start_pos: int = 0) -> Schedule:
        """The schedule auto picks, with the options it knows."""
        from hmoe_jax.schedules.registry import schedule_class

        cls = schedule_class(self.choose(system, num_tokens, devices, start_pos))
        return cls(**{k: v for k, v in self.options.items() if k in cls.known_options})

    def budget(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> MemoryBudget | None:
        inner = self.inner(system, num_tokens, devices, start_pos)
        return inner.budget(cfg, system, num_tokens, devices=inner.uses_devices(devices), start_pos=start_pos)

    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        inner = self.inner(system, num_tokens, devices, start_pos)
        p = inner.plan(cfg, system, num_tokens, devices=inner.uses_devices(devices), start_pos=start_pos)
        return Plan(p.schedule, p.num_tokens, p.ops, {**p.meta, "chosen_by": "auto"})
