"""The serving core: the request lifecycle as plain data, shared by every serving loop.

The in-process Scheduler (serve/scheduler.py, wall clock, one Engine), the P/D coordinator
(serve/pd.py, wall clock, two worker processes) and the simulator (sim/serve.py, simulated
clock) all keep their requests in a ServingCore and ask it what to run; each keeps only a
runner that executes the answer (on the engine, on the workers, on the simulated clock).

One iteration of every loop:

    core.add(...) / core.cancel(id)        # arrivals and cancellations the runner has seen
    ... runner adopts finished background work: core.decoding(id) / core.handover(id)
    for a in core.decide(now_s, free_rows):  # the View, the policy's answer, the action log
        runner executes a; calls core.prefilling / core.chunked / core.decoding /
        core.decoded / core.finish as the request moves on

The lifecycle (RequestState):

    WAITING --Prefill(background)--> PREFILLING --> [HANDOVER -->] DECODING --> DONE
    WAITING --Prefill (foreground)----------------------------> DECODING --> DONE
    WAITING --Chunk--> CHUNKING --Chunk ... last chunk---------> DECODING --> DONE
    WAITING (a fork, not queued) --forked---------------------> DECODING --> DONE
    any state --cancel / error / finish--> DONE

A fork is a follower of a group of requests sharing one prompt (n samples): it is added
unqueued (the policy never sees it, so never prefills it) and, once a member of its group has
prefilled the prompt, the runner copies that member's KV into a row of its own and samples its
first token from the shared prompt logits: `forked` takes it WAITING -> DECODING with no
prefill action. A fork whose group has no prefilled member left (all ended before it got a
row) joins the queue (`queue`) and is prefilled like any request. Only the in-process
Scheduler forks; the P/D coordinator and the simulator add every request queued.

HANDOVER is P/D's: the first token is out and the KV moves to the decode side. `holds_row`
says whether the request holds a KV pool row (from its admission to its end), so a runner
that counts rows itself (the simulator) reads them here.

Submit validation (check_fits) is written once: a prompt and its new tokens must fit a KV
row; each runner adds what only it can check (token ids against the vocabulary, ...).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from hmoe_jax.policies.base import Action, Chunk, Decode, Pending, Policy, PolicyError, Prefill, View


class RequestState(enum.StrEnum):  # a str: RequestState.DONE == "done"
    WAITING = "waiting"  # submitted, no prompt token prefilled
    CHUNKING = "chunking"  # admitted, prompt partly prefilled by chunks
    PREFILLING = "prefilling"  # whole prompt on a prefill lane / the prefill worker
    HANDOVER = "handover"  # P/D: first token out, KV on its way to the decode side
    DECODING = "decoding"
    DONE = "done"


class AdmissionError(ValueError):
    """A request refused at submit (the message names the problem)."""


def check_fits(prompt_tokens: int, max_new_tokens: int, max_len: int, whose: str = "the engine's") -> None:
    """A request's prompt plus its new tokens must fit one KV row of max_len tokens."""
    need = prompt_tokens + max_new_tokens
    if need > max_len:
        raise AdmissionError(
            f"request: prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
            f"tokens exceed {whose} KV row length of {max_len} tokens"
        )


@dataclasses.dataclass
class Tracked:
    """One request as the core sees it: sizes, times and state, no tokens or arrays."""

    id: int
    prompt_tokens: int
    submitted_s: float
    state: RequestState = RequestState.WAITING
    prefilled: int = 0  # prompt tokens prefilled by chunks
    holds_row: bool = False  # admitted: holds a KV pool row until it ends
    fork: bool = False  # added unqueued: waits for its group's prefill (forked / queue)


