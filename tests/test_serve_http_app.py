"""The HTTP app's own logic, in process, on a scripted stub backend (no model): /health
503, draining, a backend error mid-stream, stop strings cancelling the request, incremental
detokenization of split UTF-8, the checkpoint chat template."""

from __future__ import annotations

import json

import pytest

from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.openai_protocol import ApiError, ChatMessage, TextStream
from tests.serve_stub import BODY, TOK, StubBackend, app_for, ids


def test_health_is_503_when_a_worker_is_down_and_draining_refuses():
    live = {"ok": True}
    c, state = app_for(StubBackend(ids("abc")), healthy=lambda: live["ok"])
    assert c.get("/health").status_code == 200
    live["ok"] = False
    r = c.get("/health")
    assert r.status_code == 503 and "not live" in r.json()["error"]["message"]
    state.draining = True
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_backend_error_is_reported_not_hidden():
    c, _ = app_for(StubBackend(ids("abcdef"), fail_after=3))
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and "worker died" in r.json()["error"]["message"]
    with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert "worker died" in json.loads(lines[-2][5:])["error"]["message"] and lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[5:])["choices"][0]["text"] for ln in lines[:-2])
    assert text == "abc"


def test_stop_string_cuts_the_text_and_cancels_the_request():
    backend = StubBackend(ids("hello world, and more tokens after it"))
    c, _ = app_for(backend)
    r = c.post(
        "/v1/completions", json={**BODY, "max_tokens": 30, "stop": ["wor", "zzz"], "return_token_ids": True}
    )
    ch = r.json()["choices"][0]
    assert (ch["text"], ch["finish_reason"]) == ("hello ", "stop")
    assert ch["token_ids"] == ids("hello wor")  # the tokens up to the one completing the stop
    assert r.json()["usage"]["completion_tokens"] == 9
    assert backend.cancelled  # generation stopped there, not at max_tokens
    with c.stream(
        "POST", "/v1/completions", json={**BODY, "max_tokens": 30, "stop": "d,", "stream": True}
    ) as r:
        chunks = [
            json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and ln != "data: [DONE]"
        ]
    assert "".join(x["choices"][0]["text"] for x in chunks) == "hello worl"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_stream_holds_partial_utf8_and_stop_prefixes():
    s = TextStream(TOK.decode)
    e = ids("é€x")  # 2 + 3 + 1 bytes
    assert [s.push(t) for t in e] == ["", "é", "", "", "€", "x"]
    s = TextStream(TOK.decode, stop=["STOP"])
    out = [s.push(t) for t in ids("abSTxSTOPyy")]
    assert "".join(out) == "abSTx" and s.stopped and s.text == "abSTx"
    assert s.push(ids("z")[0]) == "" and s.finish() == ""
    s = TextStream(TOK.decode, stop=["STOP"])
    assert "".join(s.push(t) for t in ids("abSTO")) + s.finish() == "abSTO"  # held back, then flushed
    s = TextStream(TOK.decode)
    assert s.push(ids("é")[0]) == "" and s.finish() == "\ufffd"  # a cut character at the end


def test_checkpoint_chat_template_is_used(tmp_path):
    tpl = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "bos_token": "<s>"}))
    ct = ChatTemplate(tmp_path, TOK.encode)
    assert ct.source == "checkpoint"
    msgs = [
        ChatMessage(role="user", content=[{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}])
    ]
    assert ct.render(msgs) == "<s>[user]hi there[assistant]"
    with pytest.raises(ApiError, match="no system"):
        ct.render([ChatMessage(role="system", content="x")])
    assert ChatTemplate(None, TOK.encode).render([ChatMessage(role="user", content="q")]) == (
        "<|user|>\nq\n<|assistant|>\n"
    )
