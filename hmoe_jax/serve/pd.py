"""Intra-node prefill/decode disaggregation (the paper's technique 3, second half): a
prefill worker and a decode worker as separate OS processes (serve/pd_worker.py), each on
its own accelerator(s), both mapping ONE host copy of the weights (the shared arena), and
this coordinator in the calling process, a request Backend like the in-process Scheduler:

    pd = PDCoordinator(checkpoint_dir, engine={"precision": "bf16"}).wait_ready()
    h = pd.submit(prompt_ids, SamplingParams(max_new_tokens=64))
    print(list(h), h.request.meta["handover_s"])
    pd.close()

P/D is a policy-driven mode like the in-process Scheduler: the request lifecycle, the View
and the decision are the serving core's (policies/core.py), and this coordinator is its
runner on the two workers. A request: queued -> the policy's Prefill runs on the prefill
worker (whole prompt, the action's schedule, first token sampled there) -> its latent KV
handed over through a shm segment (serve/kvshm.py; the segment is named here, so it can be
discarded even when a worker dies holding it) -> decode worker (continuous batching: every
adopted request in each step, so the policy's Decode actions need nothing sent). The policy
is asked when the prefill worker is idle and a request waits (as the Scheduler waits for a
foreground prefill), so a long prefill never stalls running decodes (they are in another
process, on another accelerator). A policy that may ask for what the workers cannot run
(chunks, multi-accelerator prefills, dual-batch or measured decode steps: the paper policy)
is refused at construction (policies/core.check_pd_policy). The default, fcfs with
schedule/decode_cap, is what this module ran before policies drove it.

Failure: one thread waits on both workers' sockets, and a process's death closes its end,
so a worker's death is seen as it happens (no heartbeat period). Its in-flight requests end with an error naming
the worker, its segments are discarded, and it is restarted; queued requests wait for it.
A worker that fails to start (bad checkpoint, no device) fails the queue with its message
and is not restarted. Cancel: queued -> dropped; in prefill -> its segment is discarded
when the first token comes back; in decode -> the decode worker frees the row before its
next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, Pipe
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from hmoe_jax.io.arena import DATA_NAME, arena_config, ensure_arena, is_arena, mapped_kb
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.policies.base import Decode, Policy, Prefill
from hmoe_jax.policies.core import (
    PLAIN_ACTIONS,
    CoreRunner,
    RequestState,
    ServingCore,
    action_kinds,
    check_pd_policy,
)
from hmoe_jax.policies.registry import get_policy
from hmoe_jax.serve import kvshm
from hmoe_jax.serve.pd_worker import WorkerSpec
from hmoe_jax.serve.request import Request, RequestHandle, new_request

ROLES = ("prefill", "decode")
_tags = itertools.count()
log = logging.getLogger(__name__)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        name = _signal_name(-code)
        return f"killed by {name}" if name.startswith("SIG") else f"killed by signal {name}"
    return f"exit code {code}"


def _signal_name(num: int) -> str:
    """SIGKILL for 9; the number itself for one Python has no name for."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _gpu_count() -> int:
    """GPUs on this host, without starting jax here (the workers own the devices)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@dataclasses.dataclass
class _Worker:
    spec: WorkerSpec
    proc: Any = None
    conn: Any = None
    state: str = "down"  # starting | ready | failed | down
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    restarts: int = 0
    deaths: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Entry:
    """The runner's side of a request (its state lives in the core)."""

    handle: RequestHandle
    segment: str = ""
    cancelled: bool = False  # cancelled while its prompt was on the prefill worker


