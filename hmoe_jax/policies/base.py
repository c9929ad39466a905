"""What a policy sees (View) and what it returns (actions), and the base class.

Each scheduler iteration the backend builds a View of its requests, calls
`policy.decide(view)` and runs the returned actions in order:

- Prefill(request, schedule, devices, background): the whole prompt with a prefill schedule
  (slp / dslp / cpu / auto) on the given accelerators (indices). background=True runs it on
  the prefill lane (accelerators other than 0) while the iteration goes on, and the request
  joins decoding when it is done; otherwise the iteration waits for it.
- Chunk(request, end): prefill prompt tokens [prefilled, end) with the cpu schedule on
  accelerator 0, in the same iteration as the decode step (chunked prefill piggybacked on
  decode: short prompts start at once instead of waiting for a whole-prompt prefill).
- Decode(requests, micro_batches, measure): one decode step of these requests; 2 micro-batches
  = the dual-batch attention/MoE overlap (engine/dual.py); measure = time and trace the step
  so the backend records its seconds in View.step_times[(batch, micro_batches)].

Requests are referred to by id; a policy never touches tokens or arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Pending:
    id: int
    prompt_tokens: int
    prefilled: int  # prompt tokens already prefilled by chunks (0: not started)
    submitted_s: float


@dataclasses.dataclass(frozen=True)
class View:
    now_s: float
    devices: int  # accelerators of the backend
    free_rows: int  # KV pool rows free for new requests
    waiting: tuple[Pending, ...]  # not yet decoding, in submission order (FCFS)
    decoding: tuple[int, ...]  # requests decoding, oldest first
    background: tuple[int, ...] = ()  # requests being prefilled on the prefill lane
    last_decode_s: float | None = None  # when a decode step last ran (None: never)
    step_times: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    # (batch size, micro-batches) -> seconds of a measured decode step


@dataclasses.dataclass(frozen=True)
class Prefill:
    request: int
    schedule: str
    devices: tuple[int, ...] = (0,)
    background: bool = False


@dataclasses.dataclass(frozen=True)
class Chunk:
    request: int
    end: int  # prefill up to this prompt position (exclusive)


@dataclasses.dataclass(frozen=True)
class Decode:
    requests: tuple[int, ...]
    micro_batches: int = 1
    measure: bool = False


Action = Prefill | Chunk | Decode


class PolicyError(ValueError):
    pass


class Policy:
    """Subclasses set `name`, `defaults` (every option with its default), `emits` and
    decide(). `emits`: what its actions may need of a runner (policies/core.action_kinds:
    prefill, chunk, decode, multi_device_prefill, dual_batch, measure), so a runner that
    cannot run some of them (the P/D workers) refuses the policy up front."""

    name = "base"
    defaults: dict[str, Any] = {}
    emits: frozenset[str] = frozenset(
        {"prefill", "chunk", "decode", "multi_device_prefill", "dual_batch", "measure"}
    )

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise PolicyError(
                f"policy {self.name!r}: unknown option(s) {unknown}; known: {sorted(self.defaults)}"
            )
        self.options = {**self.defaults, **options}

    def decide(self, view: View) -> tuple[Action, ...]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, **self.options}


def overlap_bound(a_s: float, m_s: float) -> float:
    """The most two overlapped micro-batches can gain over running them one after the
    other: (A + M) / max(A, M)."""
    return (a_s + m_s) / max(a_s, m_s, 1e-12)


def dual_gain_estimate(half: tuple[float, float], full: tuple[float, float]) -> float:
    """Estimated plain / dual step-time ratio for one batch, from per-layer (A, M) at half
    and full batch size: plain runs A_full + M_full; dual overlaps the two halves, at best
    max(2 A_half, 2 M_half) and never better than A_half + M_half. > 1: dual should win."""
    (ah, mh), (af, mf) = half, full
    return (af + mf) / max(2 * ah, 2 * mh, ah + mh, 1e-12)