class ServingCore:
    """The requests of one serving loop, its policy and its decision log.

    devices: the accelerators the policy is told about; last_decode_s: when the server last
    decoded (None: never; the paper policy's idle window reads it)."""

    def __init__(self, policy: Policy, devices: int, *, last_decode_s: float | None = None):
        self.policy = policy
        self.devices = int(devices)
        self.requests: dict[int, Tracked] = {}  # live (not DONE), in submission order
        self._order: list[int] = []  # WAITING / CHUNKING, FCFS
        self.last_decode_s = last_decode_s
        self.step_times: dict[tuple[int, int], float] = {}  # measured decode steps (View.step_times)
        self.iterations = 0
        self.log: list[dict[str, Any]] = []  # per iteration that decided something: its actions

    # ------------------------------------------------------------ queries

    def __contains__(self, rid: int) -> bool:
        return rid in self.requests

    def __getitem__(self, rid: int) -> Tracked:
        return self.requests[rid]

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    @property
    def rows_held(self) -> int:
        return sum(1 for t in self.requests.values() if t.holds_row)

    def in_state(self, *states: RequestState) -> list[int]:
        return [r for r, t in self.requests.items() if t.state in states]

    def waiting(self) -> list[int]:
        """WAITING / CHUNKING requests, FCFS (forks waiting for their group not included)."""
        return list(self._order)

    # ------------------------------------------------------------ transitions

    def clear(self) -> None:
        """Forget every live request (a simulator run that stopped early; the next run starts
        empty). Measured step times, the last decode time and the log stay."""
        self.requests.clear()
        self._order.clear()

    def add(self, rid: int, prompt_tokens: int, submitted_s: float, *, fork: bool = False) -> Tracked:
        """A new WAITING request, queued FCFS; a fork (a group follower) is not queued."""
        if rid in self.requests:
            raise ValueError(f"serving core: request {rid} added twice")
        t = self.requests[rid] = Tracked(rid, int(prompt_tokens), float(submitted_s), fork=fork)
        if not fork:
            self._order.append(rid)
        return t

    def forked(self, rid: int) -> None:
        """A fork took a row, a copy of its group's prompt KV and its first token from the
        group's prompt logits: WAITING -> DECODING, no prefill."""
        t = self.requests[rid]
        if not t.fork or t.state != RequestState.WAITING:
            raise ValueError(f"serving core: request {rid} ({t.state}, fork={t.fork}) cannot be forked")
        t.holds_row, t.state, t.fork = True, RequestState.DECODING, False

    def queue(self, rid: int) -> None:
        """A fork whose group has no prefilled member left joins the queue in its FCFS place
        (by submission time) and is prefilled like any request."""
        t = self.requests[rid]
        if not t.fork:
            raise ValueError(f"serving core: request {rid} is queued already")
        t.fork = False
        at = next(
            (i for i, r in enumerate(self._order) if self.requests[r].submitted_s > t.submitted_s),
            len(self._order),
        )
        self._order.insert(at, rid)

    def admit(self, rid: int) -> None:
        """The request takes a KV pool row (its prefill starts)."""
        self.requests[rid].holds_row = True

    def prefilling(self, rid: int, background: bool) -> None:
        """A whole-prompt prefill started: it leaves the queue; a background one (a prefill
        lane, the prefill worker) is PREFILLING until the runner adopts it."""
        self._unqueue(rid)
        if background:
            self.requests[rid].state = RequestState.PREFILLING

    def chunked(self, rid: int, end: int) -> bool:
        """Prompt tokens [prefilled, end) are in; True once the whole prompt is (the request
        leaves the queue and the runner samples its first token)."""
        t = self.requests[rid]
        t.state, t.prefilled = RequestState.CHUNKING, int(end)
        if end >= t.prompt_tokens:
            self._unqueue(rid)
            return True
        return False

    def handover(self, rid: int) -> None:
        self.requests[rid].state = RequestState.HANDOVER

    def decoding(self, rid: int) -> None:
        """The first token exists: the request decodes from the next decision on."""
        self.requests[rid].state = RequestState.DECODING

    def decoded(self, now_s: float, arm: tuple[int, int] | None = None, step_s: float | None = None) -> None:
        """A decode step ended at now_s; a measured one (arm = (batch, micro-batches)) took
        step_s seconds (the paper policy's dual-batch "auto" compares the arms)."""
        self.last_decode_s = now_s
        if arm is not None and step_s is not None:
            self.measured(arm, step_s)

    def measured(self, arm: tuple[int, int], step_s: float) -> None:
        """A decode arm (batch, micro-batches) was timed at step_s seconds (by a measured
        step, or before serving by the runner's warm-up, which decodes no request)."""
        self.step_times[arm] = float(step_s)

    def finish(self, rid: int) -> Tracked | None:
        """The request ends (finished, cancelled or failed): it leaves the core and releases
        its row. Returns what it was (None: already ended)."""
        t = self.requests.pop(rid, None)
        if t is None:
            return None
        self._unqueue(rid)
        t.state = RequestState.DONE
        return t

    cancel = finish  # a cancel is an end like any other; the runner frees what it holds

    def _unqueue(self, rid: int) -> None:
        if rid in self._order:
            self._order.remove(rid)

    # ------------------------------------------------------------ the decision

    def view(self, now_s: float, free_rows: int) -> View:
        """What the policy sees: free rows, the queue FCFS with the prompt tokens already
        chunked, decoding and background requests, the last decode time, measured steps."""
        reqs = self.requests
        return View(
            now_s=now_s,
            devices=self.devices,
            free_rows=free_rows,
            waiting=tuple(
                Pending(r, reqs[r].prompt_tokens, reqs[r].prefilled, reqs[r].submitted_s) for r in self._order
            ),
            decoding=tuple(self.in_state(RequestState.DECODING)),
            background=tuple(self.in_state(RequestState.PREFILLING)),
            last_decode_s=self.last_decode_s,
            step_times=dict(self.step_times),
        )

    def decide(self, now_s: float, free_rows: int) -> tuple[Action, ...]:
        """Ask the policy what to run now; the actions are logged (kind and fields)."""
        view = self.view(now_s, free_rows)
        actions = tuple(self.policy.decide(view))
        self.iterations += 1
        if actions:
            self.log.append({"t_s": view.now_s, "actions": [describe(a) for a in actions]})
        return actions


