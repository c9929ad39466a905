"""lm-evaluation-harness end to end against `hmoe serve`: experiments/e08_lm_eval.py, run as a
process (the suite's rule for experiments) on the FP8 mode, drives lm-eval's
`local-completions` (multiple choice at --batch_size 4, perplexity, generation at 8) and its
record must say the harness's per-doc log-likelihoods equal its in-process teacher-forced
forward within the bf16 tolerance, with the same multiple-choice answers; and a served
--hf-overrides top-k changes the served log-probs exactly as an in-process forward with the
same override does (checked here against hmoe_jax.model.generate directly).

Slow (servers, compilation); skipped where lm-eval is not installed (pip install -e .[eval]).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
FP8 = ROOT / "hmoe_jax" / "assets" / "deepseek_v3_stdlib"
BF16_REL = 2.0**-8  # bf16 activations: relative rounding of a logit or a log-sum-exp


def test_e08_quick_fp8_harness_matches_inprocess(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.e08_lm_eval",
        "--quick",
        "--modes",
        "fp8",
        "--out-dir",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = tmp_path.glob("e08_lm_eval_*.json")
    s = json.loads(record.read_text())["summary"]
    assert s["fp8_within_tol"] and s["all_within_tol"], s
    assert s["fp8_max_diff_over_tol"] < 1.0
    assert s["fp8_mc_acc"] == s["fp8_mc_acc_inprocess"]
    assert (
        abs(s["fp8_bits_per_byte"] - s["fp8_bits_per_byte_inprocess"])
        < 0.01 * s["fp8_bits_per_byte_inprocess"]
    )


def _logprobs(cfg, params, ids: list[int]) -> tuple[np.ndarray, float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from an f32 teacher-forced forward, and max |logit|."""
    from hmoe_jax.model.generate import teacher_forced_logits
    from hmoe_jax.model.moe import experts_ref

    logits = np.asarray(teacher_forced_logits(params, cfg, ids, experts_ref), np.float64)[: len(ids) - 1]
    z = logits - logits.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return lp[np.arange(len(ids) - 1), ids[1:]], float(np.abs(logits).max())


def test_served_topk_override_matches_inprocess(tmp_path):
    import httpx

    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.tokenizer import load_tokenizer

    bf16 = FP8.parent / "deepseek_v3_stdlib_bf16"
    cfg, params = load_checkpoint(bf16, progress=False)
    k2 = cfg.num_experts_per_tok - 2
    flags = (
        "--checkpoint",
        str(bf16),
        "--no-warmup",
        "--hf-overrides",
        json.dumps({"num_experts_per_tok": k2}),
    )
    srv = start_server(tmp_path / "serve.log", *flags)
    ids = load_tokenizer(bf16, cfg.vocab_size).encode("def main(argv):\n    return 0\n")
    try:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
        out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=600).json()
    finally:
        stop_server(srv)
    served = np.array(out["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], np.float64)
    ref, amax = _logprobs(dataclasses.replace(cfg, num_experts_per_tok=k2), params, ids)
    base, _ = _logprobs(cfg, params, ids)
    tol = 2 * BF16_REL * amax
    assert np.abs(served - ref).max() <= tol
    assert np.abs(served - base).max() > tol, "the served top-k override did not change the log-probs"
