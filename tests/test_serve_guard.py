"""The request guard of `hmoe serve` (serve/guard.py, issue 28): API key, JSON-only POST
bodies, the body-size cap (before reading; chunked bodies read only to the cap), the Host
check (DNS rebinding) and CORS off by default. In process on the scripted stub backend of
test_serve_http_app; one test on a real uvicorn socket for the 413 that reads no body."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from fastapi.testclient import TestClient

from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.guard import default_allowed_hosts, host_name, parse_allowed_hosts
from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
from tests.serve_stub import TOK, StubBackend, ids, uvicorn_thread

BODY = {"model": "stub", "prompt": "hi", "max_tokens": 3, "temperature": 0}
KEY = "sk-test-0123456789"


def make_app(**guard):
    opts = ServeOptions(model_name="stub", root="/stub", vocab_size=512, max_model_len=128, **guard)
    state = ServerState(StubBackend(ids("abc")), TOK, ChatTemplate(None, TOK.encode), opts)
    return create_app(state), state


def client(base_url: str = "http://testserver", **guard) -> TestClient:
    return TestClient(make_app(**guard)[0], base_url=base_url)


def assert_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------- API key


def test_api_key_401_without_or_with_a_wrong_key_200_with_it():
    c = client(api_key=KEY)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
    ):
        r = c.post("/v1/completions", json=BODY, headers=headers)
        err = assert_error(r, 401, "invalid_api_key")
        assert "Authorization: Bearer" in err["message"] and KEY not in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.get("/v1/models", headers=headers), 401)
        assert_error(c.post("/tokenize", json={"prompt": "a"}, headers=headers), 401)
    good = {"Authorization": f"Bearer {KEY}"}
    r = c.post("/v1/completions", json=BODY, headers=good)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
    assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    # probes and scrapers stay open; refusals are counted
    assert c.get("/health").status_code == 200
    m = c.get("/metrics")
    assert m.status_code == 200 and 'status="401"' in m.text


def test_no_key_configured_means_open_and_the_key_never_prints():
    assert client().post("/v1/completions", json=BODY).status_code == 200
    opts = ServeOptions(model_name="m", root="/r", vocab_size=8, max_model_len=8, api_key=KEY)
    assert KEY not in repr(opts)


# ---------------------------------------------------------------- content type


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
        "application/json; charset=latin-1",
        "application/jsonp",
    ],
)
def test_a_post_body_that_is_not_json_is_415(ctype):
    c = client()
    headers = {} if ctype is None else {"Content-Type": ctype}
    r = c.post("/v1/completions", content=json.dumps(BODY).encode(), headers=headers)
    err = assert_error(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"] and err["param"] == "Content-Type"


def test_json_with_charset_passes_and_bad_json_is_still_a_400():
    c = client()
    r = c.post(
        "/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={"Content-Type": "Application/JSON; charset=UTF-8"},
    )
    assert r.status_code == 200, r.text
    r = c.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    assert c.get("/v1/models").status_code == 200  # a GET carries no body: no type needed


# ---------------------------------------------------------------- size


def test_a_body_at_the_cap_passes_one_byte_over_is_413():
    data = json.dumps(BODY).encode()
    ok = client(max_request_bytes=len(data)).post(
        "/v1/completions", content=data, headers={"Content-Type": "application/json"}
    )
    assert ok.status_code == 200, ok.text
    r = client(max_request_bytes=len(data) - 1).post(
        "/v1/completions", content=data, headers={"Content-Type": "application/json"}
    )
    err = assert_error(r, 413, "request_too_large")
    assert str(len(data) - 1) in err["message"] and r.headers["connection"] == "close"


def drive(app, headers: list[tuple[bytes, bytes]], chunks, receive=None) -> tuple[int | None, int]:
    """One POST /v1/completions through the ASGI app by hand: (status, receive() calls);
    status None when nothing was sent. `receive`: an async function replacing the chunks."""
    calls = 0
    sent: list[dict] = []

    async def chunked():
        nonlocal calls
        calls += 1
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive or chunked, send))
    return (sent[0]["status"] if sent else None), calls


def test_413_on_content_length_reads_no_body_byte():
    app, _ = make_app()
    body = iter([b"x" * 65536] * 1000)  # what a client would send next
    status, calls = drive(app, [(b"content-length", str(50 * 10**6).encode())], body)
    assert (status, calls) == (413, 0)


def test_413_on_a_chunked_body_stops_reading_at_the_cap():
    cap, chunk = 1 << 20, 65536
    app, _ = make_app(max_request_bytes=cap)
    status, calls = drive(app, [], iter([b" " * chunk] * 800))  # 50 MiB, no Content-Length
    assert status == 413
    assert calls == cap // chunk + 1  # the first chunk past the cap, no further


def test_a_body_not_complete_within_the_upload_timeout_is_408():
    """A client that sends part of its body and then stalls (or trickles) holds a connection
    and a slot: the whole body must arrive within upload_timeout_s of the head."""
    app, state = make_app(upload_timeout_s=0.3)
    parts = iter([{"type": "http.request", "body": b'{"model": ', "more_body": True}])

    async def stall():
        msg = next(parts, None)
        if msg is None:
            await asyncio.sleep(3600)  # never sends the rest
        return msg

    status, _ = drive(app, [], None, receive=stall)
    assert status == 408
    assert 'status="408"' in state.metrics.render()[0].decode()


def test_a_client_hanging_up_mid_upload_is_a_quiet_cancel(caplog):
    """No response, no ERROR log and no traceback (it was a 61-line internal error), one
    INFO line naming the client, and the request counted as 499."""
    app, state = make_app()
    msgs = iter(
        [
            {"type": "http.request", "body": b'{"model": "stub", "pro', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def hang_up():
        return next(msgs)

    with caplog.at_level("INFO"):
        status, _ = drive(app, [], None, receive=hang_up)
    assert status is None
    assert not [r for r in caplog.records if r.levelno >= 30 or r.exc_info], caplog.text
    assert any(
        "hung up during its upload" in r.getMessage() and "127.0.0.1:1" in r.getMessage()
        for r in caplog.records
    )
    assert 'status="499"' in state.metrics.render()[0].decode()


def test_upload_timeout_flag_reaches_the_guard_and_is_checked():
    import argparse

    from hmoe_jax.io.errors import InputError
    from hmoe_jax.serve.http_server import guard_options

    ns = argparse.Namespace(host="127.0.0.1", upload_timeout_s=5.0)
    assert guard_options(ns)["upload_timeout_s"] == 5.0
    assert guard_options(argparse.Namespace(host="127.0.0.1"))["upload_timeout_s"] == 60.0
    with pytest.raises(InputError, match="--upload-timeout-s"):
        guard_options(argparse.Namespace(host="127.0.0.1", upload_timeout_s=0.0))


def test_413_on_a_real_socket_comes_before_the_body_is_sent():
    """uvicorn in a thread: a 50 MB Content-Length gets 413 with no body byte sent, and the
    server closes the connection (the unread body is not parsed as a next request)."""
    app, _ = make_app()
    with uvicorn_thread(app) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n"
        )
        data = b""
        while chunk := s.recv(65536):  # ends when the server closes
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), data[:200]
    assert json.loads(body)["error"]["code"] == "request_too_large"


# ---------------------------------------------------------------- Host


def test_a_foreign_host_is_421_loopback_names_pass():
    allowed = default_allowed_hosts("127.0.0.1")
    assert set(allowed) == {"localhost", "127.0.0.1", "::1"}
    for url in ("http://localhost:8000", "http://127.0.0.1:8000", "http://[::1]:8000", "http://LOCALHOST."):
        assert client(url, allowed_hosts=allowed).get("/v1/models").status_code == 200, url
    for url in ("http://evil.example", "http://localhost.evil.example:8000", "http://10.0.0.5:8000"):
        c = client(url, allowed_hosts=allowed)
        err = assert_error(c.post("/v1/completions", json=BODY), 421, "misdirected_request")
        assert "--allowed-hosts" in err["message"]
        assert_error(c.get("/health"), 421)  # rebinding reaches every route


def test_allowed_hosts_parsing_and_defaults():
    assert parse_allowed_hosts("*") is None and parse_allowed_hosts("a.example, *") is None
    assert parse_allowed_hosts("A.example:8000,[::1]:9,b") == ("a.example", "::1", "b")
    with pytest.raises(ValueError, match="allowed-hosts"):
        parse_allowed_hosts(" , ")
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("::") is None
    assert default_allowed_hosts("10.1.2.3") == ("10.1.2.3",)
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM.:1") == "example.com"
    c = client("http://serve.example", allowed_hosts=parse_allowed_hosts("serve.example"))
    assert c.get("/v1/models").status_code == 200


# ---------------------------------------------------------------- CORS


def preflight(c: TestClient, origin: str):
    return c.options(
        "/v1/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )


def test_cors_is_off_by_default():
    c = client()
    for r in (
        preflight(c, "https://site.example"),
        c.get("/v1/models", headers={"Origin": "https://site.example"}),
    ):
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers


def test_allowed_origins_turn_cors_on_for_those_origins_only():
    c = client(api_key=KEY, allowed_origins=("https://app.example",))
    r = preflight(c, "https://app.example")  # a preflight carries no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = c.get("/v1/models", headers={"Origin": "https://app.example"})  # a refusal the page can read
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = c.get("/v1/models", headers={"Origin": "https://other.example", "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers
    assert preflight(c, "https://other.example").status_code == 400


# ---------------------------------------------------------------- `hmoe serve` flags


def guard_of(argv: list[str]) -> dict:
    from hmoe_jax.cli.app import build_parser
    from hmoe_jax.serve.http_server import guard_options

    return guard_options(build_parser().parse_args(["serve", *argv]))


def test_serve_flags_reach_the_guard(monkeypatch):
    from hmoe_jax.io.errors import InputError

    monkeypatch.delenv("HMOE_API_KEY", raising=False)
    g = guard_of([])
    assert g["api_key"] is None and g["max_request_bytes"] == 4 << 20 and g["allowed_origins"] == ()
    assert set(g["allowed_hosts"]) == {"localhost", "127.0.0.1", "::1"}
    monkeypatch.setenv("HMOE_API_KEY", "from-env")
    assert guard_of([])["api_key"] == "from-env"
    assert guard_of(["--api-key", "flag"])["api_key"] == "flag"
    g = guard_of(
        ["--host", "0.0.0.0", "--max-request-bytes", "1000", "--allowed-origins", "https://a,https://b"]
    )
    assert g["allowed_hosts"] is None and g["max_request_bytes"] == 1000
    assert g["allowed_origins"] == ("https://a", "https://b")
    assert guard_of(["--allowed-hosts", "*"])["allowed_hosts"] is None
    assert guard_of(["--host", "10.0.0.2"])["allowed_hosts"] == ("10.0.0.2",)
    with pytest.raises(InputError, match="--api-key"):
        guard_of(["--api-key", ""])
    with pytest.raises(InputError, match="--max-request-bytes"):
        guard_of(["--max-request-bytes", "0"])
