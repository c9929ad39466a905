"""e06's simulator parts: the request scheduler's policies on the simulated clock
(hmoe_jax/sim/serve.py).

- validate_mixes: every measured mix round of e06 (each request's arrival, prompt length and
  token times, kept in the rows as replay logs) replayed through SimServer with the same
  policy and options on this machine's profile (two stand-in accelerators, the host read
  rate re-based on the probes taken beside the mixes): per-request and p90 errors of TTFT,
  TPOT and end-to-end latency. Nothing is fitted: the profile is `hmoe calibrate`'s.
- project: the same three backends and mixes, batch sizes and dual-batch arms for
  DeepSeek-V3 FP8 on the paper's machine (2x RTX 5090, 2x EPYC 9355): projections, labelled
  as such, with the paper's values as the comparison column in the record.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common.simval import errors
from hmoe_jax.sim.replay import replay_requests, token_timings

METRICS = ("ttft_s", "tpot_s", "e2e_s")


def backend_server(cfg, prof, backend: str, long_len: int, max_len: int, log: list[dict]):
    """The SimServer that mirrors one of e06's backends (same policy, same options)."""
    from hmoe_jax.sim.serve import SimServer

    common = {"devices": 2, "max_batch": 8, "max_len": max_len}
    if backend.startswith("fcfs"):
        return SimServer(cfg, prof, "fcfs", decode_cap=6, **common)
    if backend.startswith("P/D"):
        return SimServer(cfg, prof, "fcfs", pd=True, schedule="slp", decode_cap=6, **common)
    # the measured scheduler object served every round in turn: it had decoded within the
    # idle window unless its long prompt went to dslp (the idle-node path)
    recent = not any(x.get("schedule") == "dslp" for x in log)
    return SimServer(
        cfg,
        prof,
        "paper",
        decode_cap=6,
        chunk_tokens=64,
        long_prompt_tokens=long_len // 2,
        dual_batch="off",
        last_decode_s=0.0 if recent else None,
        **common,
    )


def _p90(v: list[float]) -> float:
    return float(np.percentile(v, 90))


