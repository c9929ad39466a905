"""Every OpenAI request parameter of issue #28 end to end: a real `hmoe serve` subprocess on
the tiny shipped model, driven by the unmodified `openai` client (sync, and AsyncOpenAI),
its answers checked against references computed in this process, independently of the
server:

- logprobs (completions 0 and 5, echo's prompt entries, chat logprobs / top_logprobs): the
  numpy log-softmax of a teacher-forced forward of the same model over prompt + output
  (model/generate.py teacher_forced_logits), to tests/test_sampling_processors.py's tolerance;
- n, list prompts, lists of token lists: the engine's own solo runs (a seeded sample j is
  the solo request with seed + j; greedy copies are identical);
- presence / frequency / repetition penalties, logit_bias, min_p, min_tokens, stop_token_ids:
  solo in-process Engine runs with the same SamplingParams; the tokens must be equal.

The server runs the exact policy (--precision f32 --expert-fn ref: the FFI experts round
activations to bf16, which would blur the logprob comparison), and the in-process Engine
the same options. Few tokens per request keep the module quick (~65 s on 2 cores in the
default lane, most of it the server's start and the reference's compiles; the chat and
text-prompt tests, which compile new prompt shapes, are marked slow).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.helpers import (
    CHECKPOINT,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL,
    PROMPTS,
    TEXT,
    client,
    start_server,
    stop_server,
)

ATOL = 1e-4  # tests/test_sampling_processors.py's: f32 engine vs the f32 reference forward
EXACT = ("--precision", "f32", "--expert-fn", "ref")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("serve_engine") / "serve.log", *EXACT)
    yield s
    stop_server(s)


# ---------------------------------------------------------------- the references


@functools.cache
def ref():
    """(engine, params, cfg, tokenizer, chat template) of the checkpoint the server serves,
    the engine with the server's options."""
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.tokenizer import load_tokenizer
    from hmoe_jax.serve.chat_template import ChatTemplate

    ckpt = Path(CHECKPOINT["root"])
    cfg, params = load_checkpoint(ckpt, progress=False)
    eng = Engine(
        params,
        cfg,
        devices=1,
        max_batch=MAX_NUM_SEQS,
        max_len=MAX_MODEL_LEN,
        precision="f32",
        expert_fn="ref",
    )
    tok = load_tokenizer(ckpt, cfg.vocab_size)
    return eng, params, cfg, tok, ChatTemplate(ckpt, tok.encode)


def solo(ids, n: int, stop_ids=(), **sampling) -> list[int]:
    """One request alone on the in-process engine (stop_ids () = EOS ignored)."""
    from hmoe_jax.model.sampling import SamplingParams

    eng = ref()[0]
    sp = SamplingParams(**sampling)
    return eng.generate(list(ids), n, schedule="cpu", stop_ids=stop_ids, sampling=sp).tokens


