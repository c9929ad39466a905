"""lm-evaluation-harness end to end against `hmoe serve` (experiments/e08_lm_eval.py): the
harness's per-doc log-likelihoods on the local multiple-choice task equal an in-process
teacher-forced forward on the same token ids; a served --hf-overrides top-k changes the
served log-probs as the in-process forward with the same override does.

Slow (servers, compilation); skipped where lm-eval is not installed (pip install -e .[eval]).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

FP8 = Path(__file__).resolve().parents[1] / "hmoe_jax" / "assets" / "deepseek_v3_stdlib"


@pytest.fixture(scope="module")
def e08():
    pytest.importorskip("lm_eval")
    from experiments import e08_lm_eval

    return e08_lm_eval


def test_lm_eval_mc_loglikelihoods_match_inprocess(e08, tmp_path):
    srv = start_server(tmp_path / "serve.log", "--checkpoint", str(FP8), "--no-warmup")
    try:
        res = e08.run_harness(srv.url, MODEL, FP8, "hmoe_nextline_mc", limit=3, batch=4)
    finally:
        stop_server(srv)
    samples = res["samples"]["hmoe_nextline_mc"]
    assert len(samples) == 3
    model = e08.reference_model("fp8", FP8)
    tok = e08.Tok(FP8)
    for s in samples:
        doc = s["doc"]
        got = [float(r[0]) for r in s["filtered_resps"]]
        assert len(got) == len(doc["choices"]) == 4
        for choice, ll in zip(doc["choices"], got, strict=True):
            ids, ctxlen = e08.pair_ids(tok, doc["context"], choice)
            ref, tol, n = e08.scored(model, ids, ctxlen)
            assert n >= 1
            assert abs(ll - ref) <= tol, (
                f"doc {s['doc_id']} {choice!r}: harness {ll} vs in-process {ref} (tol {tol})"
            )
    acc = res["results"]["hmoe_nextline_mc"]["acc,none"]
    assert acc == np.mean(
        [int(np.argmax([r[0] for r in s["filtered_resps"]])) == s["doc"]["label"] for s in samples]
    )


def test_served_topk_override_matches_inprocess(e08, tmp_path):
    import httpx

    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.model.moe import experts_ref

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
    ids = [0, *e08.Tok(bf16)("def main(argv):\n    return 0\n")]
    try:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
        out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=600).json()
    finally:
        stop_server(srv)
    served = np.array(out["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], np.float64)
    over = (dataclasses.replace(cfg, num_experts_per_tok=k2), *_placed(params), experts_ref)
    default = (cfg, *_placed(params), experts_ref)
    ref, amax = e08.token_logprobs(over, ids)
    base, _ = e08.token_logprobs(default, ids)
    tol = 2 * e08.BF16_REL * amax
    assert np.abs(served - ref).max() <= tol
    assert np.abs(served - base).max() > tol, "the served top-k override did not change the log-probs"


def _placed(params):
    import jax

    return (jax.device_put(params),)
