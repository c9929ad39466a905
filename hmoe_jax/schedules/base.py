"""The Schedule interface: a small host-side object that turns (cfg, system, num_tokens)
into a Plan (plan/format.py). It touches no arrays; the executor in runtime/ runs the plan
against real params. A new schedule is one file plus one line in schedules/registry.py.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.memory import MemoryBudget
from hmoe_jax.plan.system import SystemSpec


class ScheduleError(ValueError):
    pass


# Options every schedule takes: all_logits (logits of every prompt position, not only the
# last; the engine always passes it) and the memory-budget inputs (plan/memory.py) that
# callers such as `hmoe plan` and the simulator pass without knowing which schedule runs:
# kv_rows / max_len (the KV pool the plan runs against), piece_temps (measured piece
# temporaries, measure/compile_probe.py). A schedule without a budget (reference) has
# nothing to size with them.
COMMON_OPTIONS = frozenset({"all_logits", "kv_rows", "max_len", "piece_temps"})


class Schedule(abc.ABC):
    name: ClassVar[str]
    # Accelerators the schedule can use: it runs on devices[:n] for n in [min, max]
    # (max None: any number). Single-accelerator schedules have min = max = 1.
    min_devices: ClassVar[int] = 1
    max_devices: ClassVar[int | None] = 1
    # Every option the schedule reads (its class docstring says what each does).
    known_options: ClassVar[frozenset[str]] = COMMON_OPTIONS

    def __init__(self, **options: object):
        """Options are schedule-specific keyword overrides (e.g. slp ring_slots=2). An
        option the schedule does not know is an error (a misspelled one would otherwise be
        ignored without a word), as for policies."""
        unknown = sorted(set(options) - self.known_options)
        if unknown:
            raise ScheduleError(
                f"schedule {self.name!r}: unknown option(s) {unknown}; known: {sorted(self.known_options)}"
            )
        self.options = dict(options)

    @abc.abstractmethod
    def plan(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> Plan:
        """Ops for a forward over `num_tokens` new tokens at cache position `start_pos`
        (prefill when start_pos == 0 and num_tokens > 1) on `devices` accelerators."""

    def budget(
        self, cfg: ModelConfig, system: SystemSpec, num_tokens: int, *, devices: int = 1, start_pos: int = 0
    ) -> MemoryBudget | None:
        """The accelerator memory the plan needs (plan/memory.py), without building it; None
        for schedules that do not check memory (reference). plan() raises ScheduleError with
        budget.message when it does not fit."""
        return None

    def check_devices(self, devices: int) -> None:
        hi = self.max_devices
        if devices < self.min_devices or (hi is not None and devices > hi):
            want = f"{self.min_devices}..{hi if hi is not None else 'any'}"
            raise ScheduleError(f"schedule {self.name!r} runs on {want} accelerators, got devices={devices}")

    def uses_devices(self, devices: int) -> int:
        """How many of `devices` available accelerators this schedule uses."""
        hi = self.max_devices if self.max_devices is not None else devices
        return max(self.min_devices, min(devices, hi))
