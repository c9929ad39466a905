"""Prompt text -> ids without freezing the server (serve/ingest.py, issue 28 item 4): the
characters-per-token bound the early refusal rests on holds for the shipped tokenizer and
the byte tokenizer (checked on adversarial texts, not assumed), the refusal names the
problem, and tokenizing a long text leaves the event loop running."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from hmoe_jax.io.tokenizer import ByteTokenizer, load_tokenizer
from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.ingest import Ingest
from hmoe_jax.serve.openai_protocol import ApiError, ChatMessage

SHIPPED = Path(__file__).resolve().parents[1] / "hmoe_jax" / "assets" / "deepseek_v3_stdlib"


@pytest.fixture(scope="module")
def hf():
    return load_tokenizer(SHIPPED, 2048)


def _texts(tok) -> list[str]:
    """Texts that pack many characters into few tokens: the longest vocabulary entries
    repeated, whitespace runs, code, mixed scripts and emoji, random printable noise."""
    rng = random.Random(0)
    texts = [" " * 5000, "\n" * 3000, "\t" * 1000, "a" * 4000, "def main(self, *args):\n" * 200]
    texts.append("".join(rng.choice("αβγ日本語😀é ") for _ in range(3000)))
    texts.append("".join(chr(rng.randrange(32, 127)) for _ in range(5000)))
    if hasattr(tok, "_tok"):
        vocab = tok._tok.get_vocab()
        longest = sorted(vocab, key=len, reverse=True)[:20]
        for i in longest:
            t = tok.decode([vocab[i]])
            texts += [t * 50, (t + " ") * 50]
    return texts


@pytest.mark.parametrize("which", ["shipped", "bytes"])
def test_no_text_encodes_to_fewer_tokens_than_chars_over_the_bound(which, hf):
    tok = hf if which == "shipped" else ByteTokenizer(512)
    k = tok.max_token_chars
    assert k is not None and k >= 1
    for t in _texts(tok):
        n = len(tok.encode(t)) - 1  # the BOS covers no text
        assert n * k >= len(t), (which, t[:40], n, k)


def test_hf_encode_gives_the_librarys_own_ids(hf):
    for t in _texts(hf)[:8]:
        ref = hf._tok.encode(t, add_special_tokens=True).ids
        ref = ref if ref[:1] == [hf.bos_id] or hf.bos_id is None else [hf.bos_id, *ref]
        assert hf.encode(t) == ref


def test_a_tokenizer_with_a_normalizer_or_unknown_words_has_no_bound(tmp_path, hf):
    import json

    spec = json.loads((SHIPPED / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(tmp_path, 2048).max_token_chars is None


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing():
    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    tok = Counting(512)
    ing = Ingest(tok, ChatTemplate(None, tok.encode), max_model_len=100)
    try:
        assert len(asyncio.run(ing.encode("x" * 100))) == 101  # at the bound: tokenized (and then too long)
        with pytest.raises(ApiError) as e:
            asyncio.run(ing.encode("x" * 101))
        assert e.value.status == 400 and e.value.param == "prompt"
        assert "101 characters" in e.value.message and "100 tokens" in e.value.message
        msgs = [ChatMessage(role="user", content="y" * 150)]
        with pytest.raises(ApiError) as e:
            asyncio.run(ing.encode_chat(msgs))
        assert e.value.param == "messages"
        with pytest.raises(ApiError) as e:
            asyncio.run(ing.encode_many(["ok", "z" * 500]))
        assert e.value.param == "prompt.1"
        assert Counting.calls == 1
    finally:
        ing.close()


def test_the_event_loop_runs_while_a_long_prompt_is_tokenized(hf):
    """The tokenizer holds the GIL in `encode` and releases it in `encode_batch`: on a
    worker thread the first would stop the loop for the whole text (one tick), the second
    lets it run. Random words: no cached pieces from earlier tests."""
    rng = random.Random(1)
    text = " ".join(
        "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(3, 9))) for _ in range(40000)
    )
    ing = Ingest(hf, ChatTemplate(None, hf.encode), max_model_len=10**7)

    async def run() -> tuple[int, int]:
        ticks = 0
        task = asyncio.ensure_future(ing.encode(text))
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        return ticks, len(task.result())

    try:
        ticks, n = asyncio.run(run())
    finally:
        ing.close()
    assert n > 40000
    assert ticks >= 50, f"the loop ran {ticks} times while {len(text)} characters were tokenized"


# ---------------------------------------------------------------- in the app


class _CountingTok(ByteTokenizer):
    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def _app(script, max_model_len=128, max_in_flight=64):
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
    from tests.serve_stub import StubBackend

    tok = _CountingTok(512)
    opts = ServeOptions(
        model_name="stub",
        root="/stub",
        vocab_size=512,
        max_model_len=max_model_len,
        max_in_flight=max_in_flight,
    )
    backend = StubBackend(script)
    state = ServerState(backend, tok, ChatTemplate(None, tok.encode), opts)
    return create_app(state), state, tok


BIG = "x" * 4_000_000  # 4 MB: under the default 4 MiB body cap with its JSON around it


def test_a_full_server_refuses_a_4mb_prompt_without_tokenizing_it():
    """The admission bound is checked before the prompt is tokenized (it was: 5.2 s of
    tokenizing before the 429). The timing lane bounds the wall-clock time."""
    import threading

    from fastapi.testclient import TestClient

    gate = threading.Event()
    app, state, tok = _app(lambda p: [65] * 1000, max_model_len=10**7, max_in_flight=1)
    with TestClient(app) as c:
        held = threading.Thread(
            target=lambda: c.post(
                "/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 1000}
            ),
            daemon=True,
        )
        held.start()
        while not state.live:  # the one slot is taken
            gate.wait(0.01)
        calls = tok.calls
        for body in (
            {"model": "stub", "prompt": BIG},
            {"model": "stub", "messages": [{"role": "user", "content": BIG}]},
        ):
            url = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = c.post(url, json=body)
            assert r.status_code == 429, r.text[:300]
            assert r.headers["retry-after"] == "1"
        assert tok.calls == calls
        held.join(30)


def test_a_prompt_that_cannot_fit_is_a_400_before_tokenizing_in_the_app():
    from fastapi.testclient import TestClient

    from tests.serve_stub import ids

    app, state, tok = _app(ids("AB"), max_model_len=128)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "stub", "prompt": BIG})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
        assert "4000000 characters" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "stub", "prompt": ["ok", BIG[:1000]]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
        assert tok.calls == 0
        # /tokenize counts any prompt (no context check), still off the loop
        r = c.post("/tokenize", json={"model": "stub", "prompt": "x" * 500})
        assert r.status_code == 200 and r.json()["count"] == 501
        r = c.post("/v1/completions", json={"model": "stub", "prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AB"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.timing
def test_a_50mb_body_and_a_4mb_prompt_do_not_stall_a_stream():
    """Wall-clock (the `timing` lane), on a real uvicorn socket: while one client streams,
    a 50 MB body is refused (413) in under 1 s, a 4 MB prompt to a full server gets its 429
    in under 0.2 s, the stream never waits over 1 s for a token, and RSS grows under 100 MB."""
    import json as _json
    import socket
    import threading
    import time

    import httpx

    from tests.serve_stub import uvicorn_thread

    app, state, _ = _app(lambda p: [65] * 4000, max_model_len=10**7, max_in_flight=1)
    gaps: list[float] = []
    with uvicorn_thread(app) as port:
        url = f"http://127.0.0.1:{port}"

        def stream():
            body = {"model": "stub", "prompt": "hi", "max_tokens": 4000, "stream": True}
            last = time.perf_counter()
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

        st = threading.Thread(target=stream, daemon=True)
        st.start()
        while not state.live:
            time.sleep(0.01)
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 50000000\r\n\r\n" + b" " * 65536
            )
            head = s.recv(65536)
        t_413 = time.perf_counter() - t0
        assert head.startswith(b"HTTP/1.1 413"), head[:200]
        data = _json.dumps({"model": "stub", "prompt": BIG}).encode()
        t0 = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions", content=data, headers={"Content-Type": "application/json"}, timeout=30
        )
        t_429 = time.perf_counter() - t0
        assert r.status_code == 429
        grew = _rss_bytes() - rss0
        st.join(60)
    assert len(gaps) > 100
    assert t_413 < 1.0, t_413
    assert t_429 < 0.2, t_429
    assert max(gaps) < 1.0, max(gaps)
    assert grew < 100 * 2**20, grew