def validate_mixes(
    cfg, rows: list[dict], accelerators: int, long_len: int, max_len: int
) -> tuple[list[dict], dict]:
    """(one row per backend x mix x alone/mix: measured and simulated mean and p90 of each
    metric, the per-request errors; summary errors over those groups). Each mix row replays on
    this machine's profile with `accelerators` stand-ins and the read rate of its probes."""
    from experiments.common.simval import local_profile

    out, pairs_all = [], {m: [] for m in METRICS}
    p90_errs = {m: [] for m in METRICS}
    mean_errs = {m: [] for m in METRICS}
    excluded = []
    for row in (r for r in rows if r.get("part") == "mix"):
        prof = local_profile(
            read_gbps=row["probe_gbps"],
            peak_tflops=row.get("probe_tflops"),
            stream_gbps=row.get("probe_stream_gbps"),
        ).with_accelerators(accelerators)
        for kind in ("alone", "mix"):
            logs = [lg for rnd in row[f"replay_{kind}"] for lg in (rnd if kind == "alone" else [rnd])]
            meas = {m: [] for m in METRICS}
            sim = {m: [] for m in METRICS}
            dslp = False
            for lg in logs:
                kept = [x for x in lg if x["token_s"]]
                dslp |= any(x.get("schedule") == "dslp" for x in kept)
                srv = backend_server(cfg, prof, row["backend"], long_len, max_len, kept)
                reqs, stop = replay_requests(kept, max_len)
                res = srv.run(reqs, stop=stop)
                for x, r in zip(kept, res):
                    mt = token_timings(x["token_s"], x["arrival_s"])
                    st = token_timings(r.token_s, r.arrival_s)
                    for m in METRICS:
                        if mt[m] is not None and st[m] is not None:
                            meas[m].append(mt[m])
                            sim[m].append(st[m])
            g = {"part": "sim_validation", "backend": row["backend"], "mix": row["mix"], "kind": kind}
            g["outside_model"] = "dslp on stand-ins (e05)" if dslp else None
            for m in METRICS:
                if not meas[m]:
                    continue
                pe = errors(list(zip(sim[m], meas[m])))
                g[m] = {
                    "measured_mean": statistics.mean(meas[m]),
                    "simulated_mean": statistics.mean(sim[m]),
                    "measured_p90": _p90(meas[m]),
                    "simulated_p90": _p90(sim[m]),
                    "n": len(meas[m]),
                    "per_request_err": pe,
                }
                g[m]["p90_err_pct"] = 100.0 * (g[m]["simulated_p90"] / g[m]["measured_p90"] - 1.0)
                g[m]["mean_err_pct"] = 100.0 * (g[m]["simulated_mean"] / g[m]["measured_mean"] - 1.0)
                if not dslp:
                    p90_errs[m].append(g[m]["p90_err_pct"])
                    mean_errs[m].append(g[m]["mean_err_pct"])
                    pairs_all[m] += list(zip(sim[m], meas[m]))
            if dslp:
                excluded.append(f"{row['backend']} {row['mix']} {kind}")
            out.append(g)
    summary: dict[str, Any] = {}
    for m in METRICS:
        key = m[:-2]
        if p90_errs[m]:
            summary[f"sim_error_{key}_p90"] = statistics.mean(abs(e) for e in p90_errs[m])
            summary[f"sim_error_{key}_p90_signed"] = statistics.mean(p90_errs[m])
            summary[f"sim_error_{key}_p90_max"] = max(abs(e) for e in p90_errs[m])
            summary[f"sim_error_{key}_mean"] = statistics.mean(abs(e) for e in mean_errs[m])
            summary[f"sim_error_{key}_mean_signed"] = statistics.mean(mean_errs[m])
        summary[f"sim_error_{key}_per_request"] = errors(pairs_all[m])["mean_abs_pct"]
    summary["sim_validation_excluded"] = excluded
    return out, summary


SIM_PARTS = ("sim_validation", "projection_batch", "projection_mix")


def resimulate(record_path: str) -> tuple[dict, list[dict], dict]:
    """Parts 4 and 5 of an e06 record redone with today's simulator on the record's own
    measured rows (replay logs, probes): (config, rows, summary) for a new record that says
    which measured record it re-simulates (its "quick" says the record's size). Measured
    numbers are copied, never re-derived."""
    from hmoe_jax.io.bench_twin import bench_twin_config

    rec = json.loads(Path(record_path).read_text())
    cfg_rec = rec["config"]
    if cfg_rec["quick"]:
        from hmoe_jax.config import load_config
        from hmoe_jax.io.synthetic import ensure_default_checkpoint

        cfg = load_config(ensure_default_checkpoint(progress=False) / "config.json")
    else:
        cfg = bench_twin_config()
    long_len, max_len = cfg_rec["long_prompt_tokens"], cfg_rec["max_len"]
    measured = [r for r in rec["rows"] if r.get("part") not in SIM_PARTS]
    val_rows, val_summary = validate_mixes(cfg, measured, cfg_rec["stand_in_accelerators"], long_len, max_len)
    proj_rows, proj_summary, proj_inputs = project(cfg_rec["quick"])
    sim_keys = {k for k in rec["summary"] if k.startswith(("sim_", "projected_"))}
    summary = {k: v for k, v in rec["summary"].items() if k not in sim_keys}
    summary.update(val_summary, **proj_summary)
    name = Path(record_path).stem
    config = {
        **{k: v for k, v in cfg_rec.items() if k not in ("threads", "projection")},
        "projection": proj_inputs,
        "resimulated_from": name,
        "resimulated_note": (
            f"parts 1-3 (every measured row and summary key) are {name}'s, copied; parts 4-5 "
            "(sim_validation, projection rows, sim_* and projected_* keys) were recomputed by this "
            "commit's simulator from that record's replay logs and probes"
        ),
    }
    return config, measured + val_rows + proj_rows, summary


