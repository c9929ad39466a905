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
request's pool row is freed in the iteration that sees the cancel. An action that fails
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

from hmoe_jax.engine.dual import dual_step, split_micro_batches
from hmoe_jax.engine.engine import Engine, SeqState
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.policies.base import Chunk, Decode, Policy, Prefill
from hmoe_jax.policies.core import CoreRunner, RequestState, ServingCore
from hmoe_jax.policies.registry import DEFAULT_POLICY, get_policy
from hmoe_jax.serve.request import Request, RequestHandle, new_request


@dataclasses.dataclass
class _Entry:
    """The runner's side of a request (its state lives in the core)."""

    handle: RequestHandle
    seq: SeqState | None = None
    lane: Any = None  # background prefill: (thread, result dict)

    @property
    def req(self) -> Request:
        return self.handle.request


class Scheduler(CoreRunner):
    """Options: policy (a registered name or a Policy), **policy_options; trace (a
    TraceRecorder every step records into: Perfetto); clock (seconds; perf_counter).

    The request lifecycle, the View and the decision are the serving core's
    (policies/core.py, shared with the P/D coordinator and the simulator); this class is
    its runner on the engine."""

    def __init__(
        self,
        engine: Engine,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        trace: TraceRecorder | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **policy_options: Any,
    ):
        self.engine = engine
        policy = get_policy(policy, **policy_options) if isinstance(policy, str) else policy
        self.core = ServingCore(policy, engine.devices)
        self.trace, self.clock = trace, clock
        self._lock = threading.Condition()
        self._inbox: list[_Entry] = []
        self._cancels: list[int] = []
        self._entries: dict[int, _Entry] = {}
        self._lanes: dict[tuple[int, ...], Engine] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

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
        e = _Entry(RequestHandle(req, self._cancel))
        with self._lock:
            self._inbox.append(e)
            self._lock.notify_all()
        return e.handle

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

    def step(self) -> bool:
        """One iteration; returns whether anything ran."""
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for e in new:
            self._entries[e.req.id] = e
            self.core.add(e.req.id, int(e.req.prompt.size), e.req.submitted_s)
        for rid in cancels:
            self._do_cancel(rid)
        ran = self._adopt_background()
        actions = self.core.decide(self.clock(), len(self.engine.pool.free_rows))
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
                with self._lock:
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
            self.engine.prefill_seq(seq, a.schedule, trace=self.trace)
        except Exception as ex:  # noqa: BLE001 (reported on the request; the loop goes on)
            self._error(e, ex)
            return
        self._prefilled(e)

    def _chunk(self, a: Chunk) -> None:
        e = self._entries[a.request]
        try:
            seq = e.seq if e.seq is not None else self._admit(e)
            e.req.schedule = "cpu (chunked)"
            done = self.engine.prefill_seq(seq, "cpu", a.end, trace=self.trace)
        except Exception as ex:  # noqa: BLE001
            self._error(e, ex)
            return
        self.core.chunked(a.request, int(seq.prompt.size) if done else int(seq.pos))
        if done:
            self._prefilled(e)

    def _prefilled(self, e: _Entry) -> None:
        """The first token exists: stream it; the request decodes from the next iteration."""
        seq = e.seq
        e.handle.emit(seq.tokens[-1], self.clock())
        self.core.decoding(e.req.id)
        if seq.done:
            self._finish(e, seq.finish_reason)

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
                logits, run, secs, plan = lane.prefill(ids, cache, a.schedule, row=0)
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
            self.engine.first_token(seq, out["logits"], out["ttft_s"])
            self._prefilled(e)
        return ran

    def _decode(self, a: Decode) -> None:
        entries = [self._entries[r] for r in a.requests]
        seqs = [e.seq for e in entries]
        # a measured step runs traced, as the dual arm's does, so the two arms the policy
        # compares carry the same tracing cost
        trace = TraceRecorder() if a.measure else self.trace
        t_step = time.perf_counter()
        try:
            if a.micro_batches >= 2:
                dual_step(self.engine, list(split_micro_batches(seqs)), trace)
            elif a.measure:
                toks, rows, pos = self.engine.step_inputs(seqs)
                t0 = time.perf_counter()
                lg = self.engine.decode_rows(toks, rows, pos, self.engine.pool, trace, mode="pipelined")
                self.engine.take_step(seqs, lg, time.perf_counter() - t0)
            else:
                self.engine.step(seqs, trace)
        except Exception as ex:  # noqa: BLE001 (the step failed: its requests end, others go on)
            for e in entries:
                self._error(e, ex)
            return
        now = self.clock()
        if a.measure:
            arm = (len(seqs), 2 if a.micro_batches >= 2 and len(seqs) >= 2 else 1)
            self.core.decoded(now, arm, time.perf_counter() - t_step)
        else:
            self.core.decoded(now)
        for e in entries:
            e.handle.emit(e.seq.tokens[-1], now)
            if e.seq.done:
                self._finish(e, e.seq.finish_reason)

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
