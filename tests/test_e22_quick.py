"""e22's --quick run end to end, as a user runs it (`python -m experiments.e22_batched_decode
--quick` in a fresh process): a real-shape bench twin with 16 experts (real DeepSeek-V3 layer
dims through the bf16 engine path and our FFI kernels), batched decode at B = 1, 2, 4. It must
finish, write the record it prints, and report bytes and counts that agree with values
computed here by hand from DeepSeek-V3's dims. Speed is not asserted (a shared 2-core
machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# One routed DeepSeek-V3 expert in block FP8, by hand: gate, up [2048, 7168] and down
# [7168, 2048] as e4m3 codes (1 byte each), one f32 scale per 128 x 128 block of each.
EXPERT_CODES_BYTES = 3 * 2048 * 7168
EXPERT_SCALES_BYTES = 3 * (2048 // 128) * (7168 // 128) * 4
EXPERT_BYTES = EXPERT_CODES_BYTES + EXPERT_SCALES_BYTES  # 44,050,944
TOP_K = 8  # DeepSeek-V3's num_experts_per_tok


@pytest.mark.slow
def test_e22_quick_writes_a_consistent_record(tmp_path):
    pytest.importorskip("_hmoe_ffi", reason="needs the built extension")
    cmd = [sys.executable, "-m", "experiments.e22_batched_decode", "--quick", "--out-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])  # the record is the last stdout line
    (path,) = tmp_path.glob("e22_batched_decode_*.json")
    assert json.loads(path.read_text())["summary"] == rec["summary"]
    sm, rows, cfg = rec["summary"], {r["batch"]: r for r in rec["rows"]}, rec["config"]
    assert set(rows) == {1, 2, 4}
    for key in ("decode_step_s_b1", "batch4_step_ratio", "dispatches_per_token", "decode_roofline_fraction"):
        assert key in sm and sm[key] > 0
    # B rows route top-8 each per layer: at least 8, at most min(E, 8 B) distinct per layer
    for b, r in rows.items():
        assert (
            TOP_K * cfg["layers"]
            <= r["experts_touched"]
            <= min(cfg["routed_experts"], TOP_K * b) * cfg["layers"]
        )
    # a step's bytes differ between batch sizes by the extra experts touched, each EXPERT_BYTES
    # (everything else a step reads: attention, router, shared expert, lm_head, is per step)
    for b in (2, 4):
        extra = rows[b]["experts_touched"] - rows[1]["experts_touched"]
        assert rows[b]["step_bytes"] - rows[1]["step_bytes"] == extra * EXPERT_BYTES, b
    # ... and a batch-1 step reads at least its experts and the bf16 lm_head [vocab, 7168]
    assert rows[1]["step_bytes"] > rows[1]["experts_touched"] * EXPERT_BYTES + 2048 * 7168 * 2
    assert sm["batch4_bytes_ratio"] == pytest.approx(rows[4]["step_bytes"] / rows[1]["step_bytes"])
    # dispatches of one decode step: embed; per MoE layer attention + routing on the
    # accelerator, the ids' hop to the host, the CPU experts, the hop back, the combine (5);
    # the final norm + lm_head
    assert sm["dispatches_per_token"] == 2 + 5 * cfg["layers"]
