"""What the HTTP routes of `hmoe serve` share (serve/http.py builds the app, serve/http_generate.py
answers generation requests): the server's options, its backend, tokenizer, chat template,
metrics and live requests, and admission (the in-flight bound, all-or-nothing groups)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults
from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_UPLOAD_TIMEOUT_S
from hmoe_jax.serve.ingest import Ingest
from hmoe_jax.serve.metrics import ServerMetrics
from hmoe_jax.serve.openai_logprobs import LogprobFormatter
from hmoe_jax.serve.request import Backend, RequestError, RequestHandle


@dataclasses.dataclass
class ServeOptions:
    model_name: str
    root: str  # the checkpoint the model came from (/v1/models "root")
    vocab_size: int
    max_model_len: int  # prompt + completion tokens per request (the KV row length)
    max_in_flight: int = 64  # admission bound: accepted, unfinished requests
    retry_after_s: int = 1
    # the request guard (serve/guard.py): None here means no key / any Host / no CORS
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S  # the whole body, from the request's head
    allowed_hosts: tuple[str, ...] | None = None  # `hmoe serve` sets it from the bound address
    allowed_origins: tuple[str, ...] = ()  # CORS origins; empty: no Access-Control-* headers
    generation: GenerationDefaults = NO_DEFAULTS  # generation_config.json's sampling defaults
    eos_ids: tuple[int, ...] = ()  # the model's eos ids: stop_token_ids are added to them
    reasoning_parser: str | None = None  # "deepseek_r1": reasoning_content apart (serve/reasoning.py)


@dataclasses.dataclass
class _Live:
    handle: RequestHandle
    arrival_s: float


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class ServerState:
    """What the routes share: the backend, tokenizer, chat template, metrics, live requests.
    `healthy`, `kv_usage`, `iterations` and `worker_restarts` are probes of the backend (None:
    not known or not applicable; the metric is then absent from /metrics, not 0);
    worker_restarts: {role: restarts so far} of a backend with worker processes (P/D)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        chat: ChatTemplate,
        options: ServeOptions,
        *,
        healthy: Callable[[], bool] = lambda: True,
        kv_usage: Callable[[], float | None] = lambda: None,
        iterations: Callable[[], int | None] = lambda: None,
        worker_restarts: Callable[[], dict[str, int] | None] = lambda: None,
        trace: Any = None,
    ):
        self.backend, self.tokenizer, self.chat, self.opt = backend, tokenizer, chat, options
        self.trace = trace  # a TraceRecorder: each streamed token's wait / detok / send (servetrace.py)
        self.healthy, self.kv_usage, self.iterations = healthy, kv_usage, iterations
        self.worker_restarts = worker_restarts
        self.metrics = ServerMetrics(options.model_name)
        self.logprobs = LogprobFormatter(tokenizer.decode)
        self.ingest = Ingest(tokenizer, chat, options.max_model_len)  # text -> ids off the event loop
        self.live: dict[int, _Live] = {}
        self.draining = False
        self._retiring: set[asyncio.Task] = set()
        self._cancel_at: dict[int, int] = {}  # request id -> scheduler iteration of its cancel

    # ------------------------------------------------------------ admission

    def check_room(self, n: int = 1) -> None:
        """503 while draining, 429 when n more requests would pass the admission bound.
        Called before a generation request's body is read (the guard, through room_error),
        before its prompt is tokenized, and at admission (others may have come in meanwhile)."""
        if (e := self.room_error(n)) is not None:
            raise e

    def room_error(self, n: int = 1) -> P.ApiError | None:
        if self.draining:
            return P.ApiError(
                503, "server is shutting down", type="service_unavailable", code="shutting_down"
            )
        if len(self.live) + n > self.opt.max_in_flight:
            return P.ApiError(
                429,
                f"server is at its admission bound of {self.opt.max_in_flight} requests in flight; retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.opt.retry_after_s)},
            )

    def admit(self, ids: list[int], params: Any, arrival_s: float) -> RequestHandle:
        (h,) = self._submitted(lambda: [self.backend.submit(ids, params)], 1, arrival_s)
        return h

    def _submitted(
        self, submit: Callable[[], list[RequestHandle]], n: int, arrival_s: float
    ) -> list[RequestHandle]:
        """Room for n more (429 / 503), then the backend's submit: its ValueError (bad input
        found by the backend) a 400, its RuntimeError (closed, no worker) a 503; the handles
        join the live set."""
        self.check_room(n)
        try:
            hs = submit()
        except ValueError as e:
            raise P.ApiError(400, str(e)) from None
        except RuntimeError as e:  # closed / no worker
            raise P.ApiError(503, str(e), type="service_unavailable") from None
        for h in hs:
            self.live[h.id] = _Live(h, arrival_s)
        return hs

    def admit_all(self, jobs: list[tuple[list[int], Any]], arrival_s: float) -> list[RequestHandle]:
        """Admit every (prompt ids, params) of one HTTP request, or none: when one is refused,
        those already admitted are cancelled and the refusal is raised. The jobs of one prompt
        (its n samples, a prompt repeated in a list) go to the backend's submit_group where it
        has one (one prefill); the handles come back in job order."""
        handles: list[RequestHandle] = []
        groups = _same_prompt(jobs)
        try:
            for ids, at in groups:
                if len(at) > 1 and hasattr(self.backend, "submit_group"):
                    handles += self.admit_group(ids, [jobs[i][1] for i in at], arrival_s)
                else:
                    for i in at:
                        handles.append(self.admit(ids, jobs[i][1], arrival_s))
        except P.ApiError:
            for h in handles:
                self.cancel(h)
                self.retire(h, [], "abort")
            raise
        order = [i for _, at in groups for i in at]  # handles in job order again
        return [h for _, h in sorted(zip(order, handles), key=lambda ih: ih[0])]

    def admit_group(self, ids: list[int], params: list[Any], arrival_s: float) -> list[RequestHandle]:
        """Admit the requests of one prompt through the backend's submit_group (all or none):
        the Scheduler prefills the prompt once for all of them and forks it."""
        return self._submitted(lambda: self.backend.submit_group(ids, params), len(params), arrival_s)

    def cancel(self, h: RequestHandle) -> None:
        """Cancel a request nobody reads any more (client gone, stop string seen); the
        scheduler iterations until the backend has finished it go to a gauge."""
        if (it := self.iterations()) is not None:
            self._cancel_at[h.id] = it
        h.cancel()

    def retire(self, h: RequestHandle, recv_s: list[float], reason: str | None = None) -> None:
        """Leave the in-flight set once the backend has finished the request (now, or when
        the cancel it was just sent has been carried out), recording its metrics. recv_s:
        when the HTTP layer received each token it used (the response's tokens)."""
        if h.done:
            self._record(h, recv_s, reason)
            return
        t = asyncio.get_running_loop().create_task(self._retire_later(h, recv_s, reason))
        self._retiring.add(t)
        t.add_done_callback(self._retiring.discard)

    async def _retire_later(self, h: RequestHandle, recv_s: list[float], reason: str | None) -> None:
        try:
            async for _ in h.astream():
                pass
        except RequestError:
            pass
        self._record(h, recv_s, reason)

    def _record(self, h: RequestHandle, recv_s: list[float], reason: str | None) -> None:
        live = self.live.pop(h.id, None)
        if live is None:
            return
        at = self._cancel_at.pop(h.id, None)
        if at is not None and (it := self.iterations()) is not None:
            self.metrics.cancel_iterations.set(it - at)
        r = h.request
        reason = reason or {"cancelled": "abort"}.get(r.finish_reason or "", r.finish_reason or "abort")
        self.metrics.observe(
            arrival_s=live.arrival_s,
            started_s=r.started_s,
            token_s=recv_s,
            finished_s=r.finished_s,
            prompt_tokens=int(r.prompt.size),
            finished_reason=reason,
        )

    def refresh_gauges(self) -> None:
        running = waiting = 0
        for live in self.live.values():
            r = live.handle.request
            if r.done:
                continue
            if r.started_s is None:
                waiting += 1
            else:
                running += 1
        m = self.metrics
        m.running.set(running)
        m.waiting.set(waiting)
        m.in_flight.set(len(self.live))
        for gauge, value in ((m.kv_usage, self.kv_usage()), (m.iterations, self.iterations())):
            if value is None:
                gauge.clear()  # not known now: absent, not a stale or made-up value
            else:
                gauge.set(value)
        m.worker_restarts.clear()
        for role, n in (self.worker_restarts() or {}).items():
            m.worker_restarts.set(n, role)


def _same_prompt(jobs: list[tuple[list[int], Any]]) -> list[tuple[list[int], list[int]]]:
    """The jobs' distinct prompts, first-seen order, each with the indices of its jobs (the
    n samples of one prompt, and a prompt repeated in a list, share one prefill)."""
    at: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    for i, (ids, _) in enumerate(jobs):
        at.setdefault(tuple(ids), (ids, []))[1].append(i)
    return list(at.values())


__all__ = ["GENERATION_PATHS", "ServeOptions", "ServerState"]
