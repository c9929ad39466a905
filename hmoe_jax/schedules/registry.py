"""Every schedule, one line each ("name": "module:Class", imported on first use so a
schedule's dependencies load only when it is asked for). The invariant test
(tests/test_schedules_invariant.py) runs every name listed here."""

from __future__ import annotations

import importlib

from hmoe_jax.schedules.base import Schedule, ScheduleError

SCHEDULES: dict[str, str] = {
    "reference": "hmoe_jax.schedules.reference:ReferenceSchedule",
    "cpu": "hmoe_jax.schedules.cpu:CpuSchedule",
    "slp": "hmoe_jax.schedules.slp:SlpSchedule",
    "auto": "hmoe_jax.schedules.auto:AutoSchedule",
    "dslp": "hmoe_jax.schedules.dslp:DslpSchedule",
    "ep": "hmoe_jax.schedules.ep:EpSchedule",
}


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def schedule_class(name: str) -> type[Schedule]:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; registered: {sorted(SCHEDULES)}")
    mod, cls = SCHEDULES[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def get_schedule(name: str, **options: object) -> Schedule:
    return schedule_class(name)(**options)
