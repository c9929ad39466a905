"""Structured output (OpenAI's response_format json_object / json_schema) as a per-row token
mask, through llguidance (chosen over outlines-core by measured host cost per token:
results/bench_grammar_*.json, tools/bench_grammar.py).

A request's SamplingParams.structured is (kind, spec JSON). GrammarCompiler holds one
tokenizer's llguidance view (built on first use: ~20 ms at 2K ids, ~3.5 s at 129K) and
checks / compiles a spec; Grammar is one sequence's matcher. Each step, a row with a grammar
gets an allowed-token bitmask (int32 words, bit t % 32 of word t // 32, llguidance's layout)
computed on the host; the sampler sets every other token's logit to -inf before anything
else. The grammar's own "end" token is replaced by the row's stop ids, allowed only once the
document is complete; once nothing can follow (is_stopped) the sequence ends at once with
finish "stop", without spending a step on a stop id.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

KINDS = ("json_object", "json_schema")
# json_object: any JSON object (OpenAI's "JSON mode")
_ANY_OBJECT = {"type": "object"}


def schema_of(kind: str, spec: str) -> dict[str, Any]:
    """The JSON schema a (kind, spec JSON) stands for; ValueError naming a bad one."""
    if kind not in KINDS:
        raise ValueError(f"structured output: kind must be one of {KINDS}, got {kind!r}")
    if kind == "json_object":
        return _ANY_OBJECT
    try:
        schema = json.loads(spec)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"structured output: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured output: a JSON schema is an object, got {type(schema).__name__}")
    return schema


# Compact JSON: no whitespace between tokens (as vLLM's disable_any_whitespace). With the
# library's default (any whitespace anywhere) a weak model can spend its whole budget on
# blanks; compact output also costs fewer tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


def compile_grammar(kind: str, spec: str, tokenizer: Any = None) -> str:
    """The llguidance grammar of (kind, spec); ValueError with the library's message when it
    does not compile (checked against `tokenizer`, an LLTokenizer, when given)."""
    import llguidance

    try:
        g = llguidance.LLMatcher.grammar_from_json_schema(schema_of(kind, spec), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(g, tokenizer)
    if err and not err.startswith("WARNING"):
        raise ValueError(f"invalid JSON schema: {err}")
    return g


def check_schema(kind: str, spec: str) -> None:
    """ValueError when (kind, spec) does not compile (the checks that need no tokenizer)."""
    compile_grammar(kind, spec)


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bitmask_of(allowed: Collection[int], vocab_size: int) -> np.ndarray:
    """Token ids -> the int32 bitmask [words(vocab_size)] that allows exactly them."""
    bits = np.zeros(words(vocab_size) * 32, bool)
    bits[list(allowed)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


class GrammarCompiler:
    """A tokenizer's grammar side. `tokenizer_json`: the tokenizer.json text (HF byte-level
    BPE and the other tokenizers llguidance reads), or None for the byte-level fallback
    tokenizer (io/tokenizer.py ByteTokenizer: id 3 + b is byte b)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, int(vocab_size), tuple(eos_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
        """From an io/tokenizer.py tokenizer (HFTokenizer or ByteTokenizer)."""
        inner = getattr(tokenizer, "_tok", None)
        return cls(inner.to_str() if inner is not None else None, vocab_size, eos_ids)

    @functools.cached_property
    def _ll_tokenizer(self):
        import llguidance

        eos = self.eos_ids[0] if self.eos_ids else 0
        if self.tokenizer_json is not None:
            return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(self.vocab_size, eos)))

    def grammar(self, kind: str, spec: str) -> str:
        """The llguidance grammar of (kind, spec); ValueError with the library's message."""
        return compile_grammar(kind, spec, self._ll_tokenizer)

    def check(self, kind: str, spec: str) -> None:
        self.grammar(kind, spec)

    def start(self, kind: str, spec: str, stops: Collection[int]) -> Grammar:
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer, self.grammar(kind, spec))
        if m.is_error():
            raise ValueError(f"invalid JSON schema: {m.get_error()}")
        return Grammar(m, self.vocab_size, stops, self.eos_ids[0] if self.eos_ids else 0)


class Grammar:
    """One sequence's matcher: allowed() before a step, advance(token) after it."""

    def __init__(self, matcher: Any, vocab_size: int, stops: Collection[int], ll_eos: int):
        self._m, self.vocab_size, self._ll_eos = matcher, vocab_size, ll_eos
        self._stops = sorted(t for t in stops if 0 <= t < vocab_size)
        self._mask = np.empty(words(vocab_size), np.int32)

    def allowed(self) -> np.ndarray:
        """The int32 bitmask [words(V)] of the tokens the grammar allows next: its tokens, its
        end token cleared, the row's stop ids once the document is complete."""
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._m.is_error():
            raise RuntimeError(f"structured output: the grammar failed ({self._m.get_error()})")
        out = self._mask.copy()
        u = out.view(np.uint32)
        u[self._ll_eos // 32] &= ~np.uint32(1 << (self._ll_eos % 32))
        if self._m.is_accepting():
            for t in self._stops:
                u[t // 32] |= np.uint32(1 << (t % 32))
        return out

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {token} rejected ({self._m.get_error()})")

    @property
    def complete(self) -> bool:
        """Nothing can follow: the document is whole."""
        return bool(self._m.is_stopped())


class _ByteVocab:
    """The byte-level fallback tokenizer as llguidance's TokenizerWrapper reads it."""

    # io/tokenizer.py ByteTokenizer's fixed layout (model/ sits below io/ so it is restated;
    # tests/test_structured_output.py checks the two agree): 0 <bos>, 1 <eos>, 2 <pad>, byte b
    # at 3 + b
    OFFSET, BOS = 3, 0

    def __init__(self, vocab_size: int, eos: int):
        off = self.OFFSET
        self.eos_token_id, self.bos_token_id = eos, self.BOS
        names = {0: b"<bos>", 1: b"<eos>", 2: b"<pad>"}
        self.tokens = [
            bytes([i - off]) if off <= i < off + 256 else names.get(i, b"<unused%d>" % i)
            for i in range(vocab_size)
        ]
        self.special_token_ids = [i for i in range(vocab_size) if not off <= i < off + 256]
        self._off = off

    def __call__(self, text: bytes) -> list[int]:
        return [self._off + b for b in text]
