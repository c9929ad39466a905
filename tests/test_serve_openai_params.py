"""The OpenAI request fields vLLM users send, in process on the stub backend: each field's
mapping into the SamplingParams the backend receives, logit_bias keys, list prompts and
n > 1 (choice order, seeds, usage, all-or-nothing admission), the logprobs formats of both
endpoints (whole and streamed, echo included), unknown fields, /v1/models/{id}, and the
unmodified `openai` client on top. Expected values are written out, not computed by the
code under test."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from fastapi.testclient import TestClient

from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
from tests.serve_stub import TOK, StubBackend, ids

BODY = {"model": "stub", "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "temperature": 0}


def app_for(backend, **kw) -> tuple[TestClient, ServerState]:
    opts = ServeOptions(
        model_name="stub", root="/stub", vocab_size=512, max_model_len=128, eos_ids=(1,), **kw
    )
    state = ServerState(backend, TOK, ChatTemplate(None, TOK.encode), opts)
    return TestClient(create_app(state)), state


def by_seed(params) -> list[int]:
    """A script that names its seed: 'a' for seed 0, 'b' for 1, ... three times."""
    return ids(chr(ord("a") + params.seed % 26) * 3)


def events(c: TestClient, path: str, body: dict) -> list:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    return [json.loads(x) for x in lines[:-1]]


# ---------------------------------------------------------------- field mapping


def test_each_field_maps_into_sampling_params():
    b = StubBackend(ids("ab"))
    c, _ = app_for(b)
    extra = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 1,
        "stop_token_ids": [7, 9],
        "logit_bias": {"42": -100, "7": 3.5},
        "top_k": 5,
        "top_p": 0.9,
        "seed": 11,
        "response_format": {"type": "text"},
        "best_of": 1,
    }
    r = c.post("/v1/completions", json={**BODY, **extra})
    assert r.status_code == 200, r.text
    p = b.params[-1]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.5, 1.2)
    assert (p.min_p, p.min_tokens, p.top_k, p.top_p, p.seed) == (0.05, 1, 5, 0.9, 11)
    assert p.stop_ids == (1, 7, 9)  # eos + the extra stop ids
    assert p.logit_bias == ((7, 3.5), (42, -100.0))
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    c.post("/v1/completions", json={**BODY, "stop_token_ids": [7], "ignore_eos": True})
    assert b.params[-1].stop_ids == (7,)
    c.post("/v1/completions", json={**BODY, "ignore_eos": True})
    assert b.params[-1].stop_ids == ()
    c.post("/v1/completions", json=BODY)
    p = b.params[-1]
    assert p.stop_ids is None and p.logit_bias == () and p.repetition_penalty == 1.0 and p.min_p == 0.0
    c.post("/v1/completions", json={**BODY, "logprobs": 0, "echo": True})
    assert (b.params[-1].logprobs, b.params[-1].prompt_logprobs) == (0, 0)
    c.post("/v1/completions", json={**BODY, "logprobs": 3})
    assert (b.params[-1].logprobs, b.params[-1].prompt_logprobs) == (3, None)
    c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 4})
    assert (b.params[-1].logprobs, b.params[-1].prompt_logprobs) == (4, None)
    c.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert b.params[-1].logprobs == 0
    c.post("/v1/chat/completions", json=CHAT)
    assert b.params[-1].logprobs is None


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc", "'abc' is not a token id"),
        ({"logit_bias": {"512": 1}}, "logit_bias.512", "out of range [0, 512)"),
        ({"logit_bias": {"-3": 1}}, "logit_bias.-3", "out of range"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "[-100, 100]"),
        ({"stop_token_ids": [600]}, "stop_token_ids", "token id 600 out of range"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"min_tokens": 5}, None, "min_tokens"),  # more than max_tokens=2
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"logprobs": True}, "logprobs", "integer"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"best_of": 2}, "best_of", "best_of == n"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no"}},
                }
            },
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"prompt": [[]]}, "prompt.0", "empty"),
        ({"prompt": [[5], [600]]}, "prompt.1", "token id 600 out of range"),
    ],
)
def test_bad_fields_are_a_400_naming_them(extra, param, words):
    b = StubBackend(ids("ab"))
    c, _ = app_for(b)
    r = c.post("/v1/completions", json={**BODY, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert not b.params  # nothing admitted


def test_chat_top_logprobs_needs_logprobs():
    c, _ = app_for(StubBackend(ids("ab")))
    r = c.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_unknown_fields_are_accepted_and_logged(caplog):
    c, _ = app_for(StubBackend(ids("ab")))
    with caplog.at_level(logging.WARNING):
        r = c.post("/v1/completions", json={**BODY, "frobnicate": 1, "guided_json": {}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
    assert "ignored: frobnicate, guided_json" in caplog.text
    r = c.post("/v1/completions", json={**BODY, "stream": True, "stream_options": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x"  # nested: strict


def test_model_by_id():
    c, _ = app_for(StubBackend(ids("ab")))
    r = c.get("/v1/models/stub")
    assert r.status_code == 200 and r.json()["id"] == "stub" and r.json()["object"] == "model"
    r = c.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- n and list prompts


def test_list_prompts_times_n_choices_order_seeds_usage():
    b = StubBackend(by_seed)
    c, _ = app_for(b)
    body = {**BODY, "prompt": ["ab", "cde"], "n": 2, "seed": 2**32 - 1, "temperature": 1.0, "max_tokens": 3}
    r = c.post("/v1/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert [x["index"] for x in ch] == [0, 1, 2, 3]
    # choice i = prompt i // n, sample i % n; sample j uses (seed + j) mod 2^32
    assert [x["prompt_token_ids"] for x in ch] == [[0, *ids("ab")]] * 2 + [[0, *ids("cde")]] * 2
    assert [x["text"] for x in ch] == ["vvv", "aaa", "vvv", "aaa"]  # seeds 2^32-1 (% 26 = 21), 0
    assert [p.seed for p in b.params] == [2**32 - 1, 0, 2**32 - 1, 0]
    assert r.json()["usage"] == {"prompt_tokens": 3 + 4, "completion_tokens": 12, "total_tokens": 19}
    r = c.post("/v1/completions", json={**BODY, "prompt": [[5, 6], [7]], "n": 1, "seed": 3})
    assert [x["index"] for x in r.json()["choices"]] == [0, 1]
    assert [list(q.prompt) for q in b.submitted[-2:]] == [[5, 6], [7]]
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = c.post("/v1/chat/completions", json={**CHAT, "n": 3, "best_of": 3, "seed": 0, "temperature": 1.0})
    assert [x["message"]["content"] for x in r.json()["choices"]] == ["aa", "bb", "cc"]


def test_unseeded_samples_get_distinct_seeds():
    b = StubBackend(by_seed)
    c, _ = app_for(b)
    c.post("/v1/completions", json={**BODY, "n": 4, "temperature": 1.0})
    assert len({p.seed for p in b.params}) == 4  # 4 random 32-bit seeds: a clash is ~1e-9


def test_admission_is_all_or_nothing():
    b = StubBackend(ids("abcdefgh"), refuse_at=2)
    c, state = app_for(b)
    r = c.post("/v1/completions", json={**BODY, "n": 3, "max_tokens": 8})
    assert r.status_code == 400 and "refused" in r.json()["error"]["message"]
    assert sorted(b.cancelled) == sorted(q.id for q in b.submitted) and len(b.submitted) == 2
    for q in b.submitted:
        assert q.finish_reason is None or q.finish_reason == "cancelled"
    c2, _ = app_for(StubBackend(ids("ab")), max_in_flight=3)
    r = c2.post("/v1/completions", json={**BODY, "prompt": ["a", "b"], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_stream_with_several_choices():
    c, _ = app_for(StubBackend(by_seed))
    body = {**BODY, "prompt": ["ab", "c"], "n": 2, "seed": 0, "temperature": 1.0, "max_tokens": 3}
    ev = events(c, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    usage = [e for e in ev if not e["choices"]]
    assert len(usage) == 1 and ev[-1] is usage[0]
    assert usage[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    text = {i: "" for i in range(4)}
    finishes = {}
    for e in ev[:-1]:
        (x,) = e["choices"]
        text[x["index"]] += x["text"]
        if x["finish_reason"] is not None:
            assert x["index"] not in finishes
            finishes[x["index"]] = x["finish_reason"]
    assert text == {0: "aaa", 1: "bbb", 2: "aaa", 3: "bbb"}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    ev = events(c, "/v1/chat/completions", {**CHAT, "n": 2, "seed": 0, "temperature": 1.0})
    roles = [e["choices"][0]["index"] for e in ev if "role" in e["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]  # each choice's first chunk names the role


# ---------------------------------------------------------------- logprobs formats


def lp(pos: int) -> float:
    return -(pos % 5 + 1) / 4  # fake_logprob's chosen-token value at position pos


A100, A101 = TOK.decode([100]), TOK.decode([101])  # 'a', 'b': byte tokens 100 - 3, 101 - 3


def test_completion_logprobs_format():
    c, _ = app_for(StubBackend(ids("xy")))
    r = c.post("/v1/completions", json={**BODY, "logprobs": 2})  # prompt "hi": 3 tokens with the BOS
    got = r.json()["choices"][0]["logprobs"]
    assert got == {
        "tokens": ["x", "y"],
        "token_logprobs": [lp(3), lp(4)],
        "top_logprobs": [{"x": lp(3), A100: -0.125, A101: -1.125}, {"y": lp(4), A100: -0.125, A101: -1.125}],
        "text_offset": [0, 1],
    }
    r = c.post("/v1/completions", json={**BODY, "logprobs": 0})
    got = r.json()["choices"][0]["logprobs"]  # vLLM: logprobs=0 still gives the chosen token's
    assert got["token_logprobs"] == [lp(3), lp(4)] and got["top_logprobs"] == [{"x": lp(3)}, {"y": lp(4)}]
    assert c.post("/v1/completions", json=BODY).json()["choices"][0]["logprobs"] is None


def test_echo_with_logprobs_aligns_prompt_and_completion():
    c, _ = app_for(StubBackend(ids("xy")))
    r = c.post("/v1/completions", json={**BODY, "prompt": "hé", "echo": True, "logprobs": 1})
    ch = r.json()["choices"][0]
    assert ch["text"] == "héxy"
    got = ch["logprobs"]
    # prompt: BOS, 'h', and the two bytes of 'é' (each alone a partial character: U+FFFD)
    assert got["tokens"] == ["", "h", "\ufffd", "\ufffd", "x", "y"]
    assert len(got["tokens"]) == 4 + 2 == len(got["token_logprobs"]) == len(got["top_logprobs"])
    assert got["token_logprobs"] == [None, lp(1), lp(2), lp(3), lp(4), lp(5)]
    assert got["top_logprobs"][0] is None and got["top_logprobs"][1] == {"h": lp(1), A100: -0.125}
    assert got["text_offset"] == [0, 0, 1, 2, 3, 4]
    r = c.post("/v1/completions", json={**BODY, "prompt": [5, 6], "echo": True})
    assert r.json()["choices"][0]["text"] == TOK.decode([5, 6]) + "xy"  # token prompts: decoded


def test_chat_logprobs_format():
    c, _ = app_for(StubBackend(ids("é")))  # two byte tokens
    r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1})
    ch = r.json()["choices"][0]
    n_prompt = len(TOK.encode("<|user|>\nq\n<|assistant|>\n"))
    entry = {"token": "\ufffd", "bytes": [0xEF, 0xBF, 0xBD]}
    top = [{"token": A100, "logprob": -0.125, "bytes": [ord(A100)]}]
    assert ch["message"]["content"] == "é"
    assert ch["logprobs"] == {
        "content": [
            {**entry, "logprob": lp(n_prompt), "top_logprobs": top},
            {**entry, "logprob": lp(n_prompt + 1), "top_logprobs": top},
        ]
    }


def test_streamed_logprobs_cover_each_chunks_tokens():
    c, _ = app_for(StubBackend(ids("abcd")))
    ev = events(c, "/v1/completions", {**BODY, "max_tokens": 4, "logprobs": 1, "echo": True})
    tokens, offsets, lps = [], [], []
    for e in ev:
        x = e["choices"][0]
        if x["logprobs"] is not None:
            tokens += x["logprobs"]["tokens"]
            offsets += x["logprobs"]["text_offset"]
            lps += x["logprobs"]["token_logprobs"]
    assert "".join(e["choices"][0]["text"] for e in ev) == "hiabcd"
    assert tokens == ["", "h", "i", "a", "b", "c", "d"] and offsets == [0, 0, 1, 2, 3, 4, 5]
    assert lps == [None] + [lp(i) for i in range(1, 7)]
    ev = events(c, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "logprobs": True})
    content = [y for e in ev for y in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [y["token"] for y in content] == ["a", "b", "c", "d"]
    assert all(y["top_logprobs"] == [] for y in content)


def test_missing_backend_logprobs_is_an_error_not_a_misaligned_answer():
    b = StubBackend(ids("ab"))
    c, _ = app_for(b)
    real = b.submit

    def no_logprobs(prompt, params):  # a backend that ignores params.logprobs
        import dataclasses

        h = real(prompt, dataclasses.replace(params, logprobs=None))
        h.request.params = params
        return h

    b.submit = no_logprobs
    r = c.post("/v1/completions", json={**BODY, "logprobs": 1})
    assert r.status_code == 500 and "0 entries for 2 tokens" in r.json()["error"]["message"]


# ---------------------------------------------------------------- the openai client


def test_openai_client_reads_list_prompts_n_and_logprobs():
    c, _ = app_for(StubBackend(by_seed))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="EMPTY", http_client=c, max_retries=0)
    r = client.completions.create(
        model="stub", prompt=[[5, 6], [7]], n=2, seed=0, temperature=1.0, max_tokens=2, logprobs=1, echo=True
    )
    assert [x.index for x in r.choices] == [0, 1, 2, 3]
    assert [x.text[-2:] for x in r.choices] == ["aa", "bb", "aa", "bb"]
    assert r.choices[2].logprobs.token_logprobs[0] is None and len(r.choices[2].logprobs.tokens) == 1 + 2
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 8
    r = client.chat.completions.create(
        model="stub",
        messages=[{"role": "user", "content": "q"}],
        max_tokens=2,
        seed=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert [t.token for t in r.choices[0].logprobs.content] == ["a", "a"]
    assert [t.token for t in r.choices[0].logprobs.content[0].top_logprobs] == [A100, A101]
    assert client.models.retrieve("stub").id == "stub"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
