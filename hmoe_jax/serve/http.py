"""The OpenAI-compatible HTTP app of `hmoe serve` (FastAPI on uvicorn, as vLLM and SGLang):

  POST /v1/completions, /v1/chat/completions   (whole response, or SSE ending in data: [DONE])
  GET  /v1/models   GET /health (200 / 503)   GET /metrics (Prometheus)
  POST /tokenize, /detokenize                  (vLLM's shapes)

Every request goes through a request Backend (serve/request.py: the in-process Scheduler or
the P/D coordinator). Bad input is a 4xx with OpenAI's nested error object naming the field
(openai_protocol.py). Admission is bounded: past `max_in_flight` accepted-and-unfinished
requests, a 429 with Retry-After is answered at once, before any tokenization. A client that
disconnects has its request cancelled (the scheduler frees its KV row the next iteration);
the request still counts as in flight until the backend has finished it, so the admission
count and the gauges never run ahead of the KV it holds. Before any route, the request guard
(serve/guard.py) checks Host, API key, Content-Type and body size; CORS is off unless
`allowed_origins` names origins. Generation (choices, whole / streamed answers) is in
serve/http_generate.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults
from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_UPLOAD_TIMEOUT_S,
    GuardPolicy,
    RequestGuard,
)
from hmoe_jax.serve.http_generate import generate
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
        chat: P.ChatTemplate,
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
        self.check_room()
        try:
            h = self.backend.submit(ids, params)
        except ValueError as e:
            raise P.ApiError(400, str(e)) from None
        except RuntimeError as e:  # closed / no worker
            raise P.ApiError(503, str(e), type="service_unavailable") from None
        self.live[h.id] = _Live(h, arrival_s)
        return h

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
        self.check_room(len(params))
        try:
            hs = self.backend.submit_group(ids, params)
        except ValueError as e:
            raise P.ApiError(400, str(e)) from None
        except RuntimeError as e:  # closed / no worker
            raise P.ApiError(503, str(e), type="service_unavailable") from None
        for h in hs:
            self.live[h.id] = _Live(h, arrival_s)
        return hs

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


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` (a string, token ids, or a list of either) as a list of prompts."""
    if isinstance(prompt, str) or not isinstance(prompt[0], (str, list)):
        return [prompt]
    return list(prompt)


def _error_response(e: P.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _ArrivalTime:
    """ASGI middleware: stamp each request's arrival (perf_counter) the moment uvicorn hands
    it over, before its body is read or routed: TTFT, queue and e2e count from there."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_s"] = time.perf_counter()
        await self.app(scope, receive, send)


def _arrival(request: Request) -> float:
    return request.scope.get("state", {}).get("arrival_s") or time.perf_counter()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hmoe serve", docs_url=None, redoc_url=None, openapi_url=None)
    opt = state.opt
    # add_middleware: the last added runs first. Arrival stamp, then CORS (a preflight is
    # answered and a refusal still carries the CORS headers a browser needs to read it),
    # then the guard, before any route reads the body.
    guard = GuardPolicy(opt.api_key, opt.max_request_bytes, opt.allowed_hosts, opt.upload_timeout_s)
    app.add_middleware(
        RequestGuard,
        policy=guard,
        on_reject=state.metrics.reject,
        # a full server refuses a generation request before reading its body (a 4 MB prompt
        # is not uploaded, parsed and tokenized to be told 429)
        before_body=lambda path: state.room_error() if path in GENERATION_PATHS else None,
    )
    if opt.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(opt.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(_ArrivalTime)
    app.state.hmoe = state

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, e: P.ApiError) -> JSONResponse:
        state.metrics.reject(e.status)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            e.status_code, "invalid_request_error"
        )
        err = P.ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind)
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        err = P.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="internal_server_error")
        return _error_response(err)

    def check_model(name: str | None) -> None:
        if name is not None and name != opt.model_name:
            raise P.ApiError(
                404,
                f"The model {name!r} does not exist; this server serves {opt.model_name!r}",
                param="model",
                type="invalid_request_error",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        if getattr(state, "warming", False):  # bound, still compiling (http_server.serve)
            msg = "the server is warming up (compiling its shapes); retry shortly"
            err = {"message": msg, "type": "service_unavailable", "param": None, "code": "warming"}
            return JSONResponse({"status": "warming", "error": err}, status_code=503)
        if state.healthy():
            return Response(status_code=200)
        return _error_response(P.ApiError(503, "a backend worker is not live", type="service_unavailable"))

    def card() -> dict[str, Any]:
        return {
            "id": opt.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "hmoe",
            "root": opt.root,
            "parent": None,
            "max_model_len": opt.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card()

    @app.get("/metrics")
    async def metrics() -> Response:
        state.refresh_gauges()
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = P.parse_body(P.TokenizeRequest, await request.body())
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await state.ingest.encode_chat(req.messages, fit=False)
        else:
            ids = await state.ingest.encode(req.prompt, fit=False)
            bos = getattr(state.tokenizer, "BOS", getattr(state.tokenizer, "bos_id", None))
            if not req.add_special_tokens and bos is not None and ids[:1] == [bos]:
                ids = ids[1:]
        return {"count": len(ids), "max_model_len": opt.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = P.parse_body(P.DetokenizeRequest, await request.body())
        check_model(req.model)
        ids = P.check_token_ids(req.tokens, opt.vocab_size, "tokens")
        return {"prompt": state.tokenizer.decode(ids)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = _arrival(request)
        req = P.parse_body(P.CompletionRequest, await request.body())
        check_model(req.model)
        prompts = _completion_prompts(req.prompt)
        if len(prompts) * req.n <= opt.max_in_flight:  # else generate()'s 400 says why
            state.check_room(len(prompts) * req.n)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await state.ingest.encode_many(texts)) if texts else iter(())
        jobs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                jobs.append((next(encoded), p))
            else:
                param = (
                    "prompt" if len(prompts) == 1 and not isinstance(req.prompt[0], list) else f"prompt.{i}"
                )
                ids = P.check_token_ids(p, opt.vocab_size, param)
                jobs.append((ids, None))
        return await generate(state, request, req, jobs, arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = _arrival(request)
        req = P.parse_body(P.ChatCompletionRequest, await request.body())
        check_model(req.model)
        if req.n <= opt.max_in_flight:
            state.check_room(req.n)
        ids = await state.ingest.encode_chat(req.messages, tools=req.tool_dicts())
        return await generate(state, request, req, [(ids, None)], arrival, chat=True)

    return app


__all__ = ["ServeOptions", "ServerState", "create_app"]


def _same_prompt(jobs: list[tuple[list[int], Any]]) -> list[tuple[list[int], list[int]]]:
    """The jobs' distinct prompts, first-seen order, each with the indices of its jobs (the
    n samples of one prompt, and a prompt repeated in a list, share one prefill)."""
    at: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    for i, (ids, _) in enumerate(jobs):
        at.setdefault(tuple(ids), (ids, []))[1].append(i)
    return list(at.values())
