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

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.guard import GuardPolicy, RequestGuard
from hmoe_jax.serve.http_generate import generate
from hmoe_jax.serve.server_state import GENERATION_PATHS, ServeOptions, ServerState


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
