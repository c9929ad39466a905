"""Serving on a simulated clock: the serving core (policies/core.py) with a runner on
sim/events.Simulator's clock.

One serving core, two clocks. The request lifecycle, the View a policy sees and the decision
are policies/core.ServingCore's, the same code serve/scheduler.py (the engine, wall clock)
and serve/pd.py (the P/D workers) run; this runner executes the same policy's actions as the
engine's own plans (built by the engine's schedules for the profile's box). One iteration,
as Scheduler.step:

1. take the requests that have arrived and the cancellations that are due;
2. adopt finished background prefills (their KV copied into the request's pool row, then
   the first token);
3. ask the core (View: free pool rows, the queue FCFS with the prompt tokens already
   chunked, decoding, background, last decode time, measured decode step times);
4. run the actions in order: a foreground Prefill or a Chunk runs to its end before the
   next action (the scheduler waits for it); a background Prefill is submitted on its
   accelerators and runs on while later iterations decode (it shares the host's DRAM and
   cores, and the link, with them: the simulator's resources); a Decode is one step of the
   cpu schedule's decode plan for its rows (two micro-batches: two plans sharing one lock
   per resource, as engine/dual.py runs them); measure=True records the step's simulated
   seconds for the policy, as the scheduler records its measured ones.
   When nothing ran, the clock moves to the next arrival, cancellation, handover or
   background prefill end.

`pd=True` is intra-node P/D disaggregation (serve/pd.py) driven by the same policies: every
Prefill runs on the prefill worker on accelerator 1 (so it never stalls decoding), whose
first token streams at once; its KV cache is handed over (exported and imported through
host shared memory: priced as two host copies of the KV bytes, plus device copies on a real
accelerator), and the request joins the decode worker's batch on accelerator 0. A policy
that may ask for what P/D cannot run (chunks, dual-batch decode, ...) is refused
(policies/core.check_pd_policy); fcfs with schedule=... is what serve/pd.py ran before
policies drove it.

Requests have forced output lengths (the replay of a measured run gives each request the
tokens it produced), so simulated and measured requests do the same work.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.buckets import cache_len, padded_chunk_plan
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.profile import Profile
from hmoe_jax.plan.trace import attention_moe_split
from hmoe_jax.policies.base import Chunk, Decode, Policy, PolicyError, Prefill
from hmoe_jax.policies.core import (
    PLAIN_ACTIONS,
    AdmissionError,
    CoreRunner,
    RequestState,
    ServingCore,
    Tracked,
    action_kinds,
    check_fits,
    check_pd_policy,
)
from hmoe_jax.policies.registry import DEFAULT_POLICY, get_policy
from hmoe_jax.sim.events import SimError, Simulator
from hmoe_jax.sim.interference import sim_options
from hmoe_jax.sim.pricing import pricer
from hmoe_jax.sim.ranks import split_ranks
from hmoe_jax.sim.reads import with_reads
from hmoe_jax.sim.run import build_plan

GB = 1e9


@dataclasses.dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # forced: the request ends after this many tokens (the first included)
    cancel_s: float | None = None  # cancelled then, if not finished

    def check(self, cfg: ModelConfig, max_len: int) -> SimRequest:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.arrival_s < 0:
            raise SimError(f"sim request: {self} (prompt and output need >= 1 token, arrival >= 0)")
        try:
            check_fits(self.prompt_tokens, self.output_tokens, max_len, "the")
        except AdmissionError as e:
            raise SimError(f"sim {e}") from None
        return self


@dataclasses.dataclass
class SimResult:
    """One request as the simulated server ran it (times in simulated seconds). Its state
    and chunked prompt tokens are the serving core's (policies/core.Tracked)."""

    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    started_s: float | None = None
    first_token_s: float | None = None
    token_s: list[float] = dataclasses.field(default_factory=list)
    finished_s: float | None = None
    finish_reason: str | None = None
    schedule: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    tracked: Tracked | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def state(self) -> RequestState:
        return RequestState.WAITING if self.tracked is None else self.tracked.state

    @property
    def prefilled(self) -> int:
        return 0 if self.tracked is None else self.tracked.prefilled

    def timings(self) -> dict[str, Any]:
        """As Request.timings(): queue_s, ttft_s, tpot_s (mean gap after the first), e2e_s."""
        t = self.token_s
        gaps = [b - a for a, b in zip(t, t[1:])]
        return {
            "queue_s": None if self.started_s is None else self.started_s - self.arrival_s,
            "ttft_s": None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            "tpot_s": statistics.mean(gaps) if gaps else None,
            "e2e_s": None if self.finished_s is None else self.finished_s - self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(t),
        }


