"""The generation half of the OpenAI HTTP app (serve/http.py holds the routes): a request's
prompts become choices (one backend request each, all admitted or none), answered whole or
as an SSE stream. Text goes through openai_protocol.TextStream (UTF-8-safe deltas, stop
strings); logprobs through openai_logprobs.LogprobFormatter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.chat_output import ChatOutput
from hmoe_jax.serve.request import RequestError, RequestHandle
from hmoe_jax.serve.servetrace import HTTP

if TYPE_CHECKING:
    from hmoe_jax.serve.server_state import ServerState


@dataclasses.dataclass
class _Choice:
    """One choice of a response: its request, text and what the HTTP layer has sent of it."""

    index: int
    handle: RequestHandle
    text: P.TextStream
    prompt_ids: list[int]
    echo: str | None  # completions `echo`: the prompt text put before the choice's text
    recv_s: list[float] = dataclasses.field(default_factory=list)  # when each token was received
    pending: list[int] = dataclasses.field(default_factory=list)  # token ids not yet sent
    sent: int = 0  # tokens already sent (streaming)
    text_offset: int = 0  # characters already sent (completions logprobs' text_offset)
    first: bool = True
    reason: str | None = None  # finish reason, once known
    post: ChatOutput | None = None  # chat with tools / a reasoning parser: the message's fields


def _trace_token(tr: Any, h: RequestHandle, i: int, recv_ns: int, yield_ns: int, sent_ns: int | None) -> None:
    """Token i of h on the http track: wait (the scheduler emitted it -> the event loop took
    it), detok (text and chunk), send (the ASGI send until the generator resumed)."""
    emitted = h.request.token_s[i] if i < len(h.request.token_s) else None
    if emitted is not None:
        tr.add(HTTP, "wait", int(emitted * 1e9), recv_ns, request=h.id, token=i)
    tr.add(HTTP, "detok", recv_ns, yield_ns, request=h.id, token=i)
    if sent_ns is not None:
        tr.add(HTTP, "send", yield_ns, sent_ns, request=h.id, token=i)


_END, _ERROR = object(), object()  # stream events beside token ids: a choice ended / failed


async def _until_disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def generate(
    state: ServerState,
    request: Request,
    req: Any,
    prompts: list[tuple[list[int], str | None]],
    arrival: float,
    *,
    chat: bool,
) -> Response:
    """Validate every choice's parameters, admit all choices (or none), answer."""
    opt = state.opt
    gen = opt.generation
    where = "messages" if chat else "prompt"
    if len(prompts) * req.n > opt.max_in_flight:
        raise P.ApiError(
            400,
            f"{len(prompts)} prompt(s) x n={req.n} choices exceed this server's "
            f"{opt.max_in_flight} requests in flight",
            param="n",
        )
    echo = getattr(req, "echo", False)
    jobs, meta = [], []
    for ids, prompt_text in prompts:
        if not ids:
            raise P.ApiError(400, "the prompt encodes to no tokens", param=where)
        n_new = P.max_new_tokens(
            req, len(ids), opt.max_model_len, chat=chat, default_max_tokens=gen.max_new_tokens
        )
        base = P.sampling_params(req, n_new, gen, vocab_size=opt.vocab_size, eos_ids=opt.eos_ids)
        # the echoed text: the prompt as given, or its ids decoded (once for its n samples)
        shown = (prompt_text if prompt_text is not None else state.tokenizer.decode(ids)) if echo else None
        for seed in P.sample_seeds(req, base.temperature, req.n):
            jobs.append((ids, dataclasses.replace(base, seed=seed)))
            meta.append((ids, shown))
    handles = state.admit_all(jobs, arrival)
    stops = P.stop_strings(req)
    tools_on = chat and req.tools_on()
    post = (
        (lambda: ChatOutput(reasoning=opt.reasoning_parser, tools=tools_on))
        if chat and (opt.reasoning_parser or tools_on)
        else None
    )
    choices = [
        _Choice(
            i,
            h,
            P.TextStream(state.tokenizer.decode, stops),
            ids,
            shown,
            post=post() if post else None,
        )
        for i, (h, (ids, shown)) in enumerate(zip(handles, meta))
    ]
    out = P.ResponseBuilder(
        opt.model_name,
        chat=chat,
        prompts=[ids for ids, _ in prompts],
        n=req.n,
        return_token_ids=req.return_token_ids,
    )
    if req.stream:
        so = req.stream_options or P.StreamOptions()
        return StreamingResponse(_stream(state, choices, out, so, chat), media_type="text/event-stream")
    return await _whole(state, request, choices, out)


def _logprobs(state: ServerState, c: _Choice, lo: int, hi: int, chat: bool) -> Any:
    """The wire-format logprobs of c's tokens [lo, hi) (and, for the first piece of an
    echoed completion, its prompt's first), or None when the request asked for none."""
    r = c.handle.request
    if r.params.logprobs is None:
        return None
    ids, entries = list(c.text.ids[lo:hi]), list(r.logprobs[lo:hi])
    try:
        if chat:
            return {"content": state.logprobs.chat(ids, entries)}
        if c.echo is not None and lo == 0:
            prompt_lps = r.prompt_logprobs
            if prompt_lps is None:
                raise ValueError("logprobs: the backend reported no prompt logprobs")
            ids, entries = c.prompt_ids + ids, list(prompt_lps) + entries
        obj, c.text_offset = state.logprobs.completion(ids, entries, c.text_offset)
        return obj
    except ValueError as e:
        raise P.ApiError(500, str(e), type="internal_server_error") from None


