"""The request guard of `hmoe serve`: one pure-ASGI middleware that refuses a request before
any route (or body parse, or tokenizer) sees it, with the app's OpenAI-style error body.

In order, for each HTTP request:
  1. Host (421): the Host header must name the bound address (DNS rebinding: a web page
     whose domain re-resolves to 127.0.0.1 reaches a localhost server from the victim's
     browser with its own domain in Host). Off when `allowed_hosts` is None.
  2. API key (401): every route but /health and /metrics needs `Authorization: Bearer KEY`,
     compared in constant time. Off when `api_key` is None.
  3. Content type (415): a POST body must be application/json (UTF-8). A browser sends a
     cross-site text/plain or form POST without a CORS preflight; JSON needs one.
  4. Size (413): a Content-Length over `max_request_bytes` is refused before one body byte
     is read; a chunked body is read only until its running total passes the cap. The 413
     closes the connection, so the rest of the body is never read either.
  5. Upload time (408): the whole body must arrive within `upload_timeout_s` of the
     request's head (a total, not per chunk: a client trickling one byte at a time would
     reset a per-chunk timer forever and hold the slot). A client that hangs up mid-upload
     is a quiet cancel: nothing is sent, one INFO line, no traceback (it is not an error
     of the server's).

The body a request passes with is handed to the app whole (at most the cap: the routes read
it whole anyway); later receive() calls go to the server, so a disconnect is still seen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from typing import Any

from starlette.responses import JSONResponse

from hmoe_jax.serve.openai_protocol import ApiError

MIB = 1 << 20
DEFAULT_MAX_REQUEST_BYTES = 4 * MIB
# 4 MiB at a slow 1 Mbit/s uplink takes ~34 s; a body still incomplete after 60 s is a
# stuck or hostile client holding a connection and a slot
DEFAULT_UPLOAD_TIMEOUT_S = 60.0
log = logging.getLogger("hmoe.serve")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers carry no key
_BODY_METHODS = ("POST", "PUT", "PATCH")


@dataclasses.dataclass(frozen=True)
class GuardPolicy:
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host (the server's address unknown)
    upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.upload_timeout_s > 0:
            raise ValueError(f"upload_timeout_s must be > 0, got {self.upload_timeout_s}")


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    return h in LOOPBACK_HOSTS or h.startswith("127.")


def default_allowed_hosts(bound_host: str) -> tuple[str, ...] | None:
    """The Host names a server bound to `bound_host` answers: the loopback names when bound
    to loopback, the bound name otherwise; None (any) for a wildcard bind (0.0.0.0, ::),
    whose reachable names the server cannot know."""
    h = bound_host.strip("[]").lower()
    if is_loopback(h):
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, h)))
    if h in ("", "0.0.0.0", "::"):
        return None
    return (h,)


def parse_allowed_hosts(text: str) -> tuple[str, ...] | None:
    """--allowed-hosts 'a,b:8000,[::1]' -> ('a', 'b', '::1'); '*' anywhere: any Host (None)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--allowed-hosts {text!r}: give host names separated by commas, or *")
    if "*" in names:
        return None
    return tuple(dict.fromkeys(host_name(n) for n in names))


def host_name(host: str) -> str:
    """The name in a Host header value, without port, brackets, case or trailing dot."""
    h = host.strip().lower()
    if h.startswith("["):  # [v6]:port
        h = h[1 : h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:  # name:port (a bare v6 address has several colons)
        h = h.split(":")[0]
    return h.rstrip(".")


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _check_host(scope: dict, allowed: tuple[str, ...]) -> ApiError | None:
    raw = _header(scope, b"host")
    if raw is None:
        return ApiError(
            400, "the request has no Host header", type="invalid_request_error", code="missing_host"
        )
    if host_name(raw) in allowed:
        return None
    return ApiError(
        421,
        f"Host {raw!r} is not one this server answers to ({', '.join(allowed)}); "
        "start it with --allowed-hosts to add names",
        type="invalid_request_error",
        code="misdirected_request",
    )


def _check_key(scope: dict, key: str) -> ApiError | None:
    if scope.get("path", "") in OPEN_PATHS:
        return None
    auth = _header(scope, b"authorization") or ""
    scheme, _, given = auth.partition(" ")
    # compare_digest on bytes: constant time in the key's content (its length may leak)
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
        return None
    why = "no API key was given" if not auth else "the API key is not valid"
    return ApiError(
        401,
        f"{why}: send the header 'Authorization: Bearer <key>' with the key `hmoe serve` was started with",
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _check_content_type(scope: dict) -> ApiError | None:
    raw = _header(scope, b"content-type")
    media, *params = (raw or "").split(";")
    charset = "utf-8"
    for p in params:
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset":
            charset = v.strip().strip('"').lower()
    if media.strip().lower() == "application/json" and charset in ("utf-8", "utf8"):
        return None
    got = "no Content-Type" if raw is None else f"Content-Type {raw!r}"
    return ApiError(
        415,
        f"{got}: a request body must be JSON, sent as 'Content-Type: application/json' (UTF-8)",
        param="Content-Type",
        type="invalid_request_error",
        code="unsupported_media_type",
    )


def _too_large(cap: int, size: str) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size}, over this server's limit of {cap} bytes (--max-request-bytes)",
        type="invalid_request_error",
        code="request_too_large",
        headers={"Connection": "close"},  # the unread rest of the body must not be parsed as a request
    )