class SimServer(CoreRunner):
    """A simulated serving engine on `profile` (its accelerator count unless `devices`).

    max_batch / max_len: the KV pool (rows, tokens per row) the engine would have;
    kv_value_bytes: bytes per cached value (2: the bf16 policy). policy: a registered name
    or a Policy (options as for Scheduler; default: paper, fcfs with pd). pd: P/D
    disaggregation as serve/pd.py runs it (every prefill on the prefill worker, accelerator
    1; decode on accelerator 0; a policy P/D cannot run is refused). last_decode_s: the
    server's history (the paper policy's idle window reads it; None: it never decoded)."""

    def __init__(
        self,
        cfg: ModelConfig,
        profile: Profile,
        policy: str | Policy | None = None,
        *,
        devices: int | None = None,
        max_batch: int = 8,
        max_len: int = 4096,
        expert_format: str = "fp8",
        kv_value_bytes: int = 2,
        pd: bool = False,
        last_decode_s: float | None = None,
        **policy_options: Any,
    ):
        self.cfg = cfg
        self.devices = int(devices or profile.accelerators)
        self.profile = profile.with_accelerators(self.devices)
        if policy is None:
            policy = "fcfs" if pd else DEFAULT_POLICY
        pol = get_policy(policy, **policy_options) if isinstance(policy, str) else policy
        if pd:
            if self.devices < 2:
                raise SimError("sim P/D: needs 2 accelerators (a prefill and a decode worker)")
            try:
                check_pd_policy(pol)
            except PolicyError as e:
                raise SimError(f"sim {e}") from None
        self.core = ServingCore(pol, self.devices, last_decode_s=last_decode_s)
        self.pd = pd
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.expert_format = expert_format
        self.kv_value_bytes = int(kv_value_bytes)
        price = pricer(self.profile, cfg)
        memo: dict[tuple, tuple] = {}

        def priced(plan: Plan, i: int, devs: tuple[int, ...]) -> tuple:
            # plans are built once per shape (self._plans): price each op once
            key = (id(plan), i, devs)
            if key not in memo:
                memo[key] = price(plan, i, devs)
            return memo[key]

        self._price = priced
        # interference (sim/interference.py); P/D workers are separate OS processes, each
        # running one plan at a time (dual micro-batches already share their queues), so the
        # CPU MoE op's process-wide mutex never serialises runs across them
        self._sim_options = sim_options(self.profile)
        if pd:
            self._sim_options.pop("shared_resources", None)
        self.sim = Simulator(priced, **self._sim_options)
        self._alone: dict[tuple, float] = {}
        self.step_s = float(self.profile.get("overheads", "step_s", 0.0))
        self._sub: dict[int, Profile] = {}
        self._plans: dict[tuple, tuple[Plan, str | None]] = {}
        self.built_plans: list[Plan] = []  # every plan this server built, in build order
        self.no_fit: list[str] = []

    @property
    def last_decode_s(self) -> float | None:
        return self.core.last_decode_s

    # ------------------------------------------------------------ plans

    def _plan(self, schedule: str, n_dev: int, tokens: int, start_pos: int = 0, batch: int = 1) -> Plan:
        key = (schedule, n_dev, tokens, start_pos, batch)
        if key not in self._plans:
            if n_dev not in self._sub:
                self._sub[n_dev] = self.profile.with_accelerators(n_dev)
            opts: dict[str, Any] = {"kv_rows": self.max_batch, "max_len": self.max_len}
            if batch > 1:
                opts["batch"] = batch
            plan, msg = build_plan(self.cfg, self._sub[n_dev], schedule, tokens, start_pos=start_pos, **opts)
            self.built_plans.append(plan)  # as built, before reads and ranks (sim/bands.PlanPrices)
            self._plans[key] = (split_ranks(with_reads(plan, self.cfg, self.expert_format)), msg)
        plan, msg = self._plans[key]
        if msg and msg not in self.no_fit:
            self.no_fit.append(msg)  # timed as if it fitted; the engine would refuse it
        return plan

    def _prefill_plan(self, schedule: str, n_dev: int, tokens: int, start_pos: int = 0) -> Plan:
        """The plan of a foreground prefill or chunk of `tokens` real tokens, padded as
        Engine.prefill_seq pads it (plan/buckets.padded_chunk_plan: the same rule)."""

        def build(n: int) -> Plan:
            return self._plan(schedule, n_dev, n, start_pos)

        return padded_chunk_plan(build, schedule, tokens, start_pos, cache_len(self.max_len))[0]

    def _decode_plan(self, rows: list[SimResult]) -> Plan:
        pos = max(r.prompt_tokens + len(r.token_s) - 1 for r in rows)
        # a decode step's cost depends on its position only through the attended cache
        # slots, a power-of-two bucket (costs.decode_kv_len): one plan per bucket
        bucket_pos = max(costs.decode_kv_len(pos + 1) - 1, pos)
        return self._plan("cpu", 1, 1, min(bucket_pos, self.max_len - 1), len(rows))

    def _kv_bytes(self, tokens: int) -> int:
        c = self.cfg
        per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers * self.kv_value_bytes
        return per_token * tokens

    def _kv_move_s(self, tokens: int, through_host_shm: bool) -> float:
        """Moving a prefilled KV cache between accelerators: a stand-in's is a host copy; a
        real accelerator's goes out over its link and in over the other's (no P2P). P/D adds
        the export into and import out of a shared-memory segment (two host copies)."""
        nbytes = self._kv_bytes(tokens)
        link = self.profile.values["link"]
        host_copy = float(self.profile.get("cpu", "copy_gbps", link["h2d_gbps"])) * GB
        if self.profile.link_cap_gbps:  # an emulated link paces the host copies too
            host_copy = min(host_copy, self.profile.link_cap_gbps * GB)
        on_host = self.profile.values["accelerator"]["placement"] == "host"
        dev = 0.0 if on_host else nbytes / (link["d2h_gbps"] * GB) + nbytes / (link["h2d_gbps"] * GB)
        host = (2 if through_host_shm else 1) * nbytes / host_copy if (on_host or through_host_shm) else 0.0
        return dev + host + float(self.profile.get("overheads", "hop_s", 0.0))

    # ------------------------------------------------------------ the loop

    def run(
        self,
        requests: list[SimRequest],
        *,
        stop: Callable[[list[SimResult]], bool] | None = None,
        max_iterations: int = 10_000_000,
    ) -> list[SimResult]:
        """Serve `requests` until all are done (or `stop(results)` holds at the start of an
        iteration: an experiment that needs only a window ends there)."""
        reqs = [r.check(self.cfg, self.max_len) for r in requests]
        results = [SimResult(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(reqs)]
        arrivals = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))
        cancels = sorted((r.cancel_s, i) for i, r in enumerate(reqs) if r.cancel_s is not None)
        core = self.core
        core.clear()  # a run that stopped early left requests behind
        lanes: dict[int, int] = {}  # request -> its background run
        ready: dict[int, float] = {}  # P/D: request -> when its handed-over KV is in place
        sim = self.sim

        def finish(r: SimResult, reason: str) -> None:
            core.finish(r.id)  # releases its pool row
            r.finish_reason, r.finished_s = reason, sim.now_s
            lanes.pop(r.id, None)
            ready.pop(r.id, None)

        def emit(r: SimResult) -> None:
            r.token_s.append(sim.now_s)
            if r.first_token_s is None:
                r.first_token_s = sim.now_s
            if len(r.token_s) >= r.output_tokens:
                finish(r, "length")

        def first_token(r: SimResult) -> None:
            core.decoding(r.id)
            emit(r)

        def admit(r: SimResult) -> None:
            core.admit(r.id)
            r.started_s = sim.now_s

        for _ in range(max_iterations):
            if stop is not None and stop(results):
                return results
            now = sim.now_s
            while arrivals and reqs[arrivals[0]].arrival_s <= now + 1e-12:
                i = arrivals.pop(0)
                results[i].tracked = core.add(i, results[i].prompt_tokens, results[i].arrival_s)
            while cancels and cancels[0][0] <= now + 1e-12:
                _, i = cancels.pop(0)
                if i in core:
                    finish(results[i], "cancelled")
            ran = False
            for i, rid in list(lanes.items()):  # adopt finished background prefills
                if not sim.done(rid):
                    continue
                ran = True
                r = results[i]
                del lanes[i]
                if self.pd:  # the prefill worker streams the first token, then hands the KV over
                    sim.run_until(t_s=sim.now_s + self.step_s)
                    emit(r)
                    if i in core:
                        core.handover(i)
                        ready[i] = sim.now_s + self._kv_move_s(r.prompt_tokens, True)
                    continue
                sim.run_until(t_s=sim.now_s + self._kv_move_s(r.prompt_tokens, False) + self.step_s)
                first_token(r)
            for i, t in list(ready.items()):
                if t <= sim.now_s + 1e-12:
                    del ready[i]
                    core.decoding(i)
            for a in core.decide(sim.now_s, self.max_batch - core.rows_held):
                ran = True
                if self.pd and not action_kinds(a) <= PLAIN_ACTIONS:
                    raise SimError(
                        f"sim P/D: policy {self.policy.name!r} asked for {a}, which P/D cannot run"
                    )
                if isinstance(a, Decode):
                    self._decode([results[i] for i in a.requests], a, emit)
                    continue
                r = results[a.request]
                if isinstance(a, Prefill):
                    admit(r)
                    background, devices = a.background, tuple(a.devices)
                    if self.pd:  # every prefill runs on the prefill worker (accelerator 1)
                        background, devices = True, (1,)
                    core.prefilling(a.request, background)
                    r.schedule = a.schedule
                    if background:  # a prefill lane: an engine view on those accelerators
                        # P/D's worker runs Engine.prefill_seq (padded as the foreground
                        # one); a lane's EngineView.prefill runs the exact length
                        make = self._prefill_plan if self.pd else self._plan
                        plan = make(a.schedule, len(devices), r.prompt_tokens)
                        lanes[a.request] = sim.submit(plan, devices=devices, label=f"prefill{r.id}")
                        r.schedule = plan.schedule
                        continue
                    # the engine's own prefill: every accelerator it has (slp/cpu use one)
                    plan = self._prefill_plan(a.schedule, self.devices, r.prompt_tokens)
                    r.schedule = plan.schedule
                    sim.run_until(rid=sim.submit(plan, label=f"prefill{r.id}"))
                    sim.run_until(t_s=sim.now_s + self.step_s)
                    first_token(r)
                elif isinstance(a, Chunk):
                    if r.started_s is None:
                        admit(r)
                    r.schedule = "cpu (chunked)"
                    plan = self._prefill_plan("cpu", 1, a.end - r.prefilled, r.prefilled)
                    sim.run_until(rid=sim.submit(plan, label=f"chunk{r.id}"))
                    if core.chunked(a.request, a.end):
                        sim.run_until(t_s=sim.now_s + self.step_s)
                        first_token(r)
            if not ran:
                nxt = [reqs[arrivals[0]].arrival_s] if arrivals else []
                nxt += [cancels[0][0]] if cancels else []
                nxt += list(ready.values())
                t_next = min(nxt) if nxt else None
                if lanes:
                    sim.run_until_any(list(lanes.values()), t_s=t_next)
                elif t_next is not None:
                    sim.run_until(t_s=t_next)
                elif core.busy:
                    raise SimError(
                        f"sim serve: policy {self.policy.name!r} runs nothing with requests "
                        f"{sorted(core.requests)} left and nothing to wait for"
                    )
                else:
                    return results
        raise SimError(f"sim serve: not finished after {max_iterations} iterations")

    def alone(self, plans: list[Plan]) -> tuple[float, Simulator, list[int]]:
        """These plans started together on an otherwise idle box, sharing one lock per
        resource (as a dual step's micro-batches do): seconds until the last ends, and the
        simulator and runs to read their timelines from."""
        solo = Simulator(self._price, **self._sim_options)
        rids = [solo.submit(p, group="step") for p in plans]
        return max(solo.run_until(rid=r) for r in rids), solo, rids

    def _decode(self, rows: list[SimResult], a: Decode, emit) -> None:
        sim = self.sim
        if a.micro_batches >= 2 and len(rows) >= 2:
            h = (len(rows) + 1) // 2
            groups = [rows[:h], rows[h:]]
        else:
            groups = [rows]
        tag = ("decode", len(self.log))
        t0 = sim.now_s
        plans = [self._decode_plan(g) for g in groups]
        if sim.idle and not a.measure:
            # nothing else in flight: the step takes what it takes alone (the same plans
            # always take the same time), so the clock jumps instead of replaying its ops
            key = tuple(id(p) for p in plans)
            if key not in self._alone:
                self._alone[key] = self.alone(plans)[0]
            sim.run_until(t_s=sim.now_s + self._alone[key] + self.step_s)
        else:
            rids = [sim.submit(p, group=tag, label=f"decode{len(g)}") for p, g in zip(plans, groups)]
            for rid in rids:
                sim.run_until(rid=rid)
            sim.run_until(t_s=sim.now_s + self.step_s)
            if a.measure:
                self.core.decoded(sim.now_s, (len(rows), len(groups)), sim.now_s - t0)
        self.core.decoded(sim.now_s)
        for r in rows:
            emit(r)


