"""Training text: the Python standard library source installed with the interpreter.

Files are listed in sorted relative-path order (site-packages excluded, non-UTF-8 and very
large files skipped) and split BY FILE: a file is held out when crc32(relative path) falls
in the held-out fraction, so no held-out line was ever seen in training, and the split does
not depend on the order files are found. A byte-level BPE (`tokenizers`) is trained on the
training files only; each file becomes `<bos> tokens <eos>` and the files are concatenated
into one token stream per split. Batches are random windows of that stream drawn from a
seeded numpy generator.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 0, 1, 2 (the byte fallback's ids too)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
MAX_FILE_BYTES = 200_000  # skip generated tables and test data blobs


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[tuple[str, str]]  # (relative path, text)
    heldout: list[tuple[str, str]]

    @property
    def digest(self) -> str:
        """sha256 over the paths and texts of both splits: two corpora are the same data."""
        h = hashlib.sha256()
        for split in (self.train, self.heldout):
            for rel, text in split:
                h.update(rel.encode() + b"\0" + text.encode() + b"\0")
            h.update(b"|")
        return h.hexdigest()[:16]

    def summary(self) -> dict:
        return {
            "root": str(self.root),
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": sum(len(t.encode()) for _, t in self.train),
            "heldout_bytes": sum(len(t.encode()) for _, t in self.heldout),
            "digest": self.digest,
        }


def is_heldout(rel: str, heldout_per_mille: int) -> bool:
    return zlib.crc32(rel.encode()) % 1000 < heldout_per_mille


def load_corpus(
    root: Path | None = None, heldout_per_mille: int = 50, max_files: int | None = None
) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    train, held = [], []
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    for p in paths[:max_files] if max_files else paths:
        rel = p.relative_to(root).as_posix()
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if not raw.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        (held if is_heldout(rel, heldout_per_mille) else train).append((rel, text))
    if not train or not held:
        raise ValueError(f"{root}: corpus split is empty (train {len(train)}, held-out {len(held)} files)")
    return Corpus(root=root, train=train, heldout=held)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over `texts`; ids 0..2 are <bos>, <eos>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: hmoe_jax.io.tokenizer prepends <bos> on encode from this."""
    return {"add_bos_token": True, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """<bos> ids <eos> per text, concatenated: int32 [N]."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = [np.concatenate([[BOS_ID], e.ids, [EOS_ID]]) for e in encs]
    return np.concatenate(parts).astype(np.int32)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """[batch, length + 1] int32 windows starting at uniform positions."""
    starts = rng.integers(0, stream.size - length - 1, batch)
    return np.stack([stream[s : s + length + 1] for s in starts])


def eval_windows(stream: np.ndarray, n: int, length: int) -> np.ndarray:
    """[n', length + 1] fixed, evenly spaced, non-overlapping windows (n' <= n)."""
    stride = length + 1
    count = min(n, stream.size // stride)
    step = (stream.size // stride) // count
    return np.stack([stream[i * step * stride : i * step * stride + stride] for i in range(count)])


def heldout_windows(ckpt: Path, n: int, seq_len: int, heldout_per_mille: int) -> np.ndarray:
    """[n', seq_len + 1] evenly spaced windows of the held-out stdlib files, encoded with the
    tokenizer.json of checkpoint ckpt (what experiments/e07_quality.py and the shipped
    model's test score)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    corpus = load_corpus(heldout_per_mille=heldout_per_mille)
    return eval_windows(encode_stream(tok, [t for _, t in corpus.heldout]), n, seq_len)


def save_tokenizer(tok, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
