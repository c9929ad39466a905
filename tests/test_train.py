"""hmoe_jax.train: the training forward is the model's forward, aux-loss-free balancing
moves the bias the right way, the split is by file, a short run learns and is
deterministic, the export loads back through the normal loader (FP8 within FP8 error of
the bf16 master). The full reproduction of the shipped model is slow-marked."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.tokenizer import load_tokenizer
from hmoe_jax.model.model import forward_nocache
from hmoe_jax.model.moe import experts_ref
from hmoe_jax.train import data, loop
from hmoe_jax.train.export import export
from hmoe_jax.train.recipe import Recipe, model_config

ROOT = Path(__file__).resolve().parents[1]
MICRO = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    q_lora_rank=32,
    kv_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
)


def micro_cfg(vocab: int = 300):
    return model_config(vocab_size=vocab, **MICRO)


def test_training_forward_is_the_model_forward():
    cfg = micro_cfg()
    params = loop.init_params(cfg, seed=0, std=0.2)
    # A non-zero bias so that it changes selection.
    params = loop.update_bias(params, jnp.asarray(np.random.default_rng(0).random((2, 8))), 0.05)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    ours, loads = loop.logits_and_loads(params, cfg, tokens)
    ref = forward_nocache(params, cfg, tokens, experts_ref)
    np.testing.assert_allclose(
        np.asarray(ours), np.asarray(ref), rtol=0, atol=2e-5 * float(jnp.abs(ref).max())
    )
    assert loads.shape == (2, 8) and np.all(np.asarray(loads).sum(-1) == 2 * 24 * 2)


def test_experts_dense_equals_experts_ref():
    cfg = micro_cfg()
    ex = loop.init_params(cfg, seed=3, std=0.3).layers[1].ffn.experts
    r = np.random.default_rng(2)
    x = jnp.asarray(r.standard_normal((10, 64)), jnp.float32)
    ids = jnp.asarray(np.stack([r.choice(8, 2, replace=False) for _ in range(10)]), jnp.int32)
    w = jnp.asarray(r.random((10, 2)), jnp.float32)
    a, b = loop.experts_dense(x, ids, w, ex), experts_ref(x, ids, w, ex)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(jnp.abs(b).max()))


def test_bias_update_lowers_overloaded_and_raises_underloaded_experts():
    cfg = micro_cfg()
    params = loop.init_params(cfg, seed=0, std=0.02)
    loads = jnp.asarray([[10, 0, 1, 1, 1, 1, 1, 1]] * 2, jnp.float32)  # mean 2
    new = loop.update_bias(params, loads, 0.01)
    b = np.asarray(new.layers[1].ffn.router_bias)
    assert b[0] == pytest.approx(-0.01) and b[1] == pytest.approx(0.01) and b[2] == pytest.approx(0.01)
    assert (
        np.asarray(new.layers[0].ffn.gate).shape == np.asarray(params.layers[0].ffn.gate).shape
    )  # dense kept


def test_bias_gradient_is_zero():
    """The bias only selects experts: the optimizer never needs to see it."""
    cfg = micro_cfg()
    params = loop.init_params(cfg, seed=0, std=0.2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 17)), jnp.int32)

    def loss(p):
        logits, _ = loop.logits_and_loads(p, cfg, tokens[:, :-1])
        return loop.next_token_loss(logits, tokens[:, 1:])

    g = jax.grad(loss)(params)
    assert float(jnp.abs(g.layers[1].ffn.router_bias).max()) == 0.0
    assert float(jnp.abs(g.layers[1].ffn.router).max()) > 0.0


def _mini_corpus(root: Path, n: int = 60) -> Path:
    src = sorted(data.stdlib_root().glob("*.py"))
    src = [p for p in src if 2_000 < p.stat().st_size < 20_000][:n]
    for p in src:
        shutil.copy(p, root / p.name)
    return root


def test_split_is_by_file_and_stable(tmp_path):
    corpus = data.load_corpus(_mini_corpus(tmp_path), heldout_per_mille=200)
    train_names = {r for r, _ in corpus.train}
    held_names = {r for r, _ in corpus.heldout}
    assert train_names and held_names and not train_names & held_names
    assert all(data.is_heldout(r, 200) for r in held_names)
    assert data.load_corpus(tmp_path, heldout_per_mille=200).digest == corpus.digest


def _short_run(corpus, steps: int = 12):
    tok = data.train_tokenizer([t for _, t in corpus.train], 300)
    stream = data.encode_stream(tok, [t for _, t in corpus.train])
    held = data.eval_windows(data.encode_stream(tok, [t for _, t in corpus.heldout]), 8, 32)
    cfg = micro_cfg(tok.get_vocab_size())
    rc = Recipe(steps=steps, batch=8, seq_len=32, lr=1e-2, warmup_steps=2, eval_every=6, eval_windows=8)
    return tok, cfg, loop.train(cfg, rc, stream, held, log=lambda s: None)


def test_short_run_learns_is_deterministic_and_exports(tmp_path):
    (tmp_path / "src").mkdir()
    corpus = data.load_corpus(_mini_corpus(tmp_path / "src"), 200)
    tok, cfg, a = _short_run(corpus)
    _, _, b = _short_run(corpus)
    assert a.curve[-1]["heldout_loss"] < a.curve[0]["heldout_loss"] - 0.5, a.curve
    assert a.final_heldout_loss == b.final_heldout_loss and a.final_train_loss == b.final_train_loss
    assert [c["train_loss"] for c in a.curve] == [c["train_loss"] for c in b.curve]
    assert any(float(jnp.abs(ly.ffn.router_bias).max()) > 0 for ly in a.params.layers[1:])

    # Export: FP8 + bf16 master + tokenizer; both load through the normal loader.
    export(
        a.params, cfg, tok, {"final_heldout_loss": a.final_heldout_loss}, tmp_path / "fp8", tmp_path / "bf16"
    )
    c8, p8 = load_checkpoint(tmp_path / "fp8", progress=False)
    c16, p16 = load_checkpoint(tmp_path / "bf16", progress=False)
    assert c8.quant is not None and c16.quant is None
    assert dataclasses.replace(c8, quant=None) == c16 == cfg
    assert (
        json.loads((tmp_path / "fp8" / "train_record.json").read_text())["final_heldout_loss"]
        == a.final_heldout_loss
    )
    t = load_tokenizer(tmp_path / "fp8", cfg.vocab_size)
    ids = t.encode("def main():\n    return 0\n")
    assert ids[0] == data.BOS_ID and t.decode(ids) == "def main():\n    return 0\n"
    toks = jnp.asarray([ids], jnp.int32)
    l8 = np.asarray(forward_nocache(p8, c8, toks))
    l16 = np.asarray(forward_nocache(p16, c16, toks))
    lf = np.asarray(forward_nocache(a.params, cfg, toks))
    assert np.abs(l16 - lf).max() < 0.05 * np.abs(lf).max()  # bf16 rounding of the master
    assert np.abs(l8 - l16).max() < 0.1 * np.abs(l16).max()  # FP8 e4m3 on top


def _reproduce(tmp_path, *extra: str) -> dict:
    from hmoe_jax.io.default_model import trained_checkpoint

    ship = trained_checkpoint()
    if ship is None:
        pytest.skip("no shipped trained checkpoint in this install")
    ref = json.loads((ship / "train_record.json").read_text())
    if (
        data.load_corpus(heldout_per_mille=ref["recipe"]["heldout_per_mille"]).digest
        != ref["corpus"]["digest"]
    ):
        pytest.skip("this interpreter's stdlib is not the corpus the shipped model was trained on")
    record = str(ship / "train_record.json")
    cmd = [sys.executable, "-m", "hmoe_jax.train", "--out", str(tmp_path / "m"), "--check", record, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=4 * 3600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# Minutes of training: not in the default suite (CI's 30-minute budget); run them with
# HMOE_RETRAIN=1 python -m pytest -m slow tests/test_train.py -k reproduce
RETRAIN = pytest.mark.skipif(
    not os.environ.get("HMOE_RETRAIN"), reason="retraining takes minutes: set HMOE_RETRAIN=1 to run it"
)


@pytest.mark.slow
@RETRAIN
def test_retraining_reproduces_the_shipped_heldout_loss(tmp_path):
    """The full recipe from scratch (~15 min on 2 idle cores, 40+ when shared) matches the
    shipped record's held-out loss within 2% (relative)."""
    rec = _reproduce(tmp_path)
    assert rec["relative_diff"] <= 0.02 and rec["same_corpus"], rec


@pytest.mark.slow
@RETRAIN
def test_first_100_steps_reproduce_the_recorded_curve(tmp_path):
    """The first 100 steps of the same schedule (~3 min idle) hit the record's held-out
    loss at step 100 within 2% (identical on the machine that trained it)."""
    rec = _reproduce(tmp_path, "--stop-after", "100")
    assert rec["steps_run"] == 100 and rec["relative_diff"] <= 0.02, rec
