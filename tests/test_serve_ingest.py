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
from hmoe_jax.serve.ingest import Ingest
from hmoe_jax.serve.openai_protocol import ApiError, ChatMessage, ChatTemplate

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
