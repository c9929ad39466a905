"""A scripted stub backend for the HTTP app's in-process tests (no model): a byte
tokenizer and a backend that emits a fixed token script on a thread, with deterministic
fake log-probabilities when the request asks for them (fake_logprob)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from hmoe_jax.io.tokenizer import ByteTokenizer
from hmoe_jax.model.sampling import TokenLogprob
from hmoe_jax.serve.request import Request, RequestHandle

TOK = ByteTokenizer(512)


def ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]  # no BOS


def fake_logprob(token: int, pos: int, k: int) -> TokenLogprob:
    """Position pos's entry: the token at -(pos % 5 + 1) / 4; its top k are ids 100, 101, ...
    at -0.125, -1.125, ... (most likely first)."""
    return TokenLogprob(token, -(pos % 5 + 1) / 4, tuple((100 + j, -0.125 - j) for j in range(k)))


class StubBackend:
    """Emits a fixed token script on a thread (1 ms apart); can fail after k tokens.
    `script` may be a function of the SamplingParams (a script per seed, say); `refuse_at`:
    the submit call (0-based) that raises ValueError, as a backend refusing a prompt does.
    `params` records every submitted SamplingParams, `submitted` every Request."""

    def __init__(self, script, fail_after: int | None = None, refuse_at: int | None = None):
        self.script, self.fail_after, self.refuse_at = script, fail_after, refuse_at
        self.cancelled: list[int] = []
        self.params: list = []
        self.submitted: list[Request] = []

    def submit(self, prompt_ids, params=None):
        import numpy as np

        if self.refuse_at is not None and len(self.params) == self.refuse_at:
            self.params.append(params)
            raise ValueError("stub: refused")
        self.params.append(params)
        req = Request(np.asarray(prompt_ids, np.int32), params, time.perf_counter())
        self.submitted.append(req)
        h = RequestHandle(req, lambda r: self.cancelled.append(r.id))
        script = self.script(params) if callable(self.script) else self.script

        def run():
            req.started_s = time.perf_counter()
            if params.prompt_logprobs is not None:
                p = [int(t) for t in req.prompt]
                req.prompt_logprobs = [None] + [
                    fake_logprob(t, i, params.prompt_logprobs) for i, t in enumerate(p) if i > 0
                ]
            for i, t in enumerate(script[: params.max_new_tokens]):
                if self.fail_after is not None and i == self.fail_after:
                    h.finish("error", time.perf_counter(), "worker died")
                    return
                if req.id in self.cancelled:
                    h.finish("cancelled", time.perf_counter())
                    return
                time.sleep(0.001)
                lp = (
                    None if params.logprobs is None else fake_logprob(t, req.prompt.size + i, params.logprobs)
                )
                h.emit(t, time.perf_counter(), lp)
            h.finish("length", time.perf_counter())

        threading.Thread(target=run, daemon=True).start()
        return h

    def close(self):
        pass


@contextlib.contextmanager
def uvicorn_thread(app, timeout_s: float = 20.0):
    """The ASGI app served by uvicorn on a free loopback port in a thread: yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        t.join(timeout_s)


BODY = {"model": "stub", "prompt": "hi", "max_tokens": 20, "temperature": 0}


def app_for(backend, **kw):
    """(TestClient, ServerState) of the HTTP app on `backend` with the byte tokenizer."""
    from fastapi.testclient import TestClient

    from hmoe_jax.serve.chat_template import ChatTemplate
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app

    opts = ServeOptions(model_name="stub", root="/stub", vocab_size=512, max_model_len=128)
    state = ServerState(backend, TOK, ChatTemplate(None, TOK.encode), opts, **kw)
    return TestClient(create_app(state)), state