async def _whole(
    state: ServerState, request: Request, choices: list[_Choice], out: P.ResponseBuilder
) -> Response:
    async def consume(c: _Choice) -> None:
        try:
            async for tok in c.handle.astream():
                c.recv_s.append(time.perf_counter())
                c.text.push(tok)
                if c.text.stopped:
                    state.cancel(c.handle)
                    c.reason = "stop"
                    return
        except RequestError:
            c.reason = "error"
            raise
        c.text.finish()
        c.reason = c.handle.request.finish_reason or "abort"

    task = asyncio.gather(*(consume(c) for c in choices))
    watch = asyncio.ensure_future(_until_disconnected(request))
    err = None
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises RequestError if a choice failed
    except RequestError as e:
        err = str(e)
    finally:
        for t in (task, watch):
            t.cancel()
        for c in choices:  # a failed choice, or a client gone: nobody reads the others
            if not c.handle.done:
                state.cancel(c.handle)
            state.retire(c.handle, c.recv_s, c.reason or "abort")
    if err is not None:
        raise P.ApiError(500, err, type="internal_server_error")
    if any(c.reason in (None, "abort") for c in choices):
        return Response(status_code=499)  # the client went away: nobody reads this
    body = []
    for c in choices:
        message = c.post.whole(c.text.text) if c.post is not None else None
        body.append(
            out.choice(
                c.index,
                (c.echo or "") + c.text.text,
                c.text.ids,
                "tool_calls" if c.post is not None and c.post.called else c.reason,
                _logprobs(state, c, 0, len(c.text.ids), out.chat),
                message=message,
            )
        )
    return JSONResponse(out.full(body, sum(len(c.text.ids) for c in choices)))


async def _stream(
    state: ServerState, choices: list[_Choice], out: P.ResponseBuilder, so: P.StreamOptions, chat: bool
) -> AsyncIterator[str]:
    """Chunks of every choice as their tokens come (each chunk names its choice), a
    finish chunk per choice, then the usage chunk if asked, then [DONE]."""
    usage_every = so.include_usage and so.continuous_usage_stats
    events: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for tok in c.handle.astream():
                events.put_nowait((c, tok, time.perf_counter_ns()))
            events.put_nowait((c, _END, None))
        except RequestError as e:
            events.put_nowait((c, _ERROR, str(e)))

    def chunk(c: _Choice, delta: str, finish: str | None, fields: dict[str, Any] | None = None) -> str:
        hi = c.sent + len(c.pending)
        lp = _logprobs(state, c, c.sent, hi, chat)
        if c.first and c.echo is not None:
            delta = c.echo + delta
        done_tokens = sum(len(x.text.ids) for x in choices)
        body = out.chunk(
            c.index,
            delta,
            c.pending,
            finish,
            role=chat and c.first,
            logprobs=lp,
            usage_now=out.usage(done_tokens) if usage_every else None,
            with_usage=so.include_usage,
            delta=fields,
        )
        c.first, c.pending, c.sent = False, [], hi
        return P.sse(body)

    def last(c: _Choice, delta: str, finish: str) -> list[str]:
        """The choice's last chunks: the rest of its text (and, parsed, its tool calls)."""
        if c.post is None:
            return [chunk(c, delta, finish)]
        parts = c.post.finish(delta) or [{"content": ""}]
        finish = "tool_calls" if c.post.called else finish
        return [chunk(c, "", finish if k == len(parts) - 1 else None, p) for k, p in enumerate(parts)]

    def middle(c: _Choice, delta: str) -> list[str]:
        if c.post is None:
            return [chunk(c, delta, None)] if delta else []
        return [chunk(c, "", None, p) for p in c.post.push(delta)]

    tr = state.trace
    pumps = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        try:
            open_ = len(choices)
            while open_:
                c, tok, info = await events.get()
                if tok is _ERROR:
                    c.reason = "error"
                    raise RequestError(info)
                if tok is _END:
                    open_ -= 1
                    if c.reason is None:  # not cut by a stop string: the rest of its text
                        c.reason = c.handle.request.finish_reason or "abort"
                        for body in last(c, c.text.finish(), c.reason):
                            yield body
                    continue
                if c.reason is not None:
                    continue  # a token after the stop string: not part of the response
                c.recv_s.append(time.perf_counter())
                c.pending.append(tok)
                delta = c.text.push(tok)
                if c.text.stopped:
                    state.cancel(c.handle)
                    c.reason = "stop"
                    for body in last(c, delta, "stop"):
                        yield body
                elif bodies := middle(c, delta):
                    t_yield = time.perf_counter_ns()
                    for body in bodies:
                        yield body
                    if tr is not None:
                        _trace_token(tr, c.handle, len(c.recv_s) - 1, info, t_yield, time.perf_counter_ns())
                elif tr is not None:
                    _trace_token(tr, c.handle, len(c.recv_s) - 1, info, time.perf_counter_ns(), None)
            if so.include_usage:
                yield P.sse(out.usage_chunk(sum(len(c.text.ids) for c in choices)))
        except RequestError as e:
            yield P.sse(P.ApiError(500, str(e), type="internal_server_error").body())
        except P.ApiError as e:  # a backend that broke the logprobs contract
            yield P.sse(e.body())
        yield P.SSE_DONE
    finally:  # also on a client disconnect (Starlette cancels this generator)
        for p in pumps:
            p.cancel()
        for c in choices:
            if not c.handle.done:
                state.cancel(c.handle)
            state.retire(c.handle, c.recv_s, c.reason or "abort")


__all__ = ["generate"]
