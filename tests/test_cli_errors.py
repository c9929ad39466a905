"""Bad input through the `hmoe` CLI: each case exits 1 with ONE line on stderr that names
the flag/file/tensor/key and the expected vs actual value, and no traceback."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from hmoe_jax.cli import main
from hmoe_jax.config import named_model_config
from hmoe_jax.io.synthetic import synthetic_params
from hmoe_jax.io.writer import save_checkpoint

# 1 dense + 1 MoE layer and 16 positions of context; only the happy-path test compiles.
CFG = dataclasses.replace(
    named_model_config("deepseek_v3_tiny"),
    num_hidden_layers=2,
    first_k_dense_replace=1,
    max_position_embeddings=16,
    quant=None,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    save_checkpoint(d, CFG, synthetic_params(CFG, seed=1))
    return d


def _fails(argv, capsys, pattern):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    import re

    assert re.search(pattern, lines[0]), lines[0]
    assert lines[0].startswith("hmoe: error: ")


def _ids(n):
    return ",".join(str(3 + i) for i in range(n))


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--tokens", "1,600"], r"--tokens: token id 600 out of range \[0, vocab_size=512\)"),
        (["--tokens", "1,-2"], r"--tokens: token id -2 out of range \[0, vocab_size=512\)"),
        (["--tokens", "1,x,3"], r"--tokens: 'x' is not an integer token id"),
        (["--tokens", ","], r"--tokens: expected comma-separated token ids like 1,2,3, got ','"),
        (["--tokens", _ids(12), "--max-new-tokens", "5"],
         r"--tokens: prompt of 12 tokens \+ 5 new tokens = 17 exceeds the context of 16 tokens \(max_position_embeddings\)"),
        (["--tokens", _ids(9), "--max-new-tokens", "4", "--max-context", "10"],
         r"--tokens: prompt of 9 tokens \+ 4 new tokens = 13 exceeds the context of 10 tokens \(--max-context\)"),
        (["--prompt", "a long prompt here", "--max-new-tokens", "1"],
         r"--prompt \(encoded by bytes\): prompt of 19 tokens \+ 1 new tokens = 20 exceeds the context of 16"),
        (["--tokens", "1", "--max-context", "99"], r"--max-context 99 must be in \[1, max_position_embeddings=16\]"),
        (["--tokens", "1", "--max-new-tokens", "0"], r"--max-new-tokens must be >= 1, got 0"),
        (["--tokens", "1", "--temperature", "-1"], r"need --temperature >= 0 and 0 < --top-p <= 1, got -1.0 and 1.0"),
    ],
    ids=["id-high", "id-negative", "not-int", "empty", "context", "max-context", "prompt-context",
         "max-context-range", "max-new", "temperature"],
)  # fmt: skip
def test_generate_bad_input(ckpt, capsys, extra, pattern):
    _fails(["generate", "--checkpoint", ckpt, "--quiet", *extra], capsys, pattern)


def test_logits_bad_input(ckpt, tmp_path, capsys):
    out = tmp_path / "l.npy"
    _fails(["logits", "--checkpoint", ckpt, "--tokens", _ids(17), "--out", out, "--quiet"], capsys,
           r"--tokens: 17 tokens exceed the context of 16 tokens \(max_position_embeddings\)")  # fmt: skip
    _fails(["logits", "--checkpoint", ckpt, "--tokens", "512", "--out", out, "--quiet"], capsys,
           r"--tokens: token id 512 out of range \[0, vocab_size=512\)")  # fmt: skip
    _fails(["logits", "--checkpoint", ckpt, "--tokens", "3", "--out", tmp_path / "no" / "l.npy", "--quiet"], capsys,
           r"--out: directory .*/no does not exist")  # fmt: skip


def test_bad_checkpoints(ckpt, tmp_path, capsys):
    gen = ["generate", "--tokens", "3", "--quiet", "--checkpoint"]
    _fails([*gen, tmp_path / "absent"], capsys, r"absent: checkpoint directory not found")
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((ckpt / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(raw, hidden_sizes=3)))
    _fails([*gen, bad], capsys, r"bad/config.json: unknown config key\(s\) \['hidden_sizes'\]")
    (bad / "config.json").write_text(json.dumps(dict(raw, scoring_func="softmax")))
    _fails([*gen, bad], capsys, r"scoring_func='softmax' is not supported \(expected 'sigmoid'\)")
    (bad / "config.json").write_text(json.dumps(raw))
    _fails([*gen, bad], capsys, r"bad: expected model.safetensors or model.safetensors.index.json, found 0")
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    _fails([*gen, bad], capsys, r"bad/model.safetensors: header length 1099511627776 bytes does not fit")
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops")
    _fails([*gen, bad], capsys, r"bad/model.safetensors: header is not valid JSON")
    (bad / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-64])
    _fails(
        [*gen, bad],
        capsys,
        r"model.safetensors: tensor '.*' ends at data byte \d+ but the file holds only \d+ data bytes",
    )
    save_checkpoint(
        bad,
        dataclasses.replace(CFG, hidden_size=128),
        synthetic_params(dataclasses.replace(CFG, hidden_size=128)),
    )
    (bad / "config.json").write_text(json.dumps(raw))
    _fails(
        [*gen, bad],
        capsys,
        r"tensor 'model.embed_tokens.weight' has shape \[512, 128\], expected \[512, 256\] from config.json",
    )


def test_convert_bad_input(ckpt, tmp_path, capsys):
    _fails(
        ["convert", "--checkpoint", ckpt, "--out", ckpt, "--quiet"],
        capsys,
        r"output directory must differ from the input",
    )
    _fails(
        ["convert", "--checkpoint", tmp_path / "x", "--out", tmp_path / "y"],
        capsys,
        r"x: checkpoint directory not found",
    )
    _fails(
        ["convert", "--checkpoint", ckpt, "--out", tmp_path / "z", "--shard-bytes", "0"],
        capsys,
        r"--shard-bytes must be > 0, got 0",
    )


def test_convert_fp8_then_generate(ckpt, tmp_path, capsys):
    """The happy path of the same small checkpoint, so the cases above fail for their own
    reason and not because the checkpoint is unusable."""
    assert main(["convert", "--checkpoint", str(ckpt), "--out", str(tmp_path / "fp8"), "--quiet"]) == 0
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    argv = [
        "logits",
        "--checkpoint",
        str(tmp_path / "fp8"),
        "--tokens",
        _ids(4),
        "--out",
        str(tmp_path / "l.npy"),
        "--quiet",
    ]
    assert main(argv) == 0
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (4, 512) and np.isfinite(logits).all()


def test_sampling_flags(ckpt, capsys):
    """--temperature/--top-p/--seed: a seed fixes the sample, another seed changes it;
    one new token gives tpot_s null (there is no later token to time)."""

    def tokens(*extra):
        argv = [
            "generate",
            "--checkpoint",
            str(ckpt),
            "--tokens",
            "3,4,5",
            "--ignore-eos",
            "--json",
            "--quiet",
        ]
        assert main([*argv, "--no-warmup", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    sample = ["--max-new-tokens", "12", "--temperature", "1.0", "--top-p", "0.9"]
    a, b, c = tokens(*sample, "--seed", "1"), tokens(*sample, "--seed", "1"), tokens(*sample, "--seed", "2")
    assert a["tokens"] == b["tokens"] != c["tokens"]
    assert a["temperature"] == 1.0 and a["top_p"] == 0.9 and a["seed"] == 1
    one = tokens("--max-new-tokens", "1")
    assert len(one["tokens"]) == 1 and one["tpot_s"] is None and one["decode_s"] == []