def layer_times(timeline: list[dict[str, Any]]) -> tuple[float, float]:
    """(A, M) of one simulated decode step, as engine/dual.layer_times reads a trace
    (plan.trace.attention_moe_split)."""
    split = attention_moe_split(
        (str(r["queue"]), -1 if r["layer"] is None else int(r["layer"]), r["dur_s"]) for r in timeline
    )
    if split is None:
        raise SimError("layer_times: the step has no CPU expert ops (a dense model?)")
    return split


def decode_step_s(cfg: ModelConfig, profile: Profile, batch: int, context: int) -> float:
    """One decode step of `batch` rows at `context` alone on the profile's box (as the
    serving loop prices it: the plan, then the host's step work)."""
    srv = SimServer(cfg, profile, "fcfs", max_batch=batch, max_len=context + 64)
    return srv.alone([srv._plan("cpu", 1, 1, context, batch)])[0] + srv.step_s


def decode_arms(
    cfg: ModelConfig, profile: Profile, batch: int, context: int, *, max_len: int | None = None
) -> dict[str, Any]:
    """One decode step of `batch` rows at `context`, three ways (e06's part 2 on the
    simulator): plain (one batch), sequential (its two halves one after the other), dual
    (the halves overlapped, sharing one lock per resource); and (A, M) per MoE layer of a
    half-batch and a full-batch step, read off the simulated timelines."""
    if batch < 2:
        raise SimError(f"decode_arms: batch {batch}; two micro-batches need >= 2 rows")
    length = max_len or context + 64
    srv = SimServer(cfg, profile, "fcfs", max_batch=batch, max_len=length)
    h = (batch + 1) // 2
    out: dict[str, Any] = {}

    def step(groups: list[int]) -> tuple[float, list[int], Simulator]:
        end_s, sim, rids = srv.alone([srv._plan("cpu", 1, 1, context, g) for g in groups])
        return end_s + srv.step_s, rids, sim

    out["plain_step_s"], (rid,), sim = step([batch])
    full = layer_times(sim.timeline(rid))
    half_s, (rid,), sim = step([h])
    half = layer_times(sim.timeline(rid))
    out["sequential_step_s"] = half_s + (step([batch - h])[0] if batch - h != h else half_s)
    out["dual_step_s"] = step([h, batch - h])[0]
    out["attn_layer_s"], out["moe_layer_s"] = half
    out["full_attn_layer_s"], out["full_moe_layer_s"] = full
    return out


def from_replay(logs: list[dict[str, Any]], origin_s: float = 0.0) -> list[SimRequest]:
    """SimRequests replaying measured requests (experiments' replay logs: arrival_s,
    prompt_tokens, token_s): the same arrivals (shifted by origin_s), prompts and output
    lengths. A request that produced no token is left out (it never got that far)."""
    return [
        SimRequest(float(x["arrival_s"]) - origin_s, int(x["prompt_tokens"]), len(x["token_s"]))
        for x in logs
        if x["token_s"]
    ]


__all__ = [
    "SimRequest",
    "SimResult",
    "SimServer",
    "decode_arms",
    "decode_step_s",
    "from_replay",
    "layer_times",
]
