"""experiments/e07_quality --quick on the shipped trained model, run as a user runs it (a
fresh process): the record has the summary keys the issue names, and intact FP8 stays within
1% of bf16's perplexity."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hmoe_jax.io.default_model import assets_dir, trained_checkpoint
from tests.helpers import ROOT

KEYS = ("ppl_bf16", "ppl_fp8", "ppl_int4", "ppl_topk_reduced", "fp8_ppl_gap", "int4_ppl_gap")


@pytest.mark.slow
@pytest.mark.skipif(
    trained_checkpoint() is None or not (assets_dir() / "deepseek_v3_stdlib_bf16").is_dir(),
    reason="no shipped trained checkpoint + bf16 master in this checkout",
)
def test_e07_quick_record(tmp_path):
    cmd = [sys.executable, "-m", "experiments.e07_quality", "--quick", "--out-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])  # the record is the last stdout line
    s = rec["summary"]
    for k in KEYS:
        assert k in s and s[k] == s[k], k  # present and not NaN
    assert abs(s["fp8_ppl_gap"]) < 0.01 and s["fp8_gap_under_1pct"]
    assert s["ppl_topk_reduced"] > s["ppl_bf16"]
    assert min(r["agreement_with_bf16"] for r in rec["rows"]) > 0.5
    assert max(s["load_max_over_mean_learned_bias"]) < max(s["load_max_over_mean_zero_bias"])
    (path,) = tmp_path.glob("e07_quality_*.json")
    assert json.loads(path.read_text())["summary"] == s