# ---------------------------------------------------------------- projection


def project(quick: bool) -> tuple[list[dict], dict, dict]:
    """(rows, summary, inputs) of the projection: DeepSeek-V3 FP8 on the paper's machine."""
    from hmoe_jax.config import named_model_config
    from hmoe_jax.plan.profile import load_profile
    from hmoe_jax.policies.base import overlap_bound
    from hmoe_jax.sim.mixes import PROJECTION_BACKENDS, project_mix, projection_lengths
    from hmoe_jax.sim.serve import decode_arms, decode_step_s

    cfg = named_model_config("deepseek_v3")
    prof = load_profile("paper_epyc9355_rtx5090")
    ctx, short_len, long_len = projection_lengths(quick)
    rows: list[dict] = []
    t1 = decode_step_s(cfg, prof, 1, ctx)
    rows.append({"part": "projection_batch", "batch": 1, "step_s": t1, "tok_per_s": 1 / t1, "gain": 1.0})
    for b in (2, 4, 6):
        a = decode_arms(cfg, prof, b, ctx)
        rows.append(
            {
                "part": "projection_batch",
                "batch": b,
                "step_s": a["plain_step_s"],
                "tok_per_s": b / a["plain_step_s"],
                "gain": b * t1 / a["plain_step_s"],
                **{k: a[k] for k in a if k != "plain_step_s"},
                "dual_gain_vs_sequential": a["sequential_step_s"] / a["dual_step_s"],
                "dual_gain_vs_plain": a["plain_step_s"] / a["dual_step_s"],
                "bound": overlap_bound(a["attn_layer_s"], a["moe_layer_s"]),
            }
        )
    for name in PROJECTION_BACKENDS:
        for k in (0, 2) if quick else (0, 1, 2):  # --quick: the idle and the worst mix
            rows.append(project_mix(cfg, prof, name, k, short_len, long_len))
    by_b = {r["batch"]: r for r in rows if r["part"] == "projection_batch"}
    duals = [r for r in rows if r["part"] == "projection_batch" and r["batch"] > 1]
    best = max(duals, key=lambda r: r["dual_gain_vs_sequential"])
    mx = [r for r in rows if r["part"] == "projection_mix" and r["mix"] != "1P"]

    def worst(backend: str, key: str) -> float:
        return max(r[key] for r in mx if r["backend"] == backend)

    summary = {
        **{f"projected_batch{b}_throughput_gain": by_b[b]["gain"] for b in (2, 4, 6)},
        "projected_decode_tok_per_s_b1": by_b[1]["tok_per_s"],
        "projected_dual_batch_gain": best["dual_gain_vs_sequential"],
        "projected_dual_batch_bound": best["bound"],
        "projected_dual_vs_plain": best["dual_gain_vs_plain"],
        "projected_worst_ttft_inflation": worst("P/D disaggregation", "ttft_inflation"),
        "projected_worst_tpot_inflation": worst("P/D disaggregation", "tpot_inflation"),
        "projected_worst_ttft_inflation_inprocess": worst("in-process paper policy", "ttft_inflation"),
        "projected_worst_tpot_inflation_inprocess": worst("in-process paper policy", "tpot_inflation"),
        "projected_worst_tpot_inflation_fcfs": worst("fcfs (no technique 3)", "tpot_inflation"),
        "projected_mixed_throughput_gain": min(
            r["mixed_throughput_gain"] for r in mx if r["backend"] == "P/D disaggregation"
        ),
    }
    inputs = {
        "model": "deepseek_v3 (FP8 experts)",
        "profile": prof.name,
        "decode_context": ctx,
        "short_prompt_tokens": short_len,
        "long_prompt_tokens": long_len,
        "assumed_inputs": prof.assumptions(),
        "label": "simulator projection (hmoe_jax/sim), not a measurement",
    }
    return rows, summary, inputs