def describe(a: Action) -> dict[str, Any]:
    """An action as the log keeps it: its kind and fields (tuples as lists)."""
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(a).items()}
    d["kind"] = type(a).__name__.lower()
    return d


# What a runner without chunked prefill, multi-accelerator prefill or dual-batch decode (the
# P/D workers) can execute: whole-prompt prefills and plain decode steps of every request.
PLAIN_ACTIONS = frozenset({"prefill", "decode"})


def check_pd_policy(policy: Policy) -> None:
    """P/D's workers prefill whole prompts (each on the prefill worker, one at a time) and
    decode every adopted request in one plain step: a policy that may ask for more is
    refused here, before serving, with what it asks for."""
    extra = sorted(policy.emits - PLAIN_ACTIONS)
    if extra:
        raise PolicyError(
            f"P/D: policy {policy.name!r} may ask for {', '.join(extra)}, which the P/D workers cannot "
            f"run (they prefill whole prompts on the prefill worker and decode every request in one "
            f"plain step); P/D runs policies that ask only for {sorted(PLAIN_ACTIONS)}, e.g. 'fcfs'"
        )


def action_kinds(a: Action) -> set[str]:
    """The capabilities an action needs (compare with Policy.emits)."""
    if isinstance(a, Chunk):
        return {"chunk"}
    if isinstance(a, Prefill):
        return {"prefill"} | ({"multi_device_prefill"} if len(a.devices) > 1 else set())
    if isinstance(a, Decode):
        return (
            {"decode"}
            | ({"dual_batch"} if a.micro_batches >= 2 else set())
            | ({"measure"} if a.measure else set())
        )
    raise TypeError(f"not an action: {a!r}")


__all__ = [
    "PLAIN_ACTIONS",
    "AdmissionError",
    "RequestState",
    "ServingCore",
    "Tracked",
    "action_kinds",
    "check_fits",
    "check_pd_policy",
    "describe",
]


class CoreRunner:
    """What a runner of the serving core (the Scheduler, the P/D coordinator, SimServer)
    shows of it: the policy, the decision log and the measured dual/plain step times."""

    core: ServingCore

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def log(self) -> list[dict[str, Any]]:
        """Per iteration that decided something: its actions (experiments read it)."""
        return self.core.log

    @property
    def step_times(self) -> dict[tuple[int, int], float]:
        return self.core.step_times