class PDCoordinator(CoreRunner):
    """Options: policy (a registered name or a Policy; default fcfs) and its options
    (**policy_options: fcfs takes schedule, the prefill worker's "auto" / "slp" / "cpu" /
    ..., and decode_cap, sequences decoded together), prefill_devices / decode_devices
    (accelerators each worker owns: stand-in CPU devices without GPUs), gpu_ids
    ({"prefill": (0,), "decode": (1,)}; default on a GPU host: the first GPUs to prefill,
    the next to decode), engine (Engine options for both workers: one precision, or the KV
    will not fit; max_batch defaults to the policy's decode_cap), max_restarts,
    touch_weights (fault every weight page in, for PSS measurements), warm_up (each worker compiles
    what its role runs before it reports ready, also after a restart). A policy P/D cannot
    run raises PolicyError naming what it asks for."""

    def __init__(
        self,
        checkpoint: str | Path,
        policy: str | Policy = "fcfs",
        *,
        prefill_devices: int = 1,
        decode_devices: int = 1,
        gpu_ids: dict[str, tuple[int, ...]] | None = None,
        engine: dict[str, Any] | None = None,
        max_restarts: int = 5,
        touch_weights: bool = False,
        warm_up: bool = True,
        **policy_options: Any,
    ):
        policy = get_policy(policy, **policy_options) if isinstance(policy, str) else policy
        check_pd_policy(policy)
        root = Path(checkpoint)
        self.arena = str(root if is_arena(root) else ensure_arena(root, progress=False))
        self.cfg = arena_config(self.arena)
        opts = dict(engine or {})
        decode_cap = int(policy.options.get("decode_cap", opts.get("max_batch") or 8))
        opts.setdefault("max_batch", decode_cap)
        if opts["max_batch"] < decode_cap:
            raise ValueError(f"engine max_batch={opts['max_batch']} < decode_cap={decode_cap}")
        self.max_len = int(opts.get("max_len") or 4096)
        self.max_batch, self.max_restarts = int(opts["max_batch"]), int(max_restarts)
        # the policy's accelerators: the prefill worker's lane and the decode worker's
        self.core = ServingCore(policy, 2)
        self.tag = f"{os.getpid()}x{next(_tags)}"
        devs = {"prefill": prefill_devices, "decode": decode_devices}
        if gpu_ids is None and _gpu_count() >= prefill_devices + decode_devices:
            # A GPU host: the prefill worker owns the first GPUs, the decode worker the next.
            gpu_ids = {"prefill": tuple(range(prefill_devices)),
                       "decode": tuple(range(prefill_devices, prefill_devices + decode_devices))}  # fmt: skip
        self.workers = {
            r: _Worker(
                WorkerSpec(r, self.arena, devs[r], (gpu_ids or {}).get(r), opts, touch_weights, warm_up)
            )
            for r in ROLES
        }
        self._lock = threading.Condition()
        self._inbox: deque[_Entry] = deque()
        self._cancels: list[int] = []
        self._entries: dict[int, _Entry] = {}
        self._in_prefill: int | None = None
        self._stats: dict[str, dict[str, Any]] = {}
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._closed = False
        self.handovers: list[dict[str, Any]] = []  # per request: bytes, export / import / total s
        for w in self.workers.values():
            self._spawn(w)
        self._thread = threading.Thread(target=self._loop, name="hmoe-pd", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API

    def submit(self, prompt_ids: Any, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request; bad input raises ValueError here, naming the problem."""
        if self._closed:
            raise RuntimeError("P/D coordinator is closed")
        req = new_request(self.cfg, prompt_ids, params, self.max_len, time.perf_counter(), "the workers'")
        if req.params.structured is not None:
            # the grammar matcher would have to follow the sequence into the decode worker
            raise ValueError("response_format json_object / json_schema is not supported with --pd yet")
        e = _Entry(RequestHandle(req, self._cancel))
        with self._lock:
            self._inbox.append(e)
        self._wake()
        return e.handle

    def wait_ready(self, timeout_s: float = 600.0) -> PDCoordinator:
        """Block until both workers are up (RuntimeError naming a worker that failed)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                failed = [w for w in self.workers.values() if w.state == "failed"]
                if failed:
                    raise RuntimeError(failed[0].info.get("error", "worker failed"))
                if all(w.state == "ready" for w in self.workers.values()):
                    return self
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"P/D workers not ready after {timeout_s} s")
                self._lock.wait(min(left, 0.5))

    @property
    def healthy(self) -> bool:
        return all(w.state == "ready" for w in self.workers.values())

    def restarts(self) -> dict[str, int]:
        """{role: times its worker was restarted after dying} (hmoe:worker_restarts_total)."""
        return {r: w.restarts for r, w in self.workers.items()}

    def pid(self, role: str) -> int | None:
        p = self.workers[role].proc
        return None if p is None else p.pid

    def stats(self, role: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The worker's own view (free pool rows, active sequences): no orphaned KV checks."""
        with self._lock:
            self._stats.pop(role, None)
            w = self.workers[role]
            if w.state != "ready":
                raise RuntimeError(f"{role} worker is {w.state}")
            w.conn.send(("stats",))
            if not self._lock.wait_for(lambda: role in self._stats, timeout_s):
                raise TimeoutError(f"{role} worker did not answer stats in {timeout_s} s")
            return self._stats.pop(role)

    def weight_pss(self) -> dict[str, Any]:
        """Rss / Pss (kB) of each worker's mapping of the arena data file and the pair's
        Pss over one copy (the file size): <= ~1 when they share pages, ~2 with copies."""
        data = os.path.join(self.arena, DATA_NAME)
        size_kb = os.path.getsize(data) / 1024
        per = {r: mapped_kb(self.pid(r), data) for r in ROLES}
        return {
            "arena_kb": size_kb,
            "workers": per,
            "pss_ratio": sum(u["Pss"] for u in per.values()) / size_kb,
            "rss_ratio": sum(u["Rss"] for u in per.values()) / size_kb,
            "zero_copy": {r: self.workers[r].info.get("arena_view_bytes", 0) for r in ROLES},
            "host_weight_bytes": {r: self.workers[r].info.get("host_weight_bytes", 0) for r in ROLES},
        }

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(timeout=30)
        for w in self.workers.values():
            self._stop(w)
        kvshm.discard_all(kvshm.segment_name(self.tag, ""))  # segments of ours nobody adopted
        with self._lock:
            for e in list(self._entries.values()) + list(self._inbox):
                self._end(e, "cancelled")

    def __enter__(self) -> PDCoordinator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ workers

    def _spawn(self, w: _Worker) -> None:
        # A fresh interpreter (never fork a process that runs jax threads) on one end of a
        # socketpair: its death closes the socket, which wakes the loop at once.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "hmoe_jax.serve.pd_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        w.conn = Connection(ours.detach())
        w.conn.send(w.spec)
        w.state, w.info = "starting", {}

    def _stop(self, w: _Worker) -> None:
        if w.proc is None:
            return
        try:
            w.conn.send(("stop",))
        except (OSError, ValueError):
            pass
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait(timeout=5)
        w.conn.close()
        w.state = "down"

    def _died(self, w: _Worker) -> None:
        """A worker process ended: fail its requests, discard their segments, restart it."""
        role = w.spec.role
        try:
            w.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:  # its socket closed but it lingers: make sure
            w.proc.kill()
            w.proc.wait(timeout=5)
        why = f"{role} worker (pid {w.proc.pid}) died ({_exit_text(w.proc.returncode)})"
        w.deaths.append({"t_s": time.perf_counter(), "why": why})
        w.conn.close()
        lost = []
        if role == "prefill" and self._in_prefill is not None:
            lost, self._in_prefill = [self._in_prefill], None
        elif role == "decode":
            lost = self.core.in_state(RequestState.DECODING)
        for rid in lost:
            e = self._entries[rid]
            kvshm.discard(e.segment)
            self._end(e, "error", f"{why}; the request was lost and the worker is being restarted")
        code = w.proc.returncode
        # one line for operators: role, pid, the signal (or exit code), what happens next
        how = f"signal {_signal_name(-code)}" if code is not None and code < 0 else _exit_text(code)
        died = f"{role} worker pid {w.proc.pid} died ({how})"
        lost_text = f", {len(lost)} request(s) lost" if lost else ""
        if w.state == "starting" and not w.info:
            w.state = "failed"
            w.info["error"] = why + " while starting"
            log.error("%s while starting%s; not restarted", died, lost_text)
            self._fail_queue(w.info["error"])
        elif self._closed or w.restarts >= self.max_restarts:
            w.state = "failed"
            w.info["error"] = f"{why}; not restarted (restarts: {w.restarts})"
            log.error(
                "%s%s; not restarted (restarts: %d of %d)", died, lost_text, w.restarts, self.max_restarts
            )
            self._fail_queue(w.info["error"])
        else:
            w.restarts += 1
            log.warning("%s%s; restarting (restart %d of %d)", died, lost_text, w.restarts, self.max_restarts)
            self._spawn(w)
        self._lock.notify_all()

    def _fail_queue(self, why: str) -> None:
        for rid in self.core.waiting():
            self._end(self._entries[rid], "error", why)

    # ------------------------------------------------------------ the loop

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"!")
        except OSError:
            pass

    def submit_group(self, prompt_ids: Any, params_list: list[SamplingParams]) -> list[RequestHandle]:
        """One request per params on one prompt, each submitted (and prefilled) on its own: the
        prefill worker hands each KV over separately, so P/D shares no prefill. All or none:
        a refused one cancels those already queued and the error is raised."""
        handles: list[RequestHandle] = []
        try:
            for params in params_list:
                handles.append(self.submit(prompt_ids, params))
        except Exception:
            for h in handles:
                h.cancel()
            raise
        return handles

    def _cancel(self, req: Request) -> None:
        with self._lock:
            self._cancels.append(req.id)
        self._wake()

    def _loop(self) -> None:
        while not self._closed:
            live = [w for w in self.workers.values() if w.state in ("starting", "ready")]
            objs = [self._wake_r, *(w.conn for w in live)]
            ready = mp_wait(objs, timeout=1.0)
            with self._lock:
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                for w in live:
                    if w.conn in ready:
                        self._drain(w)
                while self._inbox:
                    e = self._inbox.popleft()
                    self._entries[e.handle.id] = e
                    req = e.handle.request
                    self.core.add(req.id, int(req.prompt.size), req.submitted_s)
                cancels, self._cancels = self._cancels, []
                for rid in cancels:
                    self._do_cancel(rid)
                self._decide()

    def _drain(self, w: _Worker) -> None:
        """Read every message the worker sent (what it said before it died still counts);
        a closed socket is its death."""
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            self._died(w)

    def _on_message(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.state, w.info = "ready", msg[1]
            if w.restarts:
                log.warning(
                    "%s worker restarted: pid %d ready (restart %d of %d)",
                    w.spec.role, w.proc.pid, w.restarts, self.max_restarts,
                )  # fmt: skip
            self._lock.notify_all()
        elif kind == "fatal":
            w.state, w.info = "failed", {"error": msg[1]}
            self._fail_queue(msg[1])
            self._lock.notify_all()
        elif kind == "stats":
            self._stats[w.spec.role] = msg[1]
            self._lock.notify_all()
        elif kind == "error":
            rid = msg[1]
            if self._in_prefill == rid:
                self._in_prefill = None
            e = self._entries.get(rid)
            if e is not None:
                kvshm.discard(e.segment)
                self._end(e, "error", f"{w.spec.role} worker: {msg[2]}")
        elif kind == "first":
            self._on_first(*msg[1:])
        elif kind == "adopted":
            rid, info = msg[1], msg[2]
            h = next(x for x in reversed(self.handovers) if x["rid"] == rid)
            h.update(import_s=info["import_s"], total_s=info["adopted_s"] - h["created_s"])
            e = self._entries.get(rid)
            if e is not None:
                e.handle.request.meta.update(handover_s=h["total_s"], import_s=info["import_s"])
        elif kind == "tokens":
            for rid, tok, t_s, reason, lp in msg[1]:
                e = self._entries.get(rid)
                if e is None or rid not in self.core or self.core[rid].state != RequestState.DECODING:
                    continue
                self.core.decoded(t_s)
                e.handle.emit(tok, t_s, lp)
                if reason is not None:
                    self._end(e, reason, t_s=t_s)

    def _on_first(
        self,
        rid: int,
        tok: int,
        t_s: float,
        reason: str | None,
        meta: Any,
        info: dict,
        lp: Any,
        prompt_lps: Any,
    ) -> None:
        self._in_prefill = None
        e = self._entries.get(rid)
        if e is None or e.cancelled:
            if meta is not None:
                kvshm.discard(meta.name)  # nobody will adopt it
            self._entries.pop(rid, None)
            return
        req = e.handle.request
        req.started_s, req.schedule = info["started_s"], info["schedule"]
        req.meta.update(prefill_s=info["prefill_s"], schedule=info["schedule"])
        req.prompt_logprobs = prompt_lps  # before the first token: a stream reads it then
        e.handle.emit(tok, t_s, lp)
        if reason is not None:
            self._end(e, reason, t_s=t_s)
            return
        self.handovers.append(
            {"rid": rid, "kv_bytes": meta.nbytes, "tokens": meta.tokens, "export_s": meta.export_s,
             "created_s": meta.created_s}
        )  # fmt: skip
        req.meta.update(kv_bytes=meta.nbytes, export_s=meta.export_s)
        d = self.workers["decode"]
        if d.state != "ready":
            kvshm.discard(meta.name)
            self._end(e, "error", f"decode worker is {d.state}; the request's KV was dropped")
            return
        self.core.decoding(rid)
        d.conn.send(("adopt", rid, req.prompt, req.params, tok, meta))

    def _decide(self) -> None:
        """Ask the policy when a request waits, the prefill worker is idle and both workers
        are up; run its Prefill on the prefill worker. Its Decode needs nothing: the decode
        worker steps every adopted request (the policy's cap bounds what it admits)."""
        p = self.workers["prefill"]
        if self._in_prefill is not None or p.state != "ready" or not self.core.waiting():
            return
        if self.workers["decode"].state != "ready":
            return
        for a in self.core.decide(time.perf_counter(), self.max_batch - self.core.rows_held):
            busy = isinstance(a, Prefill) and self._in_prefill is not None
            if busy or not action_kinds(a) <= PLAIN_ACTIONS:
                # only a policy that does not declare what it emits gets here (check_pd_policy)
                why = (
                    f"P/D: policy {self.policy.name!r} asked for {a}; the workers prefill whole prompts one "
                    "at a time on the prefill worker and decode every request in one plain step"
                )
                for rid in a.requests if isinstance(a, Decode) else (a.request,):
                    if rid in self._entries:
                        self._end(self._entries[rid], "error", why)
            elif isinstance(a, Prefill):
                self._prefill(self._entries[a.request], a)

    def _prefill(self, e: _Entry, a: Prefill) -> None:
        rid = a.request
        self.core.admit(rid)  # its row on the decode side, from now on
        self.core.prefilling(rid, background=True)
        e.segment = kvshm.segment_name(self.tag, rid)
        self._in_prefill = rid
        e.handle.request.started_s = time.perf_counter()
        req = e.handle.request
        self.workers["prefill"].conn.send(("prefill", rid, req.prompt, req.params, e.segment, a.schedule))

    def _do_cancel(self, rid: int) -> None:
        e = self._entries.get(rid)
        if e is None or rid not in self.core:
            return
        state = self.core[rid].state
        if state == RequestState.PREFILLING:
            e.cancelled = True  # _on_first discards the segment when the prompt is done
        elif state == RequestState.DECODING and self.workers["decode"].state == "ready":
            self.workers["decode"].conn.send(("cancel", rid))
        self._end(e, "cancelled", keep=state == RequestState.PREFILLING)

    def _end(self, e: _Entry, reason: str, error: str | None = None, *, t_s: float | None = None, keep=False):
        """The request ends (it leaves the core); keep: its entry stays until the prefill
        worker returns its first token (the segment is discarded then)."""
        self.core.finish(e.handle.id)
        e.handle.finish(reason, time.perf_counter() if t_s is None else t_s, error)
        if not keep:
            self._entries.pop(e.handle.id, None)


__all__ = ["PDCoordinator", "ROLES"]
