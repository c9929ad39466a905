"""Every request-scheduling policy, one line each ("name": "module:Class"). The invariant
test (tests/test_serve_policies.py) runs every name listed here."""

from __future__ import annotations

import importlib
from typing import Any

from hmoe_jax.policies.base import Policy, PolicyError

POLICIES: dict[str, str] = {
    "paper": "hmoe_jax.policies.paper:PaperPolicy",
    "dual": "hmoe_jax.policies.paper:DualBatchPolicy",
    "fcfs": "hmoe_jax.policies.fcfs:FcfsPolicy",
}
DEFAULT_POLICY = "paper"


def policy_names() -> list[str]:
    return list(POLICIES)


def get_policy(name: str, **options: Any) -> Policy:
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; registered: {sorted(POLICIES)}")
    mod, cls = POLICIES[name].split(":")
    return getattr(importlib.import_module(mod), cls)(**options)