def log_softmax_rows(ids) -> np.ndarray:
    """[T, V] f64 log-probabilities of a teacher-forced forward over ids."""
    from hmoe_jax.model.generate import teacher_forced_logits

    _, params, cfg, _, _ = ref()
    x = np.asarray(teacher_forced_logits(params, cfg, list(ids)), np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def tstr(tid: int) -> str:
    """A token's string as the server shows it (the decode of that one id)."""
    return ref()[3].decode([int(tid)])


def text_ids(text: str) -> list[int]:
    return list(ref()[3].encode(text))


def chat_ids(content: str) -> list[int]:
    from hmoe_jax.serve.openai_protocol import ChatMessage

    return list(ref()[4].encode([ChatMessage(role="user", content=content)]))


def top_ids(row: np.ndarray, k: int) -> list[int]:
    return [int(t) for t in np.argsort(-row, kind="stable")[:k]]


def check_completion_entry(top: dict, lp: float, row: np.ndarray, tok: int, k: int) -> None:
    """One completions position: the chosen token's logprob, and top_logprobs = the chosen
    token and the k most likely (vLLM's), keyed by token string."""
    assert abs(lp - row[tok]) < ATOL, (lp, row[tok])
    want = {tstr(tok): row[tok]}
    for t in top_ids(row, k):
        want.setdefault(tstr(t), row[t])
    assert set(top) == set(want), (top, want)
    np.testing.assert_allclose([top[s] for s in want], list(want.values()), atol=ATOL)


def body_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("k", [0, 5])
def test_completion_logprobs_equal_a_teacher_forced_forward(server, k):
    prompt = PROMPTS[0]
    r = client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=k,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ch = r.choices[0]
    toks = body_ids(ch)
    assert toks == solo(prompt, 4)
    lp = log_softmax_rows(prompt + toks[:-1])
    p = len(prompt)
    assert ch.logprobs.tokens == [tstr(t) for t in toks]
    assert len(ch.logprobs.token_logprobs) == len(ch.logprobs.top_logprobs) == 4
    for i, tok in enumerate(toks):
        assert tok == int(np.argmax(lp[p - 1 + i]))  # greedy: the forward's argmax
        check_completion_entry(
            ch.logprobs.top_logprobs[i], ch.logprobs.token_logprobs[i], lp[p - 1 + i], tok, k
        )


def test_echo_prompt_logprobs_equal_the_same_forward(server):
    prompt = PROMPTS[1]
    r = client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    ch = r.choices[0]
    toks = solo(prompt, 3)
    ids = prompt + toks
    lp = log_softmax_rows(ids[:-1])
    assert ch.text == ref()[3].decode(prompt) + ref()[3].decode(toks)
    lps = ch.logprobs
    assert lps.tokens == [tstr(t) for t in ids]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None  # nothing predicts it
    for t in range(1, len(ids)):  # prompt entries, then the completion's, one forward
        check_completion_entry(lps.top_logprobs[t], lps.token_logprobs[t], lp[t - 1], ids[t], 2)
    assert lps.text_offset[0] == 0 and lps.text_offset[len(prompt)] == len(ref()[3].decode(prompt))


@pytest.mark.slow  # new prompt shapes: ~15-20 s of compiles on 2 cores
def test_chat_logprobs_and_top_logprobs_equal_a_teacher_forced_forward(server):
    r = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "abcd"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    prompt = chat_ids("abcd")
    toks = solo(prompt, 4)
    lp = log_softmax_rows(prompt + toks[:-1])
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tstr(t) for t in toks]
    for i, (c, tok) in enumerate(zip(content, toks)):
        row = lp[len(prompt) - 1 + i]
        assert abs(c.logprob - row[tok]) < ATOL
        assert c.bytes == list(tstr(tok).encode())
        want = top_ids(row, 3)
        assert [e.token for e in c.top_logprobs] == [tstr(t) for t in want]
        np.testing.assert_allclose([e.logprob for e in c.top_logprobs], row[want], atol=ATOL)


# ---------------------------------------------------------------- n and list prompts


def test_seeded_samples_of_token_list_prompts_equal_solo_runs_with_seed_plus_j(server):
    prompts = [PROMPTS[0], PROMPTS[2]]
    r = client(server).completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        seed=7,
        temperature=0.9,
        max_tokens=4,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ch = sorted(r.choices, key=lambda c: c.index)
    assert [c.index for c in ch] == [0, 1, 2, 3]
    for c in ch:
        i, j = divmod(c.index, 2)  # choice = prompt i, sample j
        assert body_ids(c) == solo(prompts[i], 4, temperature=0.9, seed=7 + j), c.index
    assert body_ids(ch[0]) != body_ids(ch[1]) or body_ids(ch[2]) != body_ids(ch[3])  # seeds differ
    assert r.usage.completion_tokens == 16


