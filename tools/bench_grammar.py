"""Structured-output grammar libraries on this project's tokenizers: compile time of a typical
JSON schema and per-token host cost (mask into a bitmask + advance by the sampled token),
median over the tokens of a valid JSON document, teacher-forced.

Tokenizers: the shipped byte-level BPE (hmoe_jax/assets/deepseek_v3_stdlib, vocab 2048) and a
129,280-id byte-level BPE (DeepSeek-V3's vocabulary size) built offline from it by adding
random merges of existing tokens (a valid BPE, but its token strings are not a real
language's: long tokens are concatenations of short ones). The per-token mask cost grows
with the vocabulary, which is why both are measured.

    python tools/bench_grammar.py [--out results/bench_grammar.json]

Prints one line per (library, tokenizer) and ends stdout with one JSON line. A library that
is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

TOKENIZER = Path(__file__).resolve().parents[1] / "hmoe_jax/assets/deepseek_v3_stdlib/tokenizer.json"
BIG_VOCAB = 129_280
EOS_ID = 1

SCHEMA = {  # a typical extraction schema: nested object, array, enum, numbers, optional field
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "tags", "address", "role", "active"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematician", "writer", "analytical engine", "notes on the engine", "poetical science"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "role": "admin",
    "score": 98.25,
    "active": True,
    "bio": (
        "Augusta Ada King was an English mathematician and writer, chiefly known for her work on "
        "Charles Babbage's proposed mechanical general-purpose computer, the Analytical Engine. "
        "She was the first to recognise that the machine had applications beyond pure calculation, "
        "and published the first algorithm intended to be carried out by such a machine: her notes "
        "describe a method for calculating a sequence of Bernoulli numbers with the Engine."
    ),
}


def big_tokenizer_json(n_vocab: int, seed: int = 0) -> str:
    """The shipped tokenizer.json grown to n_vocab ids by random merges of existing tokens."""
    spec = json.loads(TOKENIZER.read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    special = {a["content"] for a in spec["added_tokens"]}
    pool = [t for t in vocab if t not in special]
    rng = np.random.default_rng(seed)
    while len(vocab) < n_vocab:
        a, b = pool[rng.integers(len(pool))], pool[rng.integers(len(pool))]
        if len(a) + len(b) > 16 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append([a, b])
        pool.append(a + b)
    return json.dumps(spec)


def doc_tokens(tok_json: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    return tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False).ids


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted (token string char -> byte)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def bench_llguidance(tok_json: str, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, eos_token=EOS_ID)
    tok_s = time.perf_counter() - t0
    n = tok.vocab_size
    compile_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        m = llguidance.LLMatcher(tok, grammar)
        compile_s.append(time.perf_counter() - t0)
    assert not m.is_error(), m.get_error()
    mask = lln.allocate_token_bitmask(1, n)
    mask_s, adv_s = [], []
    for t in tokens:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(m, mask)
        t1 = time.perf_counter()
        assert (mask[0, t // 32] >> (t % 32)) & 1, f"llguidance masked out document token {t}"
        ok = m.consume_token(t)
        t2 = time.perf_counter()
        assert ok, m.get_error()
        mask_s.append(t1 - t0)
        adv_s.append(t2 - t1)
    lln.fill_next_token_bitmask(m, mask)
    assert (mask[0, EOS_ID // 32] >> (EOS_ID % 32)) & 1, "eos not allowed at the end"
    return _summary("llguidance " + llguidance.__version__, n, tok_s, compile_s, mask_s, adv_s)


def bench_outlines(tok_json: str, tokens: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    spec = json.loads(tok_json)
    dec = _byte_decoder()
    t0 = time.perf_counter()
    special = {a["id"] for a in spec["added_tokens"]}
    vmap: dict[bytes, list[int]] = {}
    for s, i in spec["model"]["vocab"].items():
        if i not in special:
            vmap.setdefault(bytes(dec[c] for c in s), []).append(i)
    vocab = outlines_core.Vocabulary(EOS_ID, vmap)
    tok_s = time.perf_counter() - t0
    n = len(spec["model"]["vocab"])
    compile_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
        compile_s.append(time.perf_counter() - t0)
    guide = outlines_core.Guide(index)
    mask = np.zeros((n + 31) // 32, np.int32)
    mask_s, adv_s = [], []
    for t in tokens:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        t1 = time.perf_counter()
        assert (mask[t // 32] >> (t % 32)) & 1, f"outlines-core masked out document token {t}"
        guide.advance(t)
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        adv_s.append(t2 - t1)
    return _summary("outlines-core " + _version("outlines-core"), n, tok_s, compile_s, mask_s, adv_s)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _summary(lib: str, n: int, tok_s: float, compile_s: list, mask_s: list, adv_s: list) -> dict:
    med = statistics.median
    return {
        "library": lib,
        "vocab": n,
        "tokenizer_setup_s": round(tok_s, 4),
        "compile_ms_median": round(med(compile_s) * 1e3, 3),
        "compile_ms_first": round(compile_s[0] * 1e3, 3),
        "tokens": len(mask_s),
        "mask_us_median": round(med(mask_s) * 1e6, 2),
        "mask_us_p90": round(float(np.percentile(mask_s, 90)) * 1e6, 2),
        "advance_us_median": round(med(adv_s) * 1e6, 2),
        "per_token_us_median": round(med(a + b for a, b in zip(mask_s, adv_s)) * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = []
    tokenizers = {"shipped_2048": TOKENIZER.read_text(), "synthetic_129280": big_tokenizer_json(BIG_VOCAB)}
    for name, tok_json in tokenizers.items():
        tokens = doc_tokens(tok_json)
        for fn in (bench_llguidance, bench_outlines):
            try:
                r = fn(tok_json, tokens)
            except ImportError as e:
                r = {"library": fn.__name__.removeprefix("bench_"), "error": f"not installed: {e}"}
            except Exception as e:  # a library failing on a tokenizer is a result too
                r = {"library": fn.__name__.removeprefix("bench_"), "error": f"{type(e).__name__}: {e}"}
            r["tokenizer"] = name
            print(json.dumps(r))
            results.append(r)
    out = {
        "schema": SCHEMA,
        "document_chars": len(json.dumps(DOC, separators=(",", ":"))),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