class _Disconnected(Exception):
    """The client hung up before its body was complete."""


def _check_length(scope: dict, cap: int) -> ApiError | None:
    length = _header(scope, b"content-length")
    if length is None:
        return None
    if not length.strip().isdigit():
        return ApiError(400, f"Content-Length {length!r} is not a byte count")
    if int(length) > cap:
        return _too_large(cap, f"{int(length)} bytes (Content-Length)")
    return None


def _upload_timeout(limit_s: float, got_bytes: int) -> ApiError:
    return ApiError(
        408,
        f"the request body did not arrive within {limit_s:g} s ({got_bytes} bytes received); "
        "the limit is `hmoe serve --upload-timeout-s`",
        type="invalid_request_error",
        code="request_timeout",
        headers={"Connection": "close"},  # the rest of the body, if it ever comes, is not a request
    )


def _client(scope: dict) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "?"


class RequestGuard:
    """ASGI middleware applying a GuardPolicy (module docstring). on_reject(status) is told
    of each refusal (the server's rejected-requests counter); before_body(path) may return
    an ApiError that refuses a request after the header checks and before its body is read
    (the server's admission bound: 429 / 503, with Connection: close)."""

    def __init__(self, app: Any, policy: GuardPolicy, on_reject: Any = None, before_body: Any = None):
        self.app, self.policy, self.on_reject, self.before_body = app, policy, on_reject, before_body

    async def _refuse(self, e: ApiError, scope: dict, receive: Any, send: Any) -> None:
        if self.on_reject is not None:
            self.on_reject(e.status)
        await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        pol = self.policy
        err = None
        if pol.allowed_hosts is not None:
            err = _check_host(scope, pol.allowed_hosts)
        if err is None and pol.api_key is not None and scope.get("method") != "OPTIONS":
            err = _check_key(scope, pol.api_key)
        has_body = scope.get("method") in _BODY_METHODS
        if err is None and has_body:
            err = _check_content_type(scope)
        if err is None and has_body:
            err = _check_length(scope, pol.max_request_bytes)  # a 413 says more than a 429
        if err is None and has_body and self.before_body is not None:
            err = self.before_body(scope.get("path", ""))
            if err is not None:  # the unread body must not be parsed as the next request
                err.headers = {**err.headers, "Connection": "close"}
        if err is None and has_body:
            try:
                err, receive = await self._read_body(scope, receive)
            except _Disconnected as e:
                log.info(
                    "client %s hung up during its upload of %s (%s): request dropped",
                    _client(scope),
                    scope.get("path", ""),
                    e,
                )
                if self.on_reject is not None:
                    self.on_reject(499)
                return  # nobody to answer
        if err is not None:
            await self._refuse(err, scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _read_body(self, scope: dict, receive: Any) -> tuple[ApiError | None, Any]:
        """(None, a receive that replays the body read) or (the 413 / 408 / 400, receive);
        _Disconnected when the client hangs up first."""
        cap, limit_s = self.policy.max_request_bytes, self.policy.upload_timeout_s
        chunks: list[bytes] = []
        total = 0
        deadline = time.monotonic() + limit_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return _upload_timeout(limit_s, total), receive
            if msg["type"] == "http.disconnect":
                raise _Disconnected(f"after {total} bytes")
            if msg["type"] != "http.request":
                break
            chunks.append(msg.get("body", b""))
            total += len(chunks[-1])
            if total > cap:
                return _too_large(cap, f"at least {total} bytes (reading stopped there)"), receive
            if not msg.get("more_body", False):
                break
        if msg["type"] == "http.request":
            msg = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        pending = [msg]

        async def replay() -> dict:
            return pending.pop() if pending else await receive()

        return None, replay


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_UPLOAD_TIMEOUT_S",
    "GuardPolicy",
    "RequestGuard",
    "default_allowed_hosts",
    "parse_allowed_hosts",
]