@pytest.mark.slow  # new prompt shapes: ~15-20 s of compiles on 2 cores
def test_greedy_copies_of_text_prompts_are_identical_solo_runs(server):
    texts = [TEXT, "abc"]
    r = client(server).completions.create(
        model=MODEL, prompt=texts, n=3, temperature=0, max_tokens=3, extra_body={"ignore_eos": True}
    )
    ch = sorted(r.choices, key=lambda c: c.index)
    assert len(ch) == 6
    for c in ch:
        want = solo(text_ids(texts[c.index // 3]), 3)
        assert c.text == ref()[3].decode(want), c.index


# ---------------------------------------------------------------- logit processors


def _greedy_plain() -> list[int]:
    return solo(PROMPTS[3], 6)


# (request fields, SamplingParams fields, stop ids): the reference runs the same parameters.
def _cases():
    g = _greedy_plain()
    return {
        # sampled (seeded): the tiny model's greedy margins exceed what these penalties move
        "presence": (
            {"presence_penalty": -2.0, "temperature": 1.0, "seed": 5},
            {"presence_penalty": -2.0, "temperature": 1.0, "seed": 5},
            (),
        ),
        "frequency": (
            {"frequency_penalty": -2.0, "temperature": 1.0, "seed": 5},
            {"frequency_penalty": -2.0, "temperature": 1.0, "seed": 5},
            (),
        ),
        "repetition": ({"repetition_penalty": 2.0}, {"repetition_penalty": 2.0}, ()),
        "logit_bias": (
            {"logit_bias": {str(g[0]): -100, "7": 5.0}},
            {"logit_bias": ((7, 5.0), (g[0], -100.0))},
            (),
        ),
        "min_p": (
            {"min_p": 0.3, "temperature": 1.0, "seed": 3},
            {"min_p": 0.3, "temperature": 1.0, "seed": 3},
            (),
        ),
        "stop_token_ids": ({"stop_token_ids": [g[2]]}, {}, (g[2],)),
        "min_tokens": ({"stop_token_ids": [g[0]], "min_tokens": 2}, {"min_tokens": 2}, (g[0],)),
    }


CASES = ["presence", "frequency", "repetition", "logit_bias", "min_p", "stop_token_ids", "min_tokens"]


@pytest.mark.parametrize("name", CASES)
def test_processors_equal_solo_engine_runs(server, name):
    fields, sampling, stop_ids = _cases()[name]
    body = {"temperature": 0, **fields}
    extra = {
        k: v
        for k, v in body.items()
        if k not in ("temperature", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
    }
    std = {k: v for k, v in body.items() if k not in extra}
    r = client(server).completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=6,
        **std,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )
    got = body_ids(r.choices[0])
    want = solo(PROMPTS[3], 6, stop_ids=stop_ids, **sampling)
    assert got == want, (name, got, want)
    if name == "stop_token_ids":
        assert r.choices[0].finish_reason == "stop" and len(got) == 3
    elif name != "min_p":  # the same request without the processor draws other tokens
        plain = {k: v for k, v in sampling.items() if k in ("temperature", "seed")}
        assert got != solo(PROMPTS[3], 6, **plain), f"{name} changed nothing: the case tests nothing"


def test_async_client_concurrent_mixed_parameters(server):
    """AsyncOpenAI, three different requests in flight at once (batched by the server): each
    equals its solo run."""

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
        common = {"model": MODEL, "max_tokens": 5}
        eb = {"ignore_eos": True, "return_token_ids": True}
        reqs = [
            c.completions.create(
                prompt=PROMPTS[0], temperature=0, presence_penalty=1.0, extra_body=eb, **common
            ),
            c.completions.create(prompt=PROMPTS[1], temperature=0.7, seed=11, extra_body=eb, **common),
            c.completions.create(
                prompt=PROMPTS[2],
                temperature=0,
                logprobs=1,
                extra_body={**eb, "repetition_penalty": 1.5},
                **common,
            ),
        ]
        try:
            return await asyncio.gather(*reqs)
        finally:
            await c.close()

    a, b, c = asyncio.run(go())
    assert body_ids(a.choices[0]) == solo(PROMPTS[0], 5, presence_penalty=1.0)
    assert body_ids(b.choices[0]) == solo(PROMPTS[1], 5, temperature=0.7, seed=11)
    toks = body_ids(c.choices[0])
    assert toks == solo(PROMPTS[2], 5, repetition_penalty=1.5)
    lp = log_softmax_rows(PROMPTS[2] + toks[:-1])  # the raw model's, not the penalised
    p = len(PROMPTS[2])
    for i, tok in enumerate(toks):
        check_completion_entry(
            c.choices[0].logprobs.top_logprobs[i],
            c.choices[0].logprobs.token_logprobs[i],
            lp[p - 1 + i],
            tok,
            1,
        )
