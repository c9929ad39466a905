"""The in-process request scheduler: requests arrive over time (submit, from any thread),
a policy (hmoe_jax.policies) decides each iteration what runs, this runs it on the engine.

    eng = Engine(params, cfg, devices=2, max_batch=8)
    sched = Scheduler(eng, policy="paper")          # or "dual", "fcfs", options: decode_cap=...
    sched.start()                                   # a background loop thread (servers)
    h = sched.submit(prompt_ids, SamplingParams(max_new_tokens=32))
    print(list(h), h.result().timings())            # tokens as produced; queue / TTFT / TPOT
    sched.close()

Or drive it by hand (tests, experiments): `sched.step()` runs one iteration, `sched.drain()`
until every submitted request is finished.

One iteration: take new requests and cancellations; adopt finished background prefills (copy
their KV from the prefill lane's accelerator into their pool row, sample the first token);
ask the serving core (policies/core.py: the request lifecycle, the View, the policy's
decision; the P/D coordinator and the simulator run the same core); run the actions in order (whole-prompt prefills, one chunk of a
short prompt, one decode step: plain, or dual-batch through engine/dual.py). A cancelled
request's pool row is freed in the iteration that sees the cancel.

A group of requests sharing one prompt (submit_group: n samples) prefills it once: the first
member is queued as usual; the others are forks (policies/core.py) the policy never sees.
At the start of each iteration, while rows are free, a fork takes a row, gets a copy of a
prefilled member's KV row (KVPool.copy_in within the pool: the whole row, the tail past the
prompt masked by attention and overwritten as the fork decodes) and samples its first token
from the shared prompt logits with its own parameters; it decodes like any request from then
on. A fork whose group has no prefilled member left (it ended before the fork got a row, or
was cancelled before its prefill) is queued and prefilled itself, and the group's other
forks wait on it. An action that fails
(bad input found late, a plan that does not fit) ends its request with an error naming the
cause; the scheduler and the other requests go on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from hmoe_jax.engine.dual import dual_step, split_micro_batches
from hmoe_jax.engine.engine import Engine, SeqState
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.policies.base import Chunk, Decode, Policy, Prefill
from hmoe_jax.policies.core import CoreRunner, RequestState, ServingCore
from hmoe_jax.policies.registry import DEFAULT_POLICY, get_policy
from hmoe_jax.serve.request import Request, RequestHandle, new_request
from hmoe_jax.serve.scheduler_warmup import WarmUp, _arm, decode_kv_buckets  # noqa: F401 (re-exported)
from hmoe_jax.serve.servetrace import SCHED, CompileListener, span


@dataclasses.dataclass
class _Entry:
    """The runner's side of a request (its state lives in the core)."""

    handle: RequestHandle
    seq: SeqState | None = None
    lane: Any = None  # background prefill: (thread, result dict)
    group: _Group | None = None  # submit_group: the requests sharing this one's prompt

    @property
    def req(self) -> Request:
        return self.handle.request


@dataclasses.dataclass
class _Group:
    """Requests sharing one prompt (submit_group): one prefills it, the others fork."""

    members: list[int]  # every member's id, submission order
    pending: list[int]  # forks waiting for a row (and a prefilled member to copy)
    logits: Any = None  # the prompt's last-position logits [1, V], once a member prefilled it
    prompt_logprobs: list[Any] | None = None  # that member's (every member asks the same k)
    ttft_s: float = 0.0  # that member's prefill time (seconds)


