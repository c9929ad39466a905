"""e09's --quick run end to end, as a user runs it (`python -m experiments.e09_serving
--quick` in a fresh process): `hmoe serve` on the embedded tiny model driven by `hmoe bench
serve` at 1 and 2 clients, the engine's own steps measured beside it, the server's trace
turned into a per-token breakdown. The record must carry every summary key, and its ratios
must be the ones its own rows give (computed here again from the rows). Speed is not
asserted (a shared 2-core machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_e09_quick_writes_a_consistent_record(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.e09_serving",
        "--quick",
        "--c1-repeats",
        "2",
        "--out-dir",
        str(tmp_path),
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])  # the record is the last stdout line
    (path,) = tmp_path.glob("e09_serving_*.json")
    assert json.loads(path.read_text())["summary"] == rec["summary"]
    sm, rows = rec["summary"], rec["rows"]
    assert rec["config"]["clients"] == [1, 2]
    for c in (1, 2):
        for key in ("output_tok_s", "ttft_mean_ms", "ttft_p90_ms", "tpot_mean_ms", "tpot_p90_ms"):
            assert sm[f"{key}_c{c}"] > 0, key
        # the overhead is the run's own TPOT (all decoding) over the run's own c-row step
        steps = next(r for r in rows if r["part"] == "engine_step" and r["batch"] == c)
        assert steps["median_ms"] == pytest.approx(float(np.median(steps["all_ms"])))
        tpot = [r["tpot_all_decoding_ms"] for r in rows if r["part"] == "decode" and r["clients"] == c]
        assert sm[f"tpot_all_decoding_ms_c{c}"] == pytest.approx(float(np.median(tpot)))
        assert sm[f"serve_overhead_c{c}"] == pytest.approx(
            sm[f"tpot_all_decoding_ms_c{c}"] / steps["median_ms"]
        )
        assert sm[f"breakdown_c{c}_engine_decode_ms"] > 0  # the trace saw the decode steps
    assert sm["requests_failed"] == 0
    # one client ran twice a round, two clients once
    c1 = [r for r in rows if r["part"] == "decode" and r["clients"] == 1]
    assert sorted(r["rep"] for r in c1) == [0, 1]
    assert [r["rep"] for r in rows if r["part"] == "decode" and r["clients"] == 2] == [0]
    # the loop's period is never shorter than the step it starts (same trace, same clock)
    assert sm["loop_period_over_step_b1"] >= 1.0 and sm["loop_adds_ms_b1"] >= 0
    assert sm["join_ttft_ms"] > 0 and sm["join_prefill_chunk_ms"] > 0
    assert isinstance(sm["join_stall_within_one_chunk"], bool)
    # the breakdown's parts are per output token of that bench run
    b = [r for r in rows if r["part"] == "breakdown" and r["kind"] == "decode"]
    assert b and all(r["tokens"] == 12 * r["clients"] for r in b)
