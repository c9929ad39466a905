"""Text <-> token ids: the checkpoint's tokenizer.json through the `tokenizers` library
when present, else a byte-level fallback.

Byte-level fallback (fixed, documented in docs/checkpoints.md): id 0 = <bos>, 1 = <eos>,
2 = <pad>, and byte b (0..255) of the UTF-8 encoding is id 3 + b, so it needs a vocabulary
of >= 259 ids. encode() prepends <bos>; decode() drops special ids, maps every other id
outside the byte range to U+FFFD, and decodes the bytes as UTF-8 with invalid sequences
replaced (U+FFFD), so decode(encode(s)) == s for any str s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from hmoe_jax.io.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer(Protocol):
    name: str
    # The most characters of input text one token can cover, or None when the tokenizer
    # cannot bound it (an unknown-word token can swallow a whole word; a normalizer can drop
    # characters). A text of C characters then encodes to at least C / max_token_chars
    # tokens, so a prompt can be refused as too long before it is tokenized.
    max_token_chars: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    BOS, EOS, PAD = 0, 1, 2
    OFFSET = 3  # id of byte 0x00
    MIN_VOCAB = OFFSET + 256
    name = "bytes"
    max_token_chars = 1  # one token per UTF-8 byte: at most one character starts in it

    def __init__(self, vocab_size: int):
        if vocab_size < self.MIN_VOCAB:
            raise CheckpointError(
                f"byte-level tokenizer needs vocab_size >= {self.MIN_VOCAB}, the model has {vocab_size}; add a tokenizer.json"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [self.OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i in (self.BOS, self.EOS, self.PAD):
                continue
            b = i - self.OFFSET
            # An id past the byte range has no byte: emit U+FFFD's UTF-8 encoding.
            out += bytes([b]) if 0 <= b < 256 else "\ufffd".encode()
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json; encode adds the special tokens its post-processor defines, decode
    skips special tokens. Many releases (DeepSeek-V3 among them) leave the BOS to
    transformers' `add_bos_token` in tokenizer_config.json instead of the post-processor:
    that flag is honoured too, so the model sees the BOS it was trained with."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on bad files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: cannot read tokenizer ({first})") from None
        self.bos_id = _config_bos_id(path.with_name(TOKENIZER_CONFIG_FILE), self._tok)
        self.max_token_chars = _byte_level_token_chars(path, self._tok)

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: the library's encode holds the GIL for the whole text
        # (measured: a 1 MB text on a thread let the event loop run 10 times in 9.8 s),
        # encode_batch releases it (3,911 times in 6.1 s), so a server can tokenize a long
        # prompt on a worker thread while its event loop keeps streaming. Same ids.
        ids = list(self._tok.encode_batch([text], add_special_tokens=True)[0].ids)
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _byte_level_token_chars(path: Path, tok) -> int | None:
    """max_token_chars of a byte-level BPE without a normalizer (GPT-2's, Llama 3's,
    DeepSeek-V3's): a vocabulary entry is one character per byte and a token covers its
    bytes, so no token covers more characters than its entry is long; added (special)
    tokens match their text literally. Anything else: None (no bound)."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    norm = spec.get("normalizer")
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        return None
    pre = spec.get("pre_tokenizer") or {}
    kinds = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", ())}
    if spec.get("model", {}).get("type") != "BPE" or "ByteLevel" not in kinds:
        return None
    return max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def _config_bos_id(path: Path, tok) -> int | None:
    """The BOS id to prepend per tokenizer_config.json (add_bos_token + bos_token), or None."""
    if not path.exists():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not cfg.get("add_bos_token"):
        return None
    bos = cfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    bos_id = tok.token_to_id(bos) if isinstance(bos, str) else None
    if bos_id is None:
        raise CheckpointError(f"{path}: add_bos_token is set but bos_token {bos!r} is not in tokenizer.json")
    return bos_id


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer.json if it has one, else the byte-level fallback."""
    if checkpoint is not None:
        p = Path(checkpoint) / TOKENIZER_FILE
        if p.exists():
            return HFTokenizer(p)
    return ByteTokenizer(vocab_size)