class Scheduler(WarmUp, CoreRunner):
    """Options: policy (a registered name or a Policy), **policy_options; trace (a
    TraceRecorder: the loop's phases go to its `sched` track and compiles to `compile`,
    serve/servetrace.py; with trace_engine, every engine op too: Perfetto); clock
    (seconds; perf_counter).

    A measured decode step (the policy's dual-batch `auto`) that compiled something is no
    measurement of the arm: it is not recorded, so the policy asks for the arm again.
    warm_up() compiles every decode batch size before serving and measures the arms the
    policy compares, so serving neither compiles nor measures.

    The request lifecycle, the View and the decision are the serving core's
    (policies/core.py, shared with the P/D coordinator and the simulator); this class is
    its runner on the engine."""

    def __init__(
        self,
        engine: Engine,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        trace: TraceRecorder | None = None,
        trace_engine: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        **policy_options: Any,
    ):
        self.engine = engine
        policy = get_policy(policy, **policy_options) if isinstance(policy, str) else policy
        self.core = ServingCore(policy, engine.devices)
        self.trace, self.clock = trace, clock
        self.engine_trace = trace if trace_engine else None
        self.compiles = CompileListener(trace).install()
        self._lock = threading.Condition()
        self._inbox: list[_Entry] = []
        self._cancels: list[int] = []
        self._entries: dict[int, _Entry] = {}
        self._lanes: dict[tuple[int, ...], Engine] = {}
        self._groups: list[_Group] = []  # groups with forks still waiting
        self._thread: threading.Thread | None = None
        self._closed = False
        self._exclusive = threading.Lock()  # held by each iteration (run_exclusive)
        self.warm_up_info: dict[str, Any] | None = None

    @property
    def iterations(self) -> int:
        return self.core.iterations

    @property
    def last_decode_s(self) -> float | None:
        return self.core.last_decode_s

    # ------------------------------------------------------------ request API

    def submit(self, prompt_ids: Any, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request; bad input raises ValueError here, naming the problem."""
        if self._closed:
            raise RuntimeError("scheduler is closed")
        req = new_request(
            self.engine.cfg, prompt_ids, params, self.engine.max_len, self.clock(), "the engine's"
        )
        self.engine.check_structured(req.params)  # a bad schema is refused here, not at admit
        e = _Entry(RequestHandle(req, self._cancel))
        with self._lock:
            self._inbox.append(e)
            self._lock.notify_all()
        return e.handle

    def submit_group(self, prompt_ids: Any, params_list: list[SamplingParams]) -> list[RequestHandle]:
        """One request per params, all on one prompt (n samples), prefilled once: the others
        fork the first's prefill (module docstring). Members asking different prompt_logprobs
        form separate groups (the copy carries one k). Each handle is a request of its own:
        cancelling one leaves the others running. Bad input raises ValueError here."""
        if self._closed:
            raise RuntimeError("scheduler is closed")
        if not params_list:
            raise ValueError("submit_group: no sampling parameters (one per request)")
        now = self.clock()
        entries = []
        for params in params_list:
            req = new_request(self.engine.cfg, prompt_ids, params, self.engine.max_len, now, "the engine's")
            self.engine.check_structured(req.params)
            entries.append(_Entry(RequestHandle(req, self._cancel)))
        by_k: dict[int | None, list[_Entry]] = {}
        for e in entries:
            by_k.setdefault(e.req.params.prompt_logprobs, []).append(e)
        for members in by_k.values():
            if len(members) > 1:
                g = _Group([e.req.id for e in members], [e.req.id for e in members[1:]])
                for e in members:
                    e.group = g
        with self._lock:
            self._inbox.extend(entries)
            self._lock.notify_all()
        return [e.handle for e in entries]

    def _cancel(self, req: Request) -> None:
        with self._lock:
            self._cancels.append(req.id)
            self._lock.notify_all()

    @property
    def healthy(self) -> bool:
        """The loop thread is running (start() called, not closed): what /health reports."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancels) or self.core.busy

    # ------------------------------------------------------------ the loop

    def run_exclusive(self, fn: Callable[[], Any]) -> Any:
        """fn() between two iterations of the loop (the engine is this thread's meanwhile):
        how a running server warms up."""
        with self._exclusive:
            return fn()

    def step(self) -> bool:
        """One iteration; returns whether anything ran."""
        with self._exclusive:
            return self._step()

    def _step(self) -> bool:
        tr = self.trace
        with span(tr, SCHED, "intake"):
            with self._lock:
                new, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for e in new:
                self._entries[e.req.id] = e
                g = e.group
                self.core.add(
                    e.req.id,
                    int(e.req.prompt.size),
                    e.req.submitted_s,
                    fork=g is not None and e.req.id in g.pending,
                )
                if g is not None and g.members[0] == e.req.id:
                    self._groups.append(g)
            for rid in cancels:
                self._do_cancel(rid)
        if self.core.in_state(RequestState.PREFILLING):
            with span(tr, SCHED, "adopt"):
                ran = self._adopt_background()
        else:
            ran = False
        if self._groups:
            with span(tr, SCHED, "fork"):
                ran = self._tend_groups() or ran
        with span(tr, SCHED, "decide") as info:
            actions = self.core.decide(self.clock(), len(self.engine.pool.free_rows))
            if tr is not None and actions:
                info["actions"] = self.core.log[-1]["actions"]
        for a in actions:
            ran = True
            if isinstance(a, Prefill):
                self._prefill(a)
            elif isinstance(a, Chunk):
                self._chunk(a)
            elif isinstance(a, Decode):
                self._decode(a)
        return ran

    def drain(self, timeout_s: float = 600.0) -> None:
        """Run iterations until every submitted request is finished."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if not self.step():
                time.sleep(0.002)  # only background prefills in flight
            if time.monotonic() > deadline:
                raise TimeoutError(f"scheduler: requests still running after {timeout_s} s")

    def start(self) -> Scheduler:
        """Run the loop on a background thread until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hmoe-scheduler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._closed:
            try:
                ran = self.step()
            except BaseException:  # never let the loop die: fail what was running, go on
                self._fail_all(traceback.format_exc(limit=3))
                ran = True
            if not ran:
                with self._lock, span(self.trace, SCHED, "idle"):
                    if not (self._inbox or self._cancels or self._closed):
                        # a background prefill notifies when it ends (no polling: a loop
                        # waking every few ms takes CPU from the prefill it waits for)
                        self._lock.wait(0.5)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.compiles.uninstall()
        for e in list(self._entries.values()):
            self._finish(e, "cancelled")
        for e in self._inbox:
            e.handle.finish("cancelled", self.clock())

    # ------------------------------------------------------------ actions

    def _admit(self, e: _Entry) -> SeqState:
        e.seq = self.engine.admit(e.req.prompt, e.req.params)
        self.core.admit(e.req.id)
        e.req.started_s = self.clock()
        return e.seq

    def _prefill(self, a: Prefill) -> None:
        e = self._entries[a.request]
        self.core.prefilling(a.request, a.background)
        try:
            seq = self._admit(e)
            e.req.schedule = a.schedule
            if a.background:
                self._start_background(e, a)
                return
            with span(self.trace, SCHED, "prefill", request=a.request, tokens=int(seq.prompt.size)):
                self.engine.prefill_seq(seq, a.schedule, trace=self.engine_trace)
        except Exception as ex:  # noqa: BLE001 (reported on the request; the loop goes on)
            self._error(e, ex)
            return
        self._prefilled(e)

    def _chunk(self, a: Chunk) -> None:
        e = self._entries[a.request]
        try:
            seq = e.seq if e.seq is not None else self._admit(e)
            e.req.schedule = "cpu (chunked)"
            with span(self.trace, SCHED, "chunk", request=a.request, tokens=a.end - int(seq.pos)):
                done = self.engine.prefill_seq(seq, "cpu", a.end, trace=self.engine_trace)
        except Exception as ex:  # noqa: BLE001
            self._error(e, ex)
            return
        self.core.chunked(a.request, int(seq.prompt.size) if done else int(seq.pos))
        if done:
            self._prefilled(e)

    def _tend_groups(self) -> bool:
        """Fork each group's waiting members while rows are free (from a member that has
        prefilled the prompt and still holds its row); queue one for its own prefill where no
        member is left to fork from. Returns whether a fork ran."""
        ran = False
        for g in list(self._groups):
            g.pending = [r for r in g.pending if r in self._entries]  # cancelled forks are gone
            live = [self._entries[r] for r in g.members if r in self._entries and r not in g.pending]
            src = next((e.seq for e in live if e.seq is not None and e.seq.tokens and not e.seq.done), None)
            if src is not None and g.logits is not None:
                while g.pending and self.engine.pool.free_rows:
                    self._fork(self._entries[g.pending.pop(0)], g, src)
                    ran = True
            elif not live and g.pending:
                # nobody is prefilling or holding the prompt any more: the first fork prefills it
                self.core.queue(g.pending.pop(0))
                g.logits = None
            if not g.pending:
                self._groups.remove(g)
        return ran

    def _fork(self, e: _Entry, g: _Group, src: SeqState) -> None:
        """e takes a row, a copy of src's KV row (its prompt is e's) and its first token
        sampled from the group's prompt logits with e's own parameters."""
        t0 = time.perf_counter()
        try:
            seq = self._admit(e)
            moved = self.engine.pool.copy_in(seq.row, self.engine.pool, src.row)
            if g.prompt_logprobs is not None:
                seq.prompt_logprobs = list(g.prompt_logprobs)
            e.req.schedule = seq.schedule = "fork"
            copy_s = time.perf_counter() - t0
            self.engine.first_token(seq, g.logits, g.ttft_s + copy_s)
        except Exception as ex:  # noqa: BLE001 (reported on the request; the loop goes on)
            self._error(e, ex)
            return
        e.req.meta.update(kv_copy_bytes=moved, kv_copy_s=copy_s)
        self.core.forked(e.req.id)
        self._prefilled(e)

    def _prefilled(self, e: _Entry) -> None:
        """The first token exists: stream it; the request decodes from the next iteration.
        A group member that prefilled the prompt leaves its logits for the group's forks."""
        seq = e.seq
        g = e.group
        if g is not None and g.logits is None:
            g.logits = np.asarray(seq.prefill_logits)[-1:]
            g.prompt_logprobs, g.ttft_s = seq.prompt_logprobs, seq.ttft_s
        e.req.prompt_logprobs = seq.prompt_logprobs  # before the first token: a stream reads it then
        self._emit(e, self.clock())
        self.core.decoding(e.req.id)
        if seq.done:
            self._finish(e, seq.finish_reason)

    @staticmethod
    def _emit(e: _Entry, t_s: float) -> None:
        """Stream a sequence's newest token (with its logprob when the request asked)."""
        seq = e.seq
        e.handle.emit(seq.tokens[-1], t_s, seq.logprobs[-1] if seq.params.logprobs is not None else None)

    def _lane(self, devices: tuple[int, ...]) -> Engine:
        if devices not in self._lanes:
            self._lanes[devices] = self.engine.view(devices)
        return self._lanes[devices]

    def _start_background(self, e: _Entry, a: Prefill) -> None:
        lane = self._lane(a.devices)
        ids = e.req.prompt
        out: dict[str, Any] = {}

        def work() -> None:
            try:
                t0 = time.perf_counter()
                cache = lane.new_cache(cache_len(ids.size), 1)
                want_all = e.req.params.prompt_logprobs is not None  # prompt logprobs need every position
                logits, run, secs, plan = lane.prefill(ids, cache, a.schedule, row=0, all_logits=want_all)
                out.update(cache=cache, logits=logits, secs=secs, plan=plan, run=run)
                out["ttft_s"] = time.perf_counter() - t0
            except BaseException as ex:  # noqa: BLE001 (reported when adopted)
                out["error"] = ex
            finally:
                out["done"] = True
                with self._lock:  # wake the loop: it adopts the prefill at once
                    self._lock.notify_all()

        t = threading.Thread(target=work, name=f"hmoe-prefill-{e.req.id}", daemon=True)
        e.lane = (t, out)
        t.start()

    def _adopt_background(self) -> bool:
        ran = False
        for rid in self.core.in_state(RequestState.PREFILLING):
            e = self._entries[rid]
            if not e.lane[1].get("done"):
                continue
            e.lane[0].join()
            ran = True
            out = e.lane[1]
            e.lane = None
            if "error" in out:
                self._error(e, out["error"])
                continue
            seq = e.seq
            t0 = time.perf_counter()
            moved = self.engine.pool.copy_in(seq.row, out["cache"], 0)
            e.req.meta.update(kv_copy_bytes=moved, kv_copy_s=time.perf_counter() - t0)
            seq.prefill_s, seq.schedule = out["secs"], out["plan"].schedule
            seq.plan_meta = dict(out["plan"].meta)
            seq.streamed_bytes = sum(out["run"].streamed_bytes.values())
            if seq.params.prompt_logprobs is not None:
                self.engine.record_prompt_logprobs(seq, out["logits"], 0, int(seq.prompt.size))
            self.engine.first_token(seq, out["logits"][-1:], out["ttft_s"])
            self._prefilled(e)
        return ran

    def _decode(self, a: Decode) -> None:
        entries = [self._entries[r] for r in a.requests]
        seqs = [e.seq for e in entries]
        compiles = self.compiles.compiles
        t_step = time.perf_counter()
        try:
            with span(self.trace, SCHED, "decode", batch=len(seqs), micro_batches=a.micro_batches):
                self._run_step(seqs, a.micro_batches, a.measure)
        except Exception as ex:  # noqa: BLE001 (the step failed: its requests end, others go on)
            for e in entries:
                self._error(e, ex)
            return
        step_s = time.perf_counter() - t_step
        now = self.clock()
        if a.measure and self.compiles.compiles == compiles:
            # a step that compiled a new shape measured the compile, not the arm: not
            # recorded, so the policy asks for this arm again
            self.core.decoded(now, _arm(len(seqs), a.micro_batches), step_s)
        else:
            self.core.decoded(now)
        with span(self.trace, SCHED, "emit", tokens=len(entries)):
            for e in entries:
                self._emit(e, now)
                if e.seq.done:
                    self._finish(e, e.seq.finish_reason)

    def _run_step(self, seqs: list[SeqState], micro_batches: int, measure: bool) -> None:
        """One decode step of seqs: plain, or dual-batch (micro_batches 2). A measured step
        runs traced, as the dual arm's does, so the two arms the policy compares carry the
        same tracing cost."""
        trace = TraceRecorder() if measure else self.engine_trace
        if micro_batches >= 2:
            dual_step(self.engine, list(split_micro_batches(seqs)), trace)
        elif measure:
            toks, rows, pos = self.engine.step_inputs(seqs)
            t0 = time.perf_counter()
            lg = self.engine.decode_rows(toks, rows, pos, self.engine.pool, trace, mode="pipelined")
            self.engine.take_step(seqs, lg, time.perf_counter() - t0)
        else:
            self.engine.step(seqs, trace)

    # ------------------------------------------------------------ endings

    def _do_cancel(self, rid: int) -> None:
        e = self._entries.get(rid)
        if e is None:  # already finished (or still in the inbox: cannot happen after step's swap)
            return
        if e.seq is not None and not e.seq.done:
            self.engine.cancel(e.seq)  # frees the pool row now (a background lane's copy is dropped)
        self._finish(e, "cancelled")

    def _error(self, e: _Entry, ex: BaseException) -> None:
        if e.seq is not None and not e.seq.done:
            self.engine.cancel(e.seq)
        self._finish(e, "error", f"{type(ex).__name__}: {ex}")

    def _finish(self, e: _Entry, reason: str, error: str | None = None) -> None:
        self.core.finish(e.req.id)
        e.lane = None
        if e.seq is not None:
            e.req.meta.setdefault("schedule", e.seq.schedule)
            e.req.meta.setdefault("prefill_s", e.seq.prefill_s)
        e.handle.finish(reason, self.clock(), error)
        self._entries.pop(e.req.id, None)

    def _fail_all(self, why: str) -> None:
        for e in list(self._entries.values()):
            self._error(e, RuntimeError(why))


__all__ = ["Scheduler"]
