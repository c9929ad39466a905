"""The shipped trained default model (hmoe_jax/assets/deepseek_v3_stdlib): it is what
`hmoe generate` runs without --checkpoint, it loads through the normal loader as DeepSeek
block FP8 with its BPE tokenizer, it scores the held-out stdlib files as its training
record says, and the Quick start command prints Python-like text."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hmoe_jax.io import default_model
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.tokenizer import HFTokenizer, load_tokenizer
from hmoe_jax.train.recipe import model_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = default_model.trained_checkpoint()
pytestmark = pytest.mark.skipif(SHIPPED is None, reason="no shipped trained checkpoint in this checkout")


def test_shipped_checkpoint_is_the_recipe_in_fp8_with_its_tokenizer():
    cfg, params = load_checkpoint(SHIPPED, progress=False)
    assert cfg.quant is not None  # DeepSeek block FP8
    assert dataclasses.replace(cfg, quant=None) == model_config(cfg.vocab_size)
    tok = load_tokenizer(SHIPPED, cfg.vocab_size)
    assert isinstance(tok, HFTokenizer) and tok.encode("x")[0] == cfg.bos_token_id
    size = (SHIPPED / "model.safetensors").stat().st_size
    assert size < 12e6, size
    rec = json.loads((SHIPPED / "train_record.json").read_text())
    assert rec["final_heldout_loss"] < rec["curve"][0]["heldout_loss"] - 2.0


def test_default_checkpoint_is_the_trained_one_unless_synthetic_is_asked(monkeypatch, tmp_path):
    monkeypatch.delenv(default_model.ENV_VAR, raising=False)
    path, name = default_model.default_checkpoint(progress=False)
    assert path == SHIPPED and name.startswith("deepseek_v3_stdlib")
    monkeypatch.setenv("HMOE_CACHE", str(tmp_path))
    monkeypatch.setenv(default_model.ENV_VAR, "synthetic")
    path, name = default_model.default_checkpoint(progress=False)
    assert path.parent == tmp_path and name.startswith("deepseek_v3_tiny")
    monkeypatch.setenv(default_model.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="HMOE_DEFAULT_MODEL='nope'"):
        default_model.default_checkpoint(progress=False)


def test_shipped_fp8_model_scores_held_out_files_as_recorded():
    """The FP8 checkpoint is the trained model: its held-out loss on 8 of the record's
    windows is within 5% of the f32 model's recorded loss (64 windows)."""
    from hmoe_jax.model.model import forward_nocache
    from hmoe_jax.train import data

    rec = json.loads((SHIPPED / "train_record.json").read_text())
    corpus = data.load_corpus(heldout_per_mille=rec["recipe"]["heldout_per_mille"])
    if corpus.digest != rec["corpus"]["digest"]:
        pytest.skip("this interpreter's stdlib is not the corpus the shipped model was trained on")
    win = data.heldout_windows(SHIPPED, 8, rec["recipe"]["seq_len"], rec["recipe"]["heldout_per_mille"])
    cfg, params = load_checkpoint(SHIPPED, progress=False)
    logits = np.asarray(forward_nocache(params, cfg, win[:, :-1]), np.float64)
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    nll = -np.take_along_axis(lp, win[:, 1:, None], -1).mean()
    assert abs(nll / rec["final_heldout_loss"] - 1) < 0.05, (nll, rec["final_heldout_loss"])


PYTHON_WORDS = ("self", "return", "def ", "if ", "import", "None", "for ", " in ", "=", "(", ":")


def test_quick_start_generate_prints_python_like_text(tmp_path):
    """README Quick start: `hmoe generate --prompt "def main("` as a real process. It samples
    with the shipped generation_config.json (seed 0), so it asks for 96 tokens: enough of a
    sampled stream to judge, as 48 were of the greedy one."""
    exe = shutil.which("hmoe")
    cmd = (
        [exe]
        if exe
        else [sys.executable, "-c", "import sys; from hmoe_jax.cli import main; sys.exit(main())"]
    )
    env = dict(os.environ, HMOE_CACHE=str(tmp_path))
    env.pop(default_model.ENV_VAR, None)
    args = ["generate", "--prompt", "def main(", "--max-new-tokens", "96", "--ignore-eos", "--json"]
    p = subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["model"].startswith("deepseek_v3_stdlib") and rec["tokenizer"] == "tokenizer.json"
    text = rec["text"]
    assert len(rec["tokens"]) == 96 and text.isascii(), text
    found = [w for w in PYTHON_WORDS if w in text]
    assert len(found) >= 4, (found, text)
    assert re.search(r"[A-Za-z_][A-Za-z_0-9]*\(", text) or "\n    " in text, text
    assert not [c for c in tmp_path.iterdir() if c.name.startswith("deepseek_v3_tiny-")]  # no synthetic made


def _repeated_8grams(ids: list[int]) -> int:
    """Occurrences of an 8-gram of ids that already occurred (counted independently of
    tools/choose_generation_config.py: all 8-grams minus the distinct ones)."""
    grams = [tuple(ids[i : i + 8]) for i in range(len(ids) - 7)]
    return len(grams) - len(set(grams))


def test_quick_start_samples_with_the_shipped_generation_config_and_does_not_loop(capsys, monkeypatch):
    """Issue #28: the README's `hmoe generate --prompt "def main("` on the shipped model uses
    its generation_config.json (chosen by tools/choose_generation_config.py, docs/training.md)
    and 200 tokens of it hold no repeated 8-gram; greedy (--generation-config none) loops,
    which is why the file exists."""
    from hmoe_jax.cli import main

    monkeypatch.delenv(default_model.ENV_VAR, raising=False)
    shipped = json.loads((SHIPPED / "generation_config.json").read_text())
    assert shipped["do_sample"] is True and shipped["temperature"] > 0, shipped
    args = [
        "generate",
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "200",
        "--ignore-eos",
        "--json",
        "--no-warmup",
    ]

    def run(extra: list[str]) -> tuple[dict, str]:
        assert main(args + extra) == 0
        out, err = capsys.readouterr()
        return json.loads(out.strip().splitlines()[-1]), err

    rec, err = run([])  # the README command: --generation-config auto, --seed 0
    assert "generation_config.json: default sampling" in err, err[-2000:]
    assert (rec["temperature"], rec["top_p"], rec["top_k"]) == (
        shipped["temperature"],
        shipped["top_p"],
        shipped.get("top_k", 0),
    )
    assert len(rec["tokens"]) == 200 and _repeated_8grams(rec["tokens"]) == 0, rec["text"]
    greedy, _ = run(["--generation-config", "none"])
    assert greedy["temperature"] == 0.0
    assert _repeated_8grams(greedy["tokens"]) > 50, greedy["text"]  # the `self.name(self.name, ...` loop
