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
`allowed_origins` names origins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults
from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, GuardPolicy, RequestGuard
from hmoe_jax.serve.metrics import ServerMetrics
from hmoe_jax.serve.request import Backend, RequestError, RequestHandle
from hmoe_jax.serve.servetrace import HTTP


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
    allowed_hosts: tuple[str, ...] | None = None  # `hmoe serve` sets it from the bound address
    allowed_origins: tuple[str, ...] = ()  # CORS origins; empty: no Access-Control-* headers
    generation: GenerationDefaults = NO_DEFAULTS  # generation_config.json's sampling defaults


@dataclasses.dataclass
class _Live:
    handle: RequestHandle
    arrival_s: float


class ServerState:
    """What the routes share: the backend, tokenizer, chat template, metrics, live requests.
    `healthy` and `kv_usage` are probes of the backend (kv_usage None: not known)."""

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
        trace: Any = None,
    ):
        self.backend, self.tokenizer, self.chat, self.opt = backend, tokenizer, chat, options
        self.trace = trace  # a TraceRecorder: each streamed token's wait / detok / send (servetrace.py)
        self.healthy, self.kv_usage, self.iterations = healthy, kv_usage, iterations
        self.metrics = ServerMetrics(options.model_name)
        self.live: dict[int, _Live] = {}
        self.draining = False
        self._retiring: set[asyncio.Task] = set()
        self._cancel_at: dict[int, int] = {}  # request id -> scheduler iteration of its cancel

    # ------------------------------------------------------------ admission

    def admit(self, ids: list[int], params: Any, arrival_s: float) -> RequestHandle:
        if self.draining:
            raise P.ApiError(503, "server is shutting down", type="service_unavailable", code="shutting_down")
        if len(self.live) >= self.opt.max_in_flight:
            raise P.ApiError(
                429,
                f"server is at its admission bound of {self.opt.max_in_flight} requests in flight; retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.opt.retry_after_s)},
            )
        try:
            h = self.backend.submit(ids, params)
        except ValueError as e:
            raise P.ApiError(400, str(e)) from None
        except RuntimeError as e:  # closed / no worker
            raise P.ApiError(503, str(e), type="service_unavailable") from None
        self.live[h.id] = _Live(h, arrival_s)
        return h

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
        if (kv := self.kv_usage()) is not None:
            m.kv_usage.set(kv)
        if (it := self.iterations()) is not None:
            m.iterations.set(it)


def _trace_token(tr: Any, h: RequestHandle, i: int, recv_ns: int, yield_ns: int, sent_ns: int | None) -> None:
    """Token i of h on the http track: wait (the scheduler emitted it -> the event loop took
    it), detok (text and chunk), send (the ASGI send until the generator resumed)."""
    emitted = h.request.token_s[i] if i < len(h.request.token_s) else None
    if emitted is not None:
        tr.add(HTTP, "wait", int(emitted * 1e9), recv_ns, request=h.id, token=i)
    tr.add(HTTP, "detok", recv_ns, yield_ns, request=h.id, token=i)
    if sent_ns is not None:
        tr.add(HTTP, "send", yield_ns, sent_ns, request=h.id, token=i)


