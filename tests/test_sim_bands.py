"""Sensitivity bands (sim/bands.py, sim/headlines.py) and the profile's stated ranges
(plan/profile.py): a band holds its central value, widens when a range widens, its
one-at-a-time ends are the projection re-run by hand with that input moved, inputs the plans
never price are "no effect", and `hmoe reproduce` writes the band record, a band column and
fits: false. Decode headlines only (a DeepSeek-V3 decode step simulates in well under a
second; the prefill headlines take minutes: `hmoe reproduce` runs them)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hmoe_jax.config import ConfigError, named_model_config
from hmoe_jax.plan.profile import ABSENT_DEFAULTS, SCHEMA, load_profile, profile_from_dict
from hmoe_jax.sim.bands import ABSENT_RANGES, band, band_inputs
from hmoe_jax.sim.headlines import BY_NAME, decode_kernel, headline_band
from hmoe_jax.sim.run import decode_step_plan, simulate_decode_step

PAPER = "paper_epyc9355_rtx5090"


def _decode_band(prof):
    cfg = named_model_config("deepseek_v3")
    return band(
        lambda p: simulate_decode_step(cfg, p, 1024),
        prof,
        ["decode_tok_per_s"],
        plans=lambda p: [decode_step_plan(cfg, p, 1024)["plan"]],
        cfg=cfg,
    )["decode_tok_per_s"]


def test_band_holds_central_and_its_ends_are_hand_reruns():
    prof = load_profile(PAPER).with_accelerators(1)
    b = _decode_band(prof)
    assert b["low"] < b["central"] < b["high"]
    assert b["corners"]["all_low"]["value"] == b["low"] and b["corners"]["all_high"]["value"] == b["high"]
    cfg = named_model_config("deepseek_v3")
    by = {r["key"]: r for r in b["inputs"]}
    # one-at-a-time: dram_efficiency at its stated low end, re-run by hand
    lo = prof.ranges["cpu.dram_efficiency"][0]
    hand = simulate_decode_step(cfg, prof.with_values({"cpu.dram_efficiency": lo}), 1024)["decode_tok_per_s"]
    assert by["cpu.dram_efficiency"]["at_low"] == pytest.approx(hand)
    assert by["cpu.dram_efficiency"]["at_low"] < b["central"]  # less read bandwidth, slower decode
    # a one-GPU decode step has no collective, stage or load op: those inputs cannot move it
    for key in ("overheads.collective_s", "overheads.stage_s", "overheads.load_s"):
        assert not by[key]["effect"] and by[key]["swing"] == 0
    # the tornado's order: widest swing first
    swings = [r["swing"] for r in b["inputs"]]
    assert swings == sorted(swings, reverse=True)


def test_band_widens_when_a_range_widens():
    prof = load_profile(PAPER).with_accelerators(1)
    narrow = dataclasses.replace(prof, ranges={"cpu.dram_efficiency": (0.75, 0.85, "assumed: narrow")})
    wide = dataclasses.replace(prof, ranges={"cpu.dram_efficiency": (0.6, 0.95, "assumed: wide")})
    bn, bw = _decode_band(narrow), _decode_band(wide)
    assert bn["central"] == bw["central"]
    assert bw["low"] < bn["low"] <= bn["central"] <= bn["high"] < bw["high"]


def test_absent_defaults_cover_every_optional_key_and_are_varied():
    # absent = not projected / unused / no re-basing reference (with_host_state's fallback)
    not_defaults = {
        "cpu.int4_expert_bw_efficiency",
        "link.p2p_gbps",
        "cpu.compute_probe_tflops",
        "cpu.stream_probe_gbps",
        "cpu.read_fixed_share",
    }
    optional = {f"{s}.{k}" for s, keys in SCHEMA.items() for k, (_, req, _) in keys.items() if not req}
    assert optional - not_defaults == set(ABSENT_DEFAULTS)
    assert set(ABSENT_RANGES) <= set(ABSENT_DEFAULTS)
    prof = load_profile(PAPER)
    inputs, unvaried = band_inputs(prof)
    kinds = {i.key: i.kind for i in inputs}
    assert kinds["accelerator.attn_expanded_tflops"] == "absent"
    assert kinds["cpu.expert_bw_efficiency"] == "measured"  # carried over from the dev VM
    assert unvaried == {}  # every assumed value of the paper profile states a range
    local = load_profile("local")  # calibrated here: nothing assumed, nothing absent but p2p
    assert band_inputs(local) == ([], {}) and local.assumptions() == {}


def test_profile_ranges_are_checked():
    raw = {
        "format": "hmoe-sim-profile/1",
        "name": "t",
        **{
            s: {
                k: {"value": v, "src": "spec: t"}
                for k, v in load_profile(PAPER).values[s].items()
                if s != "accelerator" or k != "count"
            }
            for s in SCHEMA
        },
    }
    raw["accelerator"]["count"] = {"value": 1, "src": "spec: t"}
    ok = profile_from_dict(json.loads(json.dumps(raw)))
    assert ok.ranges == {}
    leaf = raw["cpu"]["dram_efficiency"]
    leaf.update(range=[0.7, 0.9], range_src="assumed: t")
    assert profile_from_dict(raw).ranges["cpu.dram_efficiency"] == (0.7, 0.9, "assumed: t")
    for bad, msg in (
        ({"range": [0.85, 0.9], "range_src": "assumed: t"}, "must hold the value"),
        ({"range": [0.7, 1.2], "range_src": "assumed: t"}, "fraction"),
        ({"range": [0.7, 0.9], "range_src": "t"}, "src"),
    ):
        raw["cpu"]["dram_efficiency"] = {"value": 0.8, "src": "assumed: t", **bad}
        with pytest.raises(ConfigError, match=msg):
            profile_from_dict(raw)
    raw["cpu"]["dram_efficiency"] = {"value": 0.8, "src": "assumed: t", "range": [0.7, 0.9]}
    with pytest.raises(ConfigError, match="range_src"):
        profile_from_dict(raw)


def test_decode_headline_states_the_kernel_efficiency_it_carries():
    h = headline_band(BY_NAME["decode_fp8_tok_per_s"])
    dk = h["decode_kernel"]
    assert dk["key"] == "cpu.expert_bw_efficiency" and dk["value"] == 0.93
    assert dk["range"] == [0.771, 0.93] and "highest" in dk["why"]
    by = {r["key"]: r for r in h["inputs"]}
    # the lowest measured efficiency (the latest calibration) gives a slower decode
    assert by["cpu.expert_bw_efficiency"]["at_low"] < h["central"]
    assert decode_kernel(load_profile(PAPER), "int4")["key"] == "cpu.int4_expert_bw_efficiency"


def test_reproduce_writes_bands_a_band_column_and_fits_false(tmp_path, monkeypatch):
    from hmoe_jax.cli import reproduce as rp

    results = tmp_path / "results"
    path = rp.write_bands(results, ["e03_decode"], quick=True)
    rec = json.loads(path.read_text())
    assert set(rec["headlines"]) == {"decode_fp8_tok_per_s", "decode_int4_tok_per_s"}
    for h in rec["headlines"].values():
        assert h["low"] <= h["central"] <= h["high"] and h["inputs"] and h["method"]
    e03 = {
        "claim": "c",
        "summary": {"decode_fp8_tok_per_s": rec["headlines"]["decode_fp8_tok_per_s"]["central"]},
    }
    (results / "e03_decode_20261204T000000Z.json").write_text(json.dumps(e03))
    e05 = {
        "claim": "d",
        "summary": {"dslp_tok_per_s_32k": 346.3, "dslp_max_prompt_30s": 16384},
        "rows": [
            {"part": "projection", "schedule": "dslp", "prompt_len": 32768, "fits": False},
            {"part": "projection", "schedule": "dslp", "prompt_len": 16384, "fits": True},
        ],
    }
    (results / "e05_dslp_smallep_20261204T000000Z.json").write_text(json.dumps(e05))
    monkeypatch.setattr(rp, "experiment_names", lambda: ["e03_decode", "e05_dslp_smallep"])
    rows = {r["exp"]: r for r in rp.table_rows(results)}
    assert "dslp_tok_per_s_32k 346 (fits: false)" in rows["e05_dslp_smallep"]["projected"]
    assert "dslp_max_prompt_30s 16384" in rows["e05_dslp_smallep"]["projected"]
    assert "fits" not in rows["e05_dslp_smallep"]["projected"].split(";")[1]
    lo = rec["headlines"]["decode_fp8_tok_per_s"]["low"]
    assert f"[{rp._fmt(lo)}, " in rows["e03_decode"]["band"] and path.stem in rows["e03_decode"]["record"]
    assert "rerun" not in rows["e03_decode"]["band"]  # the record's value is the band's central
    e03["summary"]["decode_fp8_tok_per_s"] += 1.0  # a record older than today's simulator
    (results / "e03_decode_20261204T000000Z.json").write_text(json.dumps(e03))
    assert "the record says" in rp.table_rows(results)[0]["band"]
    assert "band over assumed inputs" in rp.markdown(list(rows.values()))
    # the tornado figures, from the JSON only, when matplotlib is installed
    pytest.importorskip("matplotlib")
    fig = Path(__file__).resolve().parents[1] / "paper_figs" / "fig_bands.py"
    subprocess.run([sys.executable, str(fig), str(path), "--out-dir", str(tmp_path)], check=True)
    assert (tmp_path / "tornado_decode_fp8_tok_per_s.png").stat().st_size > 0


def test_bands_of_other_headlines_carry_over(tmp_path, monkeypatch):
    """A bands run over some experiments keeps the newest record's other headlines (the table
    would otherwise lose their bands), each saying which record it came from."""
    from hmoe_jax.cli import reproduce as rp
    from hmoe_jax.sim import headlines

    results = tmp_path / "results"
    results.mkdir()
    old = {"headlines": {"slp_tok_per_s_20k": {"central": 1.0, "low": 0.5, "high": 2.0, "fits": True}}}
    (results / "bands_20261201T000000Z.json").write_text(json.dumps(old))
    fresh = {"central": 3.0, "low": 2.0, "high": 4.0, "fits": True}
    monkeypatch.setattr(
        headlines,
        "headline_bands",
        lambda names, progress=None, quick=False: {"headlines": {n: dict(fresh) for n in names}},
    )
    rec = json.loads(rp.write_bands(results, ["e03_decode"], quick=True).read_text())
    assert rec["headlines"]["decode_fp8_tok_per_s"] == fresh
    assert rec["headlines"]["slp_tok_per_s_20k"]["carried_over_from"] == "bands_20261201T000000Z"
    assert rec["summary"]["slp_tok_per_s_20k"]["central"] == 1.0


def test_serving_headlines_take_the_worst_mix_and_simulate_each_profile_once(monkeypatch):
    """e06's P/D headlines: the largest inflation over the mixes with decodes (as e06's
    summary), both read off one evaluation per profile, whose servers' plans the band prices."""
    from hmoe_jax.config import named_model_config
    from hmoe_jax.sim import headlines, mixes

    calls = []

    def fake_mix(cfg, prof, backend, k, short_len, long_len, plans_out=None):
        calls.append((backend, k, long_len))
        plans_out.append(f"plan {k}")
        return {"ttft_inflation": 1.0 + 0.1 * k, "tpot_inflation": 1.3 - 0.1 * k, "no_fit": []}

    monkeypatch.setattr(mixes, "project_mix", fake_mix)
    monkeypatch.setattr(headlines, "_PD_CACHE", {})
    cfg, prof = named_model_config("deepseek_v3"), load_profile(PAPER)
    ttft_fn, plans = headlines._fns(BY_NAME["projected_worst_ttft_inflation"], cfg)
    tpot_fn, _ = headlines._fns(BY_NAME["projected_worst_tpot_inflation"], cfg)
    assert plans(prof) == ["plan 1", "plan 2"]
    assert ttft_fn(prof)["projected_worst_ttft_inflation"] == pytest.approx(1.2)
    assert tpot_fn(prof)["projected_worst_tpot_inflation"] == pytest.approx(1.2)
    assert calls == [("P/D disaggregation", 1, 16384), ("P/D disaggregation", 2, 16384)]
    other = prof.with_values({"cpu.dram_efficiency": 0.7}, why="test")
    ttft_fn(other)
    assert len(calls) == 4  # a different profile is simulated again
    quick_fn, _ = headlines._fns(BY_NAME["projected_worst_ttft_inflation"], cfg, quick=True)
    quick_fn(prof)  # e06 --quick's mixes: the 4K prompt beside 2 decodes only
    assert calls[4:] == [("P/D disaggregation", 2, 4096)]
