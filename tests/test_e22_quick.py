"""e22's --quick run end to end (a real-shape bench twin with 16 experts: real DeepSeek-V3
layer dims through the bf16 engine path and our FFI kernels, batched decode at B = 1, 2, 4):
it must finish, write its record and report the summary keys the claims table reads, with
the arithmetic between them consistent. Speed is not asserted (a shared 2-core machine)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_e22_quick_writes_a_consistent_record(tmp_path):
    pytest.importorskip("_hmoe_ffi", reason="needs the built extension")
    from experiments.e22_batched_decode import main

    rec = main(["--quick", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("e22_batched_decode_*.json")
    assert json.loads(path.read_text())["summary"] == json.loads(json.dumps(rec["summary"]))
    sm, rows = rec["summary"], {r["batch"]: r for r in rec["rows"]}
    assert set(rows) == {1, 2, 4}
    for key in ("decode_step_s_b1", "batch4_step_ratio", "dispatches_per_token", "decode_roofline_fraction"):
        assert key in sm and sm[key] > 0
    assert sm["batch4_step_ratio"] == pytest.approx(rows[4]["step_s_median"] / rows[1]["step_s_median"])
    assert sm["batch4_bytes_ratio"] == pytest.approx(rows[4]["step_bytes"] / rows[1]["step_bytes"])
    # B rows route k experts each per layer: at least k, at most min(E, B k) distinct per layer
    cfg = rec["config"]
    for b, r in rows.items():
        assert 8 * cfg["layers"] <= r["experts_touched"] <= min(cfg["routed_experts"], 8 * b) * cfg["layers"]
    assert sm["dispatches_per_token"] == 2 + 5 * cfg["layers"]  # embed, 5 per MoE layer, final
