"""The simulator's validation errors pooled over repeated records (issue 27 item 5; driven by
experiments/e10_frozen_validation.py): records must share one simulator fingerprint
(sim/frozen.py), and the signed % errors (simulated - measured) / measured of e03 (decode),
e04 (prefill, its emulated link) and e06 (serving replay) become distributions per
experiment, regime and case, plus the issue's Done-when checks. Plain data in, plain data
out: no experiment is run here, and a check without data is None with its reason."""

from __future__ import annotations

from typing import Any

import numpy as np

EXPERIMENTS = ("e03_decode", "e04_slp_prefill", "e06_concurrency")
# the Done-when thresholds (% of the measured time, p90 of |error| over rounds x rows)
DECODE_P90_MAX_PCT = 10.0
PREFILL_P90_MAX_PCT = 10.0
REPLAY_P90_MAX_PCT = 12.0
LINK_BOUND_MAX_PCT = 15.0
MIN_ROUNDS = 3


class FingerprintMismatch(ValueError):
    pass


# --- reading the records ---------------------------------------------------------------------


def fingerprint_hash(rec: dict[str, Any]) -> str | None:
    fp = rec.get("sim_fingerprint")
    return fp.get("sha256") if isinstance(fp, dict) else None


def check_fingerprints(records: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The one fingerprint all records carry; FingerprintMismatch naming the two hashes and
    the records that differ, or a record without one."""
    if not records:
        raise ValueError("no records to combine")
    first_name, first = records[0]
    h0 = fingerprint_hash(first)
    for name, rec in records:
        h = fingerprint_hash(rec)
        if h is None:
            raise FingerprintMismatch(
                f"record {name} has no sim_fingerprint (made before hmoe_jax/sim/frozen.py): "
                "it cannot be part of a frozen validation"
            )
        if h != h0:
            raise FingerprintMismatch(
                f"simulator fingerprints differ: {first_name} has {h0}, {name} has {h}; "
                "the simulator's sources or the profile changed between them, so their errors "
                "are not one frozen model's (rerun all rounds on one tree)"
            )
    return first["sim_fingerprint"]


def _check_modes(records: list[tuple[str, dict[str, Any]]]) -> None:
    """Quick and full runs of one experiment measure different shapes: never pooled."""
    seen: dict[str, tuple[str, bool]] = {}
    for name, rec in records:
        exp, quick = rec.get("experiment"), bool(rec.get("config", {}).get("quick"))
        if exp in seen and seen[exp][1] != quick:
            raise ValueError(f"{exp}: {seen[exp][0]} is quick={seen[exp][1]} but {name} is quick={quick}")
        seen.setdefault(exp, (name, quick))


def _convert_gbps(rec: dict[str, Any]) -> float | None:
    v = rec.get("config", {}).get("here_inputs", {}).get("accelerator.weight_convert_gbps")
    return v.get("value") if isinstance(v, dict) else None


def error_points(rec: dict[str, Any], rnd: int) -> tuple[list[dict[str, Any]], list[str]]:
    """(one point per validated row and metric: experiment, regime, case, metric, signed
    err_pct, round; the rows left out and why). Sign: + is the simulator too slow."""
    exp = rec.get("experiment")
    pts: list[dict[str, Any]] = []
    left: list[str] = []

    def add(regime: str, case: str, metric: str, err: Any, **extra: Any) -> None:
        if err is None:
            left.append(f"{exp} round {rnd} {case} {metric}: no error in the record")
            return
        pts.append(
            {
                "experiment": exp,
                "regime": regime,
                "case": case,
                "metric": metric,
                "err_pct": float(err),
                "round": rnd,
                **extra,
            }
        )

    rows = rec.get("rows", [])
    if exp == "e03_decode":
        for r in rows:
            if r.get("part") == "measured_here":
                add("decode", f"batch {r['batch']}", "step_s", r.get("err_pct"))
    elif exp == "e04_slp_prefill":
        conv = _convert_gbps(rec)
        for r in rows:
            if r.get("part") != "measured_here":
                continue
            link = r.get("link_gbps")
            case = f"{r['schedule']} {r['prompt_len']} tok" + (f" link {link} GB/s" if link else "")
            if link is None:
                add(f"prefill_{r['schedule']}", case, "prefill_s", r.get("err_pct"))
            else:
                # the link binds only well under the rate the stand-in converts weights at
                under = None if conv is None else link < conv
                add(
                    "prefill_link",
                    case,
                    "prefill_s",
                    r.get("err_pct"),
                    link_gbps=link,
                    convert_gbps=conv,
                    link_under_convert_rate=under,
                    sim_bound=r.get("sim_bound"),
                )
    elif exp == "e06_concurrency":
        for r in rows:
            if r.get("part") != "sim_validation":
                continue
            case = f"{r['backend']} {r['mix']} {r['kind']}"
            if r.get("outside_model"):
                left.append(f"{exp} round {rnd} {case}: outside the model ({r['outside_model']})")
                continue
            shared = r["kind"] == "mix" and "P" in r["mix"] and "D" in r["mix"]
            for m in ("ttft_s", "tpot_s"):
                if m in r:
                    add(f"replay_{r['kind']}", case, m, r[m].get("p90_err_pct"), prefill_and_decodes=shared)
    else:
        raise ValueError(f"not a validation record e10 reads: experiment {exp!r}")
    return pts, left


# --- the distributions -----------------------------------------------------------------------


def distribution(errs: list[float]) -> dict[str, Any]:
    """The signed errors' distribution: median |e| and median e, min/max e, p90 of |e| (numpy's
    linear interpolation), and whether all are of one sign (a zero is of neither)."""
    if not errs:
        return {
            "n": 0,
            "median_abs_pct": None,
            "median_signed_pct": None,
            "min_signed_pct": None,
            "max_signed_pct": None,
            "p90_abs_pct": None,
            "signed_pct": [],
            "all_one_sign": None,
        }
    a = np.asarray(errs, dtype=float)
    return {
        "n": len(errs),
        "median_abs_pct": float(np.median(np.abs(a))),
        "median_signed_pct": float(np.median(a)),
        "min_signed_pct": float(a.min()),
        "max_signed_pct": float(a.max()),
        "p90_abs_pct": float(np.percentile(np.abs(a), 90)),
        "signed_pct": [float(x) for x in a],
        "all_one_sign": bool((a > 0).all() or (a < 0).all()),
    }


def _group(pts: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = {}
    for p in pts:
        out.setdefault(tuple(p[k] for k in keys), []).append(p["err_pct"])
    return out


def _threshold_check(errs: list[float], limit: float, what: str, why_none: str) -> dict[str, Any]:
    if not errs:
        return {"ok": None, "reason": why_none}
    p90 = distribution(errs)["p90_abs_pct"]
    return {"ok": p90 <= limit, "p90_abs_pct": p90, "limit_pct": limit, "n": len(errs), "what": what}


def aggregate(records: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Pool the records' errors (one frozen fingerprint, rounds counted per experiment) into
    per-experiment, per-regime and per-case distributions, the named cases and the checks."""
    fp = check_fingerprints(records)
    _check_modes(records)
    pts: list[dict[str, Any]] = []
    left: list[str] = []
    rounds: dict[str, list[str]] = {e: [] for e in EXPERIMENTS}
    for name, rec in records:
        exp = rec.get("experiment")
        if exp not in rounds:
            raise ValueError(f"{name}: experiment {exp!r} is not one e10 pools ({', '.join(EXPERIMENTS)})")
        p, lf = error_points(rec, len(rounds[exp]))
        rounds[exp].append(name)
        pts += p
        left += lf

    def errs(pred) -> list[float]:
        return [p["err_pct"] for p in pts if pred(p)]

    by_exp = {e: distribution(errs(lambda p, e=e: p["experiment"] == e)) for e in EXPERIMENTS}
    by_regime = [
        {"experiment": k[0], "regime": k[1], "metric": k[2], **distribution(v)}
        for k, v in sorted(_group(pts, ("experiment", "regime", "metric")).items())
    ]
    by_case = [
        {"experiment": k[0], "regime": k[1], "case": k[2], "metric": k[3], **distribution(v)}
        for k, v in sorted(_group(pts, ("experiment", "regime", "case", "metric")).items())
    ]
    link_pts = [p for p in pts if p["regime"] == "prefill_link"]
    binding = [p for p in link_pts if p.get("link_under_convert_rate")]
    shared = [p for p in pts if p.get("prefill_and_decodes")]
    named = {
        "link_bound": {
            "rows": "e04 slp rows under an emulated link (Engine link_gbps); the link binds only "
            "when it is well under the stand-in's weight convert rate (accelerator.weight_convert_gbps)",
            "all_link_rows": distribution([p["err_pct"] for p in link_pts]),
            "link_rows_under_convert_rate": distribution([p["err_pct"] for p in binding]),
            "links": sorted({(p["link_gbps"], p["convert_gbps"], p["sim_bound"]) for p in link_pts}, key=str),
        },
        "prefill_and_decodes_share_cpu": {
            "rows": "e06 replay rows of a mix (1P+kD, kind mix): a long prefill and decodes at once",
            "ttft_s": distribution([p["err_pct"] for p in shared if p["metric"] == "ttft_s"]),
            "tpot_s": distribution([p["err_pct"] for p in shared if p["metric"] == "tpot_s"]),
        },
    }

    def no_data(exp: str) -> str:
        return f"no {exp} records" if not rounds[exp] else f"no usable rows in the {exp} records"

    checks: dict[str, Any] = {
        "decode_p90_le_10": _threshold_check(
            errs(lambda p: p["experiment"] == "e03_decode"),
            DECODE_P90_MAX_PCT,
            "e03 decode step, all batch sizes",
            no_data("e03_decode"),
        ),
        "prefill_p90_le_10": _threshold_check(
            errs(lambda p: p["experiment"] == "e04_slp_prefill" and p["regime"] != "prefill_link"),
            PREFILL_P90_MAX_PCT,
            "e04 prefill at the native link, cpu and slp",
            no_data("e04_slp_prefill"),
        ),
        "replay_ttft_p90_le_12": _threshold_check(
            errs(lambda p: p["experiment"] == "e06_concurrency" and p["metric"] == "ttft_s"),
            REPLAY_P90_MAX_PCT,
            "e06 replay, each row's p90-TTFT error, alone and mix",
            no_data("e06_concurrency"),
        ),
        "replay_tpot_p90_le_12": _threshold_check(
            errs(lambda p: p["experiment"] == "e06_concurrency" and p["metric"] == "tpot_s"),
            REPLAY_P90_MAX_PCT,
            "e06 replay, each row's p90-TPOT error, alone and mix",
            no_data("e06_concurrency"),
        ),
    }
    if binding:
        checks["link_bound_within_15"] = _threshold_check(
            [p["err_pct"] for p in binding],
            LINK_BOUND_MAX_PCT,
            "e04 slp under an emulated link below the convert rate",
            "",
        )
    elif link_pts:
        checks["link_bound_within_15"] = {
            "ok": None,
            "reason": "the emulated link rows ("
            + ", ".join(f"{p['link_gbps']} GB/s" for p in link_pts[:3])
            + ") are not under the convert "
            f"rate ({link_pts[0]['convert_gbps']} GB/s): the link does not bind there",
        }
    else:
        checks["link_bound_within_15"] = {
            "ok": None,
            "reason": "no e04 row under an emulated link (a --quick e04 runs none)",
        }
    mixed = {
        e: (None if by_exp[e]["all_one_sign"] is None else not by_exp[e]["all_one_sign"]) for e in EXPERIMENTS
    }
    missing = [e for e, v in mixed.items() if v is None]
    checks["signs_not_all_one"] = (
        {"ok": None, "reason": f"no errors for {', '.join(missing)}", "per_experiment": mixed}
        if missing
        else {
            "ok": all(mixed.values()),
            "per_experiment": mixed,
            "what": "within each of e03, e04, e06 the signed errors are not all of one sign",
        }
    )
    checks["at_least_3_rounds"] = {
        "ok": all(len(v) >= MIN_ROUNDS for v in rounds.values()),
        "rounds": {e: len(v) for e, v in rounds.items()},
    }
    oks = [c["ok"] for c in checks.values()]
    done = None if any(o is None for o in oks) else all(oks)
    return {
        "sim_fingerprint": fp,
        "rounds": rounds,
        "by_experiment": by_exp,
        "by_regime": by_regime,
        "by_case": by_case,
        "named_cases": named,
        "checks": checks,
        "done_when_met": done,
        "done_when_reason": None if done is not None else "a check has no data (see checks)",
        "left_out": left,
    }
