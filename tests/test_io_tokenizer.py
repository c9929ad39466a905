"""Tokenizers: the byte-level fallback against Python's own UTF-8 codec, and a checkpoint's
tokenizer.json through the `tokenizers` library."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["The hybrid engine", "", "naïve café ☕ 混合专家 🚀", "tabs\tand\nnewlines\x00"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_is_utf8_plus_offset(text):
    tok = ByteTokenizer(512)
    ids = tok.encode(text)
    assert ids == [0] + [3 + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text


def test_byte_fallback_decode_edge_cases():
    tok = ByteTokenizer(300)
    # Invalid UTF-8 (a lone continuation byte, a truncated 3-byte sequence) is replaced
    # exactly as bytes.decode(errors="replace") does.
    raw = b"a\x80b\xe6\xb7"
    assert tok.decode([3 + b for b in raw]) == raw.decode("utf-8", errors="replace") == "a\ufffdb\ufffd"
    # Special ids vanish; ids past the byte range have no byte and become U+FFFD.
    assert tok.decode([0, 3 + ord("x"), 1, 2, 259, 299, 3 + ord("y")]) == "x\ufffd\ufffdy"
    with pytest.raises(
        CheckpointError, match=r"byte-level tokenizer needs vocab_size >= 259, the model has 100"
    ):
        ByteTokenizer(100)


def _hf_tokenizer(path):
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "the": 3, "hybrid": 4, "engine": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_tokenizer_json_used_when_present(tmp_path):
    ref = _hf_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=6)
    assert isinstance(tok, HFTokenizer) and tok.name == "tokenizer.json"
    text = "the hybrid engine zzz"
    assert tok.encode(text) == ref.encode(text).ids == [0, 3, 4, 5, 2]
    assert tok.decode([0, 3, 4, 5, 1]) == "the hybrid engine"  # specials skipped
    # Without a tokenizer.json (or no checkpoint at all): the byte fallback.
    assert isinstance(load_tokenizer(tmp_path / "missing", 512), ByteTokenizer)
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)


def test_add_bos_token_from_tokenizer_config(tmp_path):
    """DeepSeek-V3's tokenizer.json has no BOS post-processor; tokenizer_config.json says
    add_bos_token: the BOS must still come first (once)."""
    ref = _hf_tokenizer(tmp_path)
    ref.post_processor = None
    ref.save(str(tmp_path / "tokenizer.json"))
    assert ref.encode("the engine").ids == [3, 5]
    assert load_tokenizer(tmp_path, 6).encode("the engine") == [3, 5]  # no config: as the library
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": {"content": "<s>"}})
    )
    assert load_tokenizer(tmp_path, 6).encode("the engine") == [0, 3, 5]
    _hf_tokenizer(tmp_path)  # with the BOS post-processor again: not doubled
    assert load_tokenizer(tmp_path, 6).encode("the engine") == [0, 3, 5]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<bos>"}))
    with pytest.raises(
        CheckpointError,
        match=r"tokenizer_config.json: add_bos_token is set but bos_token '<bos>' is not in tokenizer.json",
    ):
        load_tokenizer(tmp_path, 6)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: cannot read tokenizer") as e:
        load_tokenizer(tmp_path, 512)
    assert "\n" not in str(e.value)
