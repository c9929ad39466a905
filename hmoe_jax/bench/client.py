"""One streaming request to an OpenAI-compatible server, timed the way vLLM's benchmark
client times it (vllm/benchmarks/lib/endpoint_request_func.py), with two deviations, both
to keep client-side time out of the server's numbers: TTFT is taken at the first chunk that
carries text (an empty role or usage chunk is not a token), and the clock starts when the
request starts going out on the wire (httpx's trace events), not before httpx has built it.
A chunk's time is when its line arrived, before its JSON is parsed.

A request that fails before the server sent any byte of a response (a pooled connection the
server closed just as it was reused: "Server disconnected without sending a response"; a
refused connect) is sent again on a fresh connection, up to `retries` times, timed from the
attempt that got the response; `RequestOutput.retries` counts them. Pooled connections
expire after KEEPALIVE_EXPIRY_S idle, under the 5 s after which common servers
(llama-server's cpp-httplib, uvicorn's default is 5 s too) close them, so that race is rare."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from hmoe_jax.bench.stats import RequestOutput

KEEPALIVE_EXPIRY_S = 2.0  # idle pooled connections are dropped after this (servers: 5 s)
RETRIES = 2  # resends of a request that failed before any response byte


def limits() -> httpx.Limits:
    """The pool the load generator uses: unbounded, idle connections expire before servers
    close them."""
    return httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )


def payload(
    model: str,
    prompt: str | list[int],
    output_len: int,
    *,
    chat: bool,
    ignore_eos: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: fixed output lengths
    if chat:
        text = prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt)
        body.update(messages=[{"role": "user", "content": text}], max_completion_tokens=output_len)
    else:
        body.update(prompt=prompt, max_tokens=output_len)
    body.update(extra or {})
    return body


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    prompt_len: int,
    *,
    chat: bool,
    on_first_token: Callable[[], None] | None = None,
    retries: int = RETRIES,
) -> RequestOutput:
    """One request (resent up to `retries` times while no response byte came back)."""
    for attempt in range(retries + 1):
        out, responded = await _send_once(
            client, url, body, prompt_len, chat=chat, on_first_token=on_first_token
        )
        out.retries = attempt
        if out.success or responded or attempt == retries:
            return out
    return out


async def _send_once(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    prompt_len: int,
    *,
    chat: bool,
    on_first_token: Callable[[], None] | None,
) -> tuple[RequestOutput, bool]:
    """-> (the timed request, whether the server sent any byte of a response)."""
    out = RequestOutput(prompt_len=prompt_len)
    sent = {"st": time.perf_counter()}
    responded = False

    async def trace(event: str, info: dict) -> None:
        # The clock starts when this request starts going out: its TCP connect if it opens
        # a connection, else its first header byte; not while httpx builds it or waits for
        # a pooled connection (client-side time that is no latency of the server's).
        if event in ("connection.connect_tcp.started", "http11.send_request_headers.started"):
            sent.setdefault(event, time.perf_counter())

    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, extensions={"trace": trace}) as resp:
            responded = True
            st = sent.get("connection.connect_tcp.started") or sent.get("http11.send_request_headers.started")
            st = st or sent["st"]
            out.start_s = last_token = last_choice = st
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {text[:500]}"
                return out, responded
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue  # read on to the end of the body, so the connection is reused
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message", obj["error"]))
                    return out, responded
                if choices := obj.get("choices"):
                    c = choices[0]
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if piece:
                        if not pieces:
                            out.ttft = now - st
                            if on_first_token is not None:
                                on_first_token()
                        else:
                            out.itl.append(now - last_token)
                        last_token = now
                        pieces.append(piece)
                    last_choice = now
                if usage := obj.get("usage"):
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out, responded
    if not pieces:
        out.error = "never received a chunk with text to time the first token"
        return out, responded
    out.success = True
    out.generated_text = "".join(pieces)
    out.latency = last_choice - st
    if not out.output_tokens:  # a server without include_usage: one token per chunk
        out.output_tokens = len(pieces)
    return out, responded
