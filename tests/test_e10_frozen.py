"""The frozen validation's fingerprint (hmoe_jax/sim/frozen.py) and e10's pooling of records.

No experiment runs here: the aggregation is checked on small hand-written records whose
expected medians, p90s and sign flags are worked out by hand below."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hmoe_jax.sim import frozen
from hmoe_jax.sim import validation as e10

REPO_ROOT = Path(__file__).resolve().parents[1]

PKG = Path(frozen.__file__).resolve().parents[1]


# --- the fingerprint -------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """A copy of hmoe_jax/sim, hmoe_jax/plan and configs/systems/local.toml-like profile."""
    pkg = tmp_path / "hmoe_jax"
    shutil.copytree(PKG / "sim", pkg / "sim", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PKG / "plan", pkg / "plan", ignore=shutil.ignore_patterns("__pycache__"))
    prof = tmp_path / "local.toml"
    prof.write_text('name = "local"\n[cpu]\nnuma_nodes = 1\n')
    return pkg, prof


def test_fingerprint_stable_when_nothing_changes(tree):
    pkg, prof = tree
    a = frozen.sim_fingerprint(prof, pkg)
    b = frozen.sim_fingerprint(prof, pkg)
    assert a == b
    assert len(a["sha256"]) == 64
    # a file outside the hashed set (plan/dist.py, a README) does not move it
    (pkg / "plan" / "dist.py").write_text("# edited\n")
    (pkg / "sim" / "notes.txt").write_text("not python\n")
    assert frozen.sim_fingerprint(prof, pkg)["sha256"] == a["sha256"]


def test_fingerprint_moves_with_a_sim_source(tree):
    pkg, prof = tree
    a = frozen.sim_fingerprint(prof, pkg)
    f = pkg / "sim" / "pricing.py"
    f.write_text(f.read_text() + "\n# one more line\n")
    b = frozen.sim_fingerprint(prof, pkg)
    assert b["sha256"] != a["sha256"] and b["sources_sha256"] != a["sources_sha256"]
    assert b["profile_sha256"] == a["profile_sha256"]
    assert b["files"]["sim/pricing.py"] != a["files"]["sim/pricing.py"]


def test_fingerprint_moves_with_a_plan_module_and_a_new_sim_file(tree):
    pkg, prof = tree
    a = frozen.sim_fingerprint(prof, pkg)["sha256"]
    (pkg / "plan" / "costs.py").write_text((pkg / "plan" / "costs.py").read_text() + "X = 1\n")
    b = frozen.sim_fingerprint(prof, pkg)["sha256"]
    assert b != a
    (pkg / "sim" / "extra.py").write_text("Y = 2\n")
    assert frozen.sim_fingerprint(prof, pkg)["sha256"] not in (a, b)


def test_fingerprint_moves_with_the_profile(tree):
    pkg, prof = tree
    a = frozen.sim_fingerprint(prof, pkg)
    prof.write_text(prof.read_text().replace("numa_nodes = 1", "numa_nodes = 2"))
    b = frozen.sim_fingerprint(prof, pkg)
    assert b["sha256"] != a["sha256"] and b["sources_sha256"] == a["sources_sha256"]


def test_fingerprint_missing_profile_is_an_error(tree):
    pkg, prof = tree
    with pytest.raises(FileNotFoundError, match="profile"):
        frozen.sim_fingerprint(prof.with_name("nope.toml"), pkg)


def _plan_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "hmoe_jax.plan":
                out |= {f"{a.name}.py" for a in node.names} | {"__init__.py"}
            elif node.module.startswith("hmoe_jax.plan."):
                out |= {node.module.split(".")[2] + ".py", "__init__.py"}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hmoe_jax.plan."):
                    out |= {a.name.split(".")[2] + ".py", "__init__.py"}
    return out


def test_hashed_plan_modules_are_what_the_simulator_imports():
    """SIM_PLAN_MODULES = the closure of hmoe_jax.plan imports from hmoe_jax/sim/*.py,
    derived here from the sources' import statements."""
    todo = set()
    for f in (PKG / "sim").glob("*.py"):
        todo |= _plan_imports(f)
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo |= _plan_imports(PKG / "plan" / m) - seen
    assert sorted(seen) == list(frozen.SIM_PLAN_MODULES)


# --- e10's pooling ---------------------------------------------------------------------------

FP = {"sha256": "a" * 64}
FP2 = {"sha256": "b" * 64}


def e03(errs, fp=FP):
    return {
        "experiment": "e03_decode",
        "sim_fingerprint": fp,
        "config": {"quick": False},
        "rows": [{"part": "measured_here", "batch": b, "err_pct": e} for b, e in zip((1, 2), errs)]
        + [{"part": "projection", "err_pct": 99.0}],
    }


def e04(errs, link_err, link_gbps=0.1, fp=FP):
    rows = [
        {"part": "measured_here", "schedule": s, "prompt_len": 64, "link_gbps": None, "err_pct": e}
        for s, e in zip(("cpu", "slp"), errs)
    ]
    rows.append(
        {
            "part": "measured_here",
            "schedule": "slp",
            "prompt_len": 64,
            "link_gbps": link_gbps,
            "err_pct": link_err,
            "sim_bound": "h2d0",
        }
    )
    inputs = {"accelerator.weight_convert_gbps": {"value": 0.29, "src": "measured"}}
    return {
        "experiment": "e04_slp_prefill",
        "sim_fingerprint": fp,
        "config": {"quick": False, "here_inputs": inputs},
        "rows": rows,
    }


def e06(alone, mix, excluded_err=50.0, fp=FP):
    """alone/mix: (ttft p90 err, tpot p90 err) of one backend's 1P+1D rows."""

    def row(kind, errs, backend="pd", outside=None):
        return {
            "part": "sim_validation",
            "backend": backend,
            "mix": "1P+1D",
            "kind": kind,
            "outside_model": outside,
            "ttft_s": {"p90_err_pct": errs[0]},
            "tpot_s": {"p90_err_pct": errs[1]},
        }

    return {
        "experiment": "e06_concurrency",
        "sim_fingerprint": fp,
        "config": {"quick": False},
        "rows": [
            row("alone", alone),
            row("mix", mix),
            row("mix", (excluded_err, excluded_err), "fcfs", "dslp on stand-ins (e05)"),
        ],
    }


def two_rounds():
    return [
        ("r0/e03", e03([-2.0, -4.0])),
        ("r0/e04", e04([3.0, -8.0], -10.0)),
        ("r0/e06", e06((5.0, -1.0), (-11.0, 2.0))),
        ("r1/e03", e03([-6.0, -8.0])),
        ("r1/e04", e04([1.0, 12.0], 20.0)),
        ("r1/e06", e06((-3.0, 4.0), (9.0, -13.0))),
    ]


def by(rows, **kw):
    got = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(got) == 1, (kw, got)
    return got[0]


def test_aggregate_two_rounds_by_hand():
    agg = e10.aggregate(two_rounds())
    assert agg["rounds"] == {e: [f"r0/{e[:3]}", f"r1/{e[:3]}"] for e in e10.EXPERIMENTS}

    # e03: -2, -4, -6, -8; |e| sorted 2, 4, 6, 8: median 5; p90 at rank 0.9 * 3 = 2.7 -> 6 + 0.7 * 2
    d = agg["by_experiment"]["e03_decode"]
    assert d["n"] == 4 and d["median_abs_pct"] == pytest.approx(5.0)
    assert d["p90_abs_pct"] == pytest.approx(7.4)
    assert (d["min_signed_pct"], d["max_signed_pct"]) == (-8.0, -2.0)
    assert d["all_one_sign"] is True
    # the batch-1 case over the two rounds: -2, -6
    c = by([r for r in agg["by_case"]], experiment="e03_decode", case="batch 1")
    assert c["signed_pct"] == [-2.0, -6.0] and c["median_signed_pct"] == pytest.approx(-4.0)

    ch = agg["checks"]
    assert ch["decode_p90_le_10"]["ok"] is True and ch["decode_p90_le_10"]["p90_abs_pct"] == pytest.approx(
        7.4
    )
    # prefill at the native link: 3, -8, 1, 12 -> |e| 1, 3, 8, 12: p90 = 8 + 0.7 * 4 = 10.8 > 10
    assert ch["prefill_p90_le_10"]["p90_abs_pct"] == pytest.approx(10.8)
    assert ch["prefill_p90_le_10"]["ok"] is False
    # the link rows (0.1 GB/s, under the 0.29 GB/s convert rate): -10, 20 -> p90 = 10 + 0.9 * 10 = 19
    assert ch["link_bound_within_15"]["p90_abs_pct"] == pytest.approx(19.0)
    assert ch["link_bound_within_15"]["ok"] is False
    # e06 ttft: 5, -11, -3, 9 (the dslp row excluded) -> |e| 3, 5, 9, 11: p90 = 9 + 0.7 * 2 = 10.4
    assert ch["replay_ttft_p90_le_12"]["p90_abs_pct"] == pytest.approx(10.4)
    assert ch["replay_ttft_p90_le_12"]["ok"] is True
    # tpot: -1, 2, 4, -13 -> |e| 1, 2, 4, 13: p90 = 4 + 0.7 * 9 = 10.3
    assert ch["replay_tpot_p90_le_12"]["p90_abs_pct"] == pytest.approx(10.3)
    # e03 is all negative: the signs check fails on it, e04 and e06 are mixed
    assert ch["signs_not_all_one"]["per_experiment"] == {
        "e03_decode": False,
        "e04_slp_prefill": True,
        "e06_concurrency": True,
    }
    assert ch["signs_not_all_one"]["ok"] is False
    assert ch["at_least_3_rounds"]["ok"] is False
    assert agg["done_when_met"] is False
    # the named shared-CPU case: the mix rows only: ttft -11, 9; tpot 2, -13
    sh = agg["named_cases"]["prefill_and_decodes_share_cpu"]
    assert sh["ttft_s"]["signed_pct"] == [-11.0, 9.0] and sh["ttft_s"]["all_one_sign"] is False
    assert sh["tpot_s"]["median_abs_pct"] == pytest.approx(7.5)
    assert any("outside the model" in s for s in agg["left_out"])


def test_regimes_split_schedules_link_and_replay_kind():
    agg = e10.aggregate(two_rounds())
    regs = {(r["experiment"], r["regime"], r["metric"]): r for r in agg["by_regime"]}
    assert regs[("e04_slp_prefill", "prefill_cpu", "prefill_s")]["signed_pct"] == [3.0, 1.0]
    assert regs[("e04_slp_prefill", "prefill_slp", "prefill_s")]["signed_pct"] == [-8.0, 12.0]
    assert regs[("e04_slp_prefill", "prefill_link", "prefill_s")]["signed_pct"] == [-10.0, 20.0]
    assert regs[("e06_concurrency", "replay_alone", "ttft_s")]["signed_pct"] == [5.0, -3.0]
    assert regs[("e06_concurrency", "replay_mix", "tpot_s")]["signed_pct"] == [2.0, -13.0]


def test_link_not_binding_gives_null_with_reason():
    recs = [(n, r) for n, r in two_rounds() if r["experiment"] != "e04_slp_prefill"]
    recs += [
        ("r0/e04", e04([1.0, -1.0], 5.0, link_gbps=1.0)),
        ("r1/e04", e04([2.0, -2.0], 6.0, link_gbps=1.0)),
    ]
    ch = e10.aggregate(recs)["checks"]
    assert ch["link_bound_within_15"]["ok"] is None
    assert "does not bind" in ch["link_bound_within_15"]["reason"]


def test_missing_experiment_gives_null_checks_not_numbers():
    recs = [(n, r) for n, r in two_rounds() if r["experiment"] == "e03_decode"]
    agg = e10.aggregate(recs)
    ch = agg["checks"]
    assert ch["prefill_p90_le_10"] == {"ok": None, "reason": "no e04_slp_prefill records"}
    assert ch["replay_ttft_p90_le_12"]["ok"] is None
    assert ch["signs_not_all_one"]["ok"] is None
    assert agg["done_when_met"] is None and agg["done_when_reason"]
    assert agg["by_experiment"]["e06_concurrency"]["p90_abs_pct"] is None


def test_mismatched_fingerprints_refused():
    recs = two_rounds()
    recs[4] = ("r1/e04", e04([1.0, 12.0], 20.0, fp=FP2))
    with pytest.raises(e10.FingerprintMismatch) as ei:
        e10.aggregate(recs)
    msg = str(ei.value)
    assert "a" * 64 in msg and "b" * 64 in msg and "r0/e03" in msg and "r1/e04" in msg


def test_record_without_fingerprint_refused():
    recs = two_rounds()
    del recs[2][1]["sim_fingerprint"]
    with pytest.raises(e10.FingerprintMismatch, match="r0/e06 has no sim_fingerprint"):
        e10.aggregate(recs)


def test_quick_and_full_not_pooled():
    recs = two_rounds()
    recs[3][1]["config"]["quick"] = True
    with pytest.raises(ValueError, match="quick"):
        e10.aggregate(recs)


def test_validation_records_carry_the_fingerprint(tmp_path):
    """emit_record puts the fingerprint (hashed at parse_args) at the top of e03-e06 records,
    and only there (the harness run in a fresh process, as the experiments run it)."""
    import json

    script = (
        "import json, sys\n"
        "from experiments.common.record import emit_record, parse_args\n"
        "out = sys.argv[1]\n"
        "a = parse_args('e03_decode', None, ['--out-dir', out])\n"
        "r = emit_record(a, claim='c', paper_value=None, config={}, rows=[], summary={})\n"
        "b = parse_args('e07_quality', None, ['--out-dir', out + '/other'])\n"
        "o = emit_record(b, claim='c', paper_value=None, config={}, rows=[], summary={})\n"
        "print('RESULT', json.dumps({'keys': list(r)[:2], 'fp': r['sim_fingerprint'], 'other': 'sim_fingerprint' in o}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["keys"] == ["experiment", "sim_fingerprint"]
    assert got["fp"]["sha256"] == frozen.local_fingerprint()["sha256"]
    on_disk = json.loads(next(tmp_path.glob("e03_decode_*.json")).read_text())
    assert on_disk["sim_fingerprint"] == got["fp"]
    assert got["other"] is False


def _e10(*args: str) -> dict:
    """`python -m experiments.e10_frozen_validation ARGS` in a fresh process -> its record."""
    import json

    proc = subprocess.run([sys.executable, "-m", "experiments.e10_frozen_validation", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_from_records_end_to_end(tmp_path):
    """e10 --from-records on the hand-written records writes one record, fingerprint on top."""
    import json

    for name, rec in two_rounds():
        (tmp_path / (name.replace("/", "_") + ".json")).write_text(json.dumps(rec))
    out = tmp_path / "out"
    rec = _e10("--from-records", str(tmp_path / "r*.json"), "--out-dir", str(out))
    assert list(rec)[:2] == ["experiment", "sim_fingerprint"] and rec["sim_fingerprint"] == FP
    assert rec["summary"]["fingerprint_matches_tree"] is False
    assert rec["summary"]["checks"]["decode_p90_le_10"]["ok"] is True
    assert len(list(out.glob("e10_frozen_validation_*.json"))) == 1


@pytest.mark.slow
def test_quick_rounds_end_to_end(tmp_path):
    """One --quick round of e03, e04 and e06 through e10 (minutes; not in the default lane)."""
    rec = _e10("--quick", "--rounds", "1", "--out-dir", str(tmp_path))
    assert rec["summary"]["fingerprint_matches_tree"] is True
    assert rec["summary"]["checks"]["at_least_3_rounds"]["ok"] is False
