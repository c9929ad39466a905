"""e01's summary arithmetic on hand-made rows (no timing; `python -m experiments.e01_fp8_gemv
--resummarise RECORD` in a fresh process, as a user re-summarises a record): the bandwidth
fraction must compare each shape with the probe measured beside it, not with one median
probe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _summarise(rows, threads, tmp_path):
    rec = tmp_path / "record.json"
    rec.write_text(json.dumps({"config": {"summary_threads": threads}, "rows": rows}))
    cmd = [sys.executable, "-m", "experiments.e01_fp8_gemv", "--resummarise", str(rec)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _row(shape, variant, nbytes, seconds, process="ours", threads=2):
    return {
        "shape": shape,
        "threads": threads,
        "process": process,
        "variant": variant,
        "bytes": nbytes,
        "median_s": seconds,
        "best_s": seconds,
        "gbps": nbytes / seconds / 1e9,
    }


def test_fraction_uses_each_shapes_own_probe(tmp_path):
    gb = 1e9
    rows = []
    # gate_up: probe 20 GB/s, fp8 at 10 GB/s; shape b: probe 50 GB/s, fp8 at 25 GB/s;
    # shape c: probe 30 GB/s, fp8 at 15 GB/s. Every shape runs at half its probe.
    for shape, probe_gbps, fp8_bytes in (
        ("expert_gate_up", 20, 2 * gb),
        ("b", 50, 1 * gb),
        ("c", 30, 3 * gb),
    ):
        rows.append(_row(shape, "read_bw", gb, gb / (probe_gbps * gb)))
        rows.append(_row(shape, "read_bw", gb, gb / (99 * gb), process="numpy"))  # other process
        rows.append(_row(shape, "fp8_ours", fp8_bytes, fp8_bytes / (probe_gbps / 2 * gb)))
        rows.append(_row(shape, "int4_ours", fp8_bytes / 2, 0.3 * fp8_bytes / (probe_gbps / 2 * gb)))
        for v in ("f32_blas", "xla_dequant", "f32_xla", "bf16_torch", "bf16_xla"):
            rows.append(_row(shape, v, 4 * fp8_bytes, 4 * fp8_bytes / (probe_gbps * gb), process="numpy"))
    s = _summarise(rows, 2, tmp_path)
    assert s["fp8_bw_fraction"] == pytest.approx(0.5)
    assert s["fp8_bw_fraction_by_shape"] == pytest.approx({"expert_gate_up": 0.5, "b": 0.5, "c": 0.5})
    assert s["read_bw_gbps"] == pytest.approx(30.0)  # the "ours" probes' median, not 99
    assert s["int4_time_ratio_vs_fp8"] == pytest.approx(0.3)
    assert s["speedup_vs_f32_blas"] == pytest.approx(2.0)
