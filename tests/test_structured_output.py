"""Structured output (issue #28): the sampler's token mask against numpy references (masked
argmax, masked distribution), the grammar's masks on the byte-level tokenizer, the tiny
engine's json_schema / json_object output parsed and validated (greedy and sampled, alone
and beside an unconstrained row that must sample exactly as alone), and response_format
through the HTTP app with the unmodified openai client on a real scheduler."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.io.tokenizer import ByteTokenizer
from hmoe_jax.model.sampling import (
    RowHistory,
    SamplingParams,
    _filter_row,
    filtered_probs_ref,
    mask_rows,
    sample_batch,
)
from hmoe_jax.model.structured import GrammarCompiler, _ByteVocab, bitmask_of

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "colour"],
    "additionalProperties": False,
}


def validate(doc, schema=SCHEMA) -> None:
    """jsonschema when installed, else the keys and types by hand."""
    try:
        import jsonschema
    except ImportError:
        assert set(doc) == set(schema["required"]), doc
        assert isinstance(doc["ok"], bool) and isinstance(doc["n"], int) and 0 <= doc["n"] <= 99
        assert doc["colour"] in schema["properties"]["colour"]["enum"]
        return
    jsonschema.validate(doc, schema)


def _masked_ref(logits: np.ndarray, allowed: set[int]) -> np.ndarray:
    """numpy: every token outside `allowed` at -inf, written token by token."""
    out = np.asarray(logits, np.float64).copy()
    for t in range(out.size):
        if t not in allowed:
            out[t] = -np.inf
    return out


# ------------------------------------------------------------------ the sampler alone


@pytest.mark.parametrize("v", [8, 33, 70])
def test_mask_rows_and_masked_argmax_match_numpy(v):
    rng = np.random.default_rng(v)
    logits = rng.normal(0, 3, (6, v)).astype(np.float32)
    allowed = [set(rng.choice(v, rng.integers(1, v), replace=False).tolist()) for _ in range(6)]
    allowed[2] = {v - 1}  # the last id of a partial word
    got = np.asarray(mask_rows(logits, np.stack([bitmask_of(a, v) for a in allowed])))
    history = [RowHistory([0], [], (), bitmask_of(a, v)) for a in allowed]
    toks = sample_batch(logits, [SamplingParams()] * 6, [0] * 6, history)
    for i, a in enumerate(allowed):
        ref = _masked_ref(logits[i], a)
        assert np.array_equal(np.isneginf(got[i]), np.isneginf(ref))
        assert np.array_equal(got[i][np.isfinite(ref)], logits[i][np.isfinite(ref)])  # kept bit for bit
        assert toks[i] == int(np.argmax(ref)), f"row {i}"


@pytest.mark.parametrize("t,p,k", [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3)])
def test_masked_distribution_matches_numpy(t, p, k):
    v = 40
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, v).astype(np.float32)
    allowed = set(rng.choice(v, 12, replace=False).tolist())
    masked = np.asarray(mask_rows(logits[None], bitmask_of(allowed, v)[None]))[0]
    got = np.asarray(jax.nn.softmax(_filter_row(masked, t, p, k)))
    ref = filtered_probs_ref(_masked_ref(logits, allowed), t, p, k)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert ref[[i for i in range(v) if i not in allowed]].sum() == 0
    # and draws stay inside the mask, whatever the seed
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s) for s in range(64)]
    hist = [RowHistory([0], [], (), bitmask_of(allowed, v))] * 64
    draws = sample_batch(np.tile(logits, (64, 1)), params, [0] * 64, hist)
    assert set(draws.tolist()) <= allowed


def test_the_mask_comes_before_the_processors():
    """A logit_bias of +100 on a masked-out token cannot bring it back."""
    v = 16
    logits = np.zeros((1, v), np.float32)
    p = SamplingParams(logit_bias=((3, 100.0),))
    h = [RowHistory([0], [], (), bitmask_of({5, 9}, v))]
    assert sample_batch(logits, [p], [0], h)[0] in (5, 9)
    assert sample_batch(logits, [p], [0], [RowHistory([0], [], ())])[0] == 3


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_plain_rows_are_bit_identical_beside_masked_rows(temperature):
    v = 50
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (4, v)).astype(np.float32)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    plain = [RowHistory([0], [], ())] * 4
    alone = sample_batch(logits, params, [2] * 4, plain)
    mixed = [plain[0], RowHistory([0], [], (), bitmask_of({1}, v)), plain[2], plain[3]]
    got = sample_batch(logits, params, [2] * 4, mixed)
    assert got[1] == 1
    assert [got[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]


def test_a_bad_mask_shape_is_refused():
    with pytest.raises(ValueError, match="token mask has shape"):
        sample_batch(
            np.zeros((1, 40), np.float32),
            [SamplingParams()],
            [0],
            [RowHistory([0], [], (), np.zeros(1, np.int32))],
        )


def test_structured_params_are_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        SamplingParams(structured=("yaml", "")).validate()
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(structured=("json_schema", "{")).validate()


# ------------------------------------------------------------------ the grammar on the byte tokenizer


def _ids(mask: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist()


def test_byte_vocab_agrees_with_the_byte_tokenizer():
    tok, vocab = ByteTokenizer(300), _ByteVocab(300, 1)
    assert vocab(b"{a}") == tok.encode("{a}")[1:]
    assert (ByteTokenizer.OFFSET, ByteTokenizer.BOS) == (_ByteVocab.OFFSET, _ByteVocab.BOS)


def test_grammar_masks_follow_the_schema_and_end_with_the_stop_ids():
    tok = ByteTokenizer(300)
    g = GrammarCompiler.for_tokenizer(tok, 300, (1,)).start("json_schema", json.dumps(SCHEMA), {1, 2})
    doc = '{"ok":true,"n":7,"colour":"blue"}'
    for i, t in enumerate(tok.encode(doc)[1:]):
        allowed = _ids(g.allowed())
        assert t in allowed and 1 not in allowed and 2 not in allowed, (doc[:i], allowed)
        if doc[:i] == '{"ok":':
            assert sorted(allowed) == sorted(tok.encode("tf")[1:])  # true / false only
        assert not g.complete
        g.advance(t)
    assert g.complete and _ids(g.allowed()) == [1, 2]  # only the stop ids once it is whole


# ------------------------------------------------------------------ the tiny engine


@functools.cache
def model():
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config("deepseek_v3_tiny")
    return cfg, random_params(cfg, seed=11)


@functools.cache
def engine():
    from tests.helpers import reference_engine

    cfg, params = model()
    eng = reference_engine(params, cfg, 1, max_batch=4, max_len=96)
    eng.grammars = GrammarCompiler.for_tokenizer(ByteTokenizer(cfg.vocab_size), cfg.vocab_size, cfg.eos_ids)
    return eng


TOK = ByteTokenizer(512)
PROMPT = TOK.encode("Answer in JSON:")


def _run(seqs):
    eng = engine()
    while not all(s.done for s in seqs):
        eng.step([s for s in seqs if not s.done])
    return seqs


def _schema_params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=60, structured=("json_schema", json.dumps(SCHEMA)), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_json_schema_output_parses_and_validates(temperature):
    eng = engine()
    (s,) = _run([eng.start(PROMPT, _schema_params(temperature=temperature, seed=5), schedule="cpu")])
    assert s.finish_reason == "stop"
    validate(json.loads(TOK.decode(s.tokens)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_structured_row_beside_a_plain_row(temperature):
    eng = engine()
    plain = SamplingParams(max_new_tokens=12, stop_ids=(), temperature=temperature, seed=9)
    (solo,) = _run([eng.start(PROMPT[:6], plain, schedule="cpu")])
    a = eng.start(PROMPT[:6], plain, schedule="cpu")
    b = eng.start(PROMPT, _schema_params(temperature=temperature, seed=2), schedule="cpu")
    _run([a, b])
    assert a.tokens == solo.tokens
    validate(json.loads(TOK.decode(b.tokens)))
    assert eng.pool.in_use == 0


def test_engine_json_object_output_is_an_object():
    eng = engine()
    close = TOK.encode("}")[1]  # a random model may write keys forever: the bias closes it
    p = SamplingParams(max_new_tokens=40, structured=("json_object", ""), logit_bias=((close, 30.0),))
    (s,) = _run([eng.start(PROMPT, p, schedule="cpu")])
    assert s.finish_reason == "stop"
    assert isinstance(json.loads(TOK.decode(s.tokens)), dict)


def test_engine_without_a_grammar_side_refuses():
    from tests.helpers import reference_engine

    cfg, params = model()
    eng = reference_engine(params, cfg, 1, max_batch=1, max_len=32)
    with pytest.raises(ValueError, match="structured output"):
        eng.admit(PROMPT, _schema_params())
    with pytest.raises(ValueError, match="invalid JSON schema"):
        engine().admit(PROMPT, SamplingParams(structured=("json_schema", '{"type": "bogus"}')))
    assert engine().pool.in_use == 0


# ------------------------------------------------------------------ HTTP with the openai client


@pytest.fixture(scope="module")
def client():
    import openai
    from fastapi.testclient import TestClient

    from hmoe_jax.serve.chat_template import ChatTemplate
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
    from hmoe_jax.serve.scheduler import Scheduler

    cfg, _ = model()
    sched = Scheduler(engine(), "fcfs").start()
    opts = ServeOptions(
        model_name="tiny", root="/tiny", vocab_size=cfg.vocab_size, max_model_len=96, eos_ids=cfg.eos_ids
    )
    state = ServerState(sched, TOK, ChatTemplate(None, TOK.encode), opts)
    with TestClient(create_app(state)) as c:
        yield c, openai.OpenAI(base_url="http://testserver/v1", api_key="EMPTY", http_client=c, max_retries=0)
    sched.close()


def test_openai_client_response_format_json_schema(client):
    _, oc = client
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = oc.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=60,
        temperature=0,
        response_format=fmt,
    )
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content))
    r = oc.completions.create(
        model="tiny",
        prompt="json:",
        max_tokens=60,
        temperature=0.7,
        seed=1,
        extra_body={"response_format": fmt},
    )
    validate(json.loads(r.choices[0].text))


def test_http_invalid_schema_is_a_400_naming_the_field(client):
    c, _ = client
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "response_format": bad})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and "bogus" in err["message"]
    r = c.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"