def _error_response(e: P.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _until_disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


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
    guard = GuardPolicy(opt.api_key, opt.max_request_bytes, opt.allowed_hosts)
    app.add_middleware(RequestGuard, policy=guard, on_reject=state.metrics.reject)
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": opt.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "hmoe",
            "root": opt.root,
            "parent": None,
            "max_model_len": opt.max_model_len,
        }
        return {"object": "list", "data": [card]}

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
            ids = state.chat.encode(req.messages)
        else:
            ids = state.tokenizer.encode(req.prompt)
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
        if isinstance(req.prompt, str):
            ids = state.tokenizer.encode(req.prompt)
        else:
            ids = P.check_token_ids(req.prompt, opt.vocab_size, "prompt")
        return await _generate(request, req, ids, arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = _arrival(request)
        req = P.parse_body(P.ChatCompletionRequest, await request.body())
        check_model(req.model)
        ids = state.chat.encode(req.messages)
        return await _generate(request, req, ids, arrival, chat=True)

    async def _generate(
        request: Request, req: Any, ids: list[int], arrival: float, *, chat: bool
    ) -> Response:
        if not ids:
            raise P.ApiError(400, "the prompt encodes to no tokens", param="messages" if chat else "prompt")
        gen = opt.generation
        n_new = P.max_new_tokens(
            req, len(ids), opt.max_model_len, chat=chat, default_max_tokens=gen.max_new_tokens
        )
        try:
            params = P.sampling_params(req, n_new, gen)
        except ValueError as e:
            raise P.ApiError(400, str(e)) from None
        h = state.admit(ids, params, arrival)
        out = P.ResponseBuilder(
            opt.model_name, chat=chat, prompt_ids=ids, return_token_ids=req.return_token_ids
        )
        text = P.TextStream(state.tokenizer.decode, P.stop_strings(req))
        if req.stream:
            so = req.stream_options or P.StreamOptions()
            return StreamingResponse(_stream(h, out, text, so, chat), media_type="text/event-stream")
        return await _whole(request, h, out, text)

    async def _whole(
        request: Request, h: RequestHandle, out: P.ResponseBuilder, text: P.TextStream
    ) -> Response:
        recv_s: list[float] = []

        async def consume() -> None:
            async for tok in h.astream():
                recv_s.append(time.perf_counter())
                text.push(tok)
                if text.stopped:
                    state.cancel(h)
                    return
            text.finish()

        task = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_until_disconnected(request))
        reason, err = "abort", None
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # raises RequestError if the request failed
                reason = "stop" if text.stopped else (h.request.finish_reason or "abort")
        except RequestError as e:
            err, reason = str(e), "error"
        finally:
            for t in (task, watch):
                t.cancel()
            if not h.done:
                state.cancel(h)
            state.retire(h, recv_s, reason)
        if err is not None:
            raise P.ApiError(500, err, type="internal_server_error")
        if reason == "abort":
            return Response(status_code=499)  # the client went away: nobody reads this
        return JSONResponse(out.full(text.text, text.ids, reason))

    async def _stream(
        h: RequestHandle, out: P.ResponseBuilder, text: P.TextStream, so: P.StreamOptions, chat: bool
    ) -> AsyncIterator[str]:
        usage_every = so.include_usage and so.continuous_usage_stats
        pending: list[int] = []  # token ids not yet sent (their text may still be held back)
        recv_s: list[float] = []
        first, reason = True, None
        stop_delta = ""  # text the stopping token carried before its stop string

        def chunk(delta: str, finish: str | None) -> str:
            nonlocal first, pending
            body = out.chunk(
                delta,
                pending,
                finish,
                role=chat and first,
                usage_now=P.usage(len(out.prompt_ids), len(text.ids)) if usage_every else None,
                with_usage=so.include_usage,
            )
            first, pending = False, []
            return P.sse(body)

        tr = state.trace
        try:
            try:
                async for tok in h.astream():
                    recv_s.append(time.perf_counter())
                    t_recv = time.perf_counter_ns()
                    pending.append(tok)
                    delta = text.push(tok)
                    if text.stopped:
                        state.cancel(h)
                        stop_delta = delta
                        break
                    if delta:
                        body = chunk(delta, None)
                        t_yield = time.perf_counter_ns()
                        yield body
                        if tr is not None:
                            _trace_token(tr, h, len(recv_s) - 1, t_recv, t_yield, time.perf_counter_ns())
                    elif tr is not None:
                        _trace_token(tr, h, len(recv_s) - 1, t_recv, time.perf_counter_ns(), None)
                tail = stop_delta if text.stopped else text.finish()
                reason = "stop" if text.stopped else (h.request.finish_reason or "abort")
                yield chunk(tail, reason)
                if so.include_usage:
                    yield P.sse(out.usage_chunk(len(text.ids)))
            except RequestError as e:
                reason = "error"
                yield P.sse(P.ApiError(500, str(e), type="internal_server_error").body())
            yield P.SSE_DONE
        finally:  # also on a client disconnect (Starlette cancels this generator)
            if not h.done:
                state.cancel(h)
            state.retire(h, recv_s, reason or "abort")

    return app


__all__ = ["ServeOptions", "ServerState", "create_app"]
