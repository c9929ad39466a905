"""`hmoe reproduce [--quick] [--only e03,e04]`: run every experiment, render paper_figs/ from
their records, print the claims table (claim | paper | projected | measured here) and write
it into experiments/README.md between the reproduce markers.

Each experiment runs as its own process (`python -m experiments.<name> [--quick]`: a fresh
JAX, its own threads, as its docstring's command), so one failing does not stop the rest;
the table is built from the newest full-size results/<name>_*.json of each (else the newest
--quick one), i.e. from records only. Experiments are every experiments/eNN_<claim>.py.
Projected values come from the simulator (sim/) on the paper machine's profile; measured
values were measured on this machine by that run.

Bands: after the experiments, the headline projections of the experiments run (decode FP8 /
INT4, SLP at 20K and its 32K TTFT, DSLP at 32K, e06's P/D worst TTFT / TPOT inflation and
batch-4 gain: sim/headlines.py) are recomputed with their [low, high] band over the
profile's assumed and carried-over inputs (sim/bands.py) and written as
results/bands_<stamp>.json, with the other headlines carried over from the newest bands
record; paper_figs/fig_bands.py draws a tornado per headline from it and the table's band
column reads it. --bands-only recomputes the selected experiments' bands without running
them (after a simulator change). A projected value whose plan does not fit the
accelerator's memory is shown with "(fits: false)", read from the record's projection rows.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def find_root() -> Path:
    """The source checkout whose experiments/ and paper_figs/ to run: the current directory
    when it is one (a `pip install .` puts only the package in site-packages), else the
    checkout the package was installed from in editable mode. Otherwise the package's
    parent, and cmd_reproduce says what is missing."""
    pkg_parent = Path(__file__).resolve().parents[2]  # hmoe_jax/cli/reproduce.py -> the checkout
    for cand in (Path.cwd(), pkg_parent):
        if any((cand / "experiments").glob("e[0-9][0-9]_*.py")):
            return cand.resolve()
    return pkg_parent


ROOT = find_root()


def experiment_names() -> list[str]:
    """Every experiments/eNN_<claim>.py, in number order."""
    return sorted(p.stem for p in (ROOT / "experiments").glob("e[0-9][0-9]_*.py"))


# experiments `hmoe reproduce` runs only when --only names them: e10 reruns e03, e04 and e06
# for several rounds itself (a frozen validation wants a quiet machine and its own session)
RUN_ONLY_WHEN_NAMED = {"e10_frozen_validation": "reruns e03/e04/e06 N rounds; --only e10 to run it"}

# summary keys per experiment: (projected on the paper machine, measured here)
KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "e03_decode": (
        ("decode_fp8_tok_per_s", "decode_int4_tok_per_s", "decode_fp8_tok_per_s_32k"),
        ("sim_error_decode", "sim_error_decode_async"),
    ),
    "e04_slp_prefill": (
        ("slp_tok_per_s_20k", "slp_ttft_s_32k", "slp_max_prompt_30s", "crossover_tokens", "slp_gain_at_4k"),
        ("sim_error_prefill",),
    ),
    "e05_dslp_smallep": (
        (
            "dslp_tok_per_s_32k",
            "dslp_max_prompt_30s",
            "dslp_over_slp",
            "smallep_vs_ep_layer_ratio",
            "ep_comm_share",
        ),
        ("sim_error_dslp_here",),
    ),
    "e06_concurrency": (
        (
            "projected_batch4_throughput_gain",
            "projected_dual_batch_gain",
            "projected_worst_ttft_inflation",
            "projected_worst_tpot_inflation",
        ),
        (
            "batch4_throughput_gain",
            "worst_ttft_inflation",
            "worst_tpot_inflation",
            "sim_error_ttft_p90",
            "sim_error_tpot_p90",
            "pd_weight_pss_ratio",
        ),
    ),
}
BEGIN, END = "<!-- hmoe reproduce: begin -->", "<!-- hmoe reproduce: end -->"


def newest(name: str, results: Path | None = None) -> Path | None:
    """The newest full-size record of an experiment, else its newest --quick one."""
    found = sorted((results or ROOT / "results").glob(f"{name}_*.json"))
    full = [p for p in found if not json.loads(p.read_text()).get("config", {}).get("quick")]
    return (full or found or [None])[-1]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return str(v)


def _measured_default(summary: dict[str, Any]) -> tuple[str, ...]:
    return tuple(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))[:4]


def fits_note(key: str, rec: dict[str, Any]) -> str:
    """ " (fits: false)" when the record's projection row that summary `key` reads did not fit
    the accelerator's memory (e04/e05: <schedule>_..._<N>k is that schedule at N x 1024
    tokens; e03: decode_<format>_..._[<N>k] is batch 1 at 1K or N x 1024 context)."""
    proj = [r for r in rec.get("rows", []) if str(r.get("part", "")).startswith("projection")]
    size = re.search(r"_(\d+)k$", key)
    if key.startswith("decode_"):
        fmt = "int4" if key.startswith("decode_int4") else "fp8"
        ctx = int(size.group(1)) * 1024 if size else 1024
        hit = [
            r
            for r in proj
            if r.get("context") == ctx
            and r.get("batch") == 1
            and r.get("expert_format") == fmt
            and r.get("model", "deepseek_v3") == "deepseek_v3"
        ]
    elif size and key.split("_")[0] in ("cpu", "slp", "dslp", "ep"):
        n = int(size.group(1)) * 1024
        hit = [r for r in proj if r.get("schedule") == key.split("_")[0] and r.get("prompt_len") == n]
    else:
        return ""
    return " (fits: false)" if any(r.get("fits") is False for r in hit) else ""


def band_cell(keys: tuple[str, ...], bands: dict[str, Any] | None, summary: dict[str, Any]) -> str:
    """ "key central [low, high]" for each of `keys` the bands record has; a central value
    that is not the experiment record's (a record older than the simulator the bands ran
    on) says so."""
    heads = (bands or {}).get("headlines", {})
    cells = []
    for k in keys:
        if k not in heads:
            continue
        h = heads[k]
        cell = f"{k} {_fmt(h['central'])} [{_fmt(h['low'])}, {_fmt(h['high'])}]"
        cell += "" if h.get("fits", True) else " (fits: false)"
        rec_v = summary.get(k)
        if isinstance(rec_v, (int, float)) and abs(h["central"] - rec_v) > 1e-3 * abs(rec_v):
            cell += f" (central is today's simulator; the record says {_fmt(rec_v)}: rerun it)"
        cells.append(cell)
    return "; ".join(cells) or "-"


def table_rows(results: Path | None = None) -> list[dict[str, str]]:
    rows = []
    bands_path = newest("bands", results)
    bands = json.loads(bands_path.read_text()) if bands_path is not None else None
    for name in experiment_names():
        path = newest(name, results)
        if path is None:
            continue
        rec = json.loads(path.read_text())
        s = rec.get("summary", {})
        proj, meas = KEYS.get(name, ((), _measured_default(s)))
        rows.append(
            {
                "exp": name,
                "claim": rec.get("claim", ""),
                "paper": _fmt(rec.get("paper_value")),
                "projected": "; ".join(f"{k} {_fmt(s[k])}{fits_note(k, rec)}" for k in proj if k in s) or "-",
                "band": band_cell(proj, bands, s),
                "measured": "; ".join(f"{k} {_fmt(s[k])}" for k in meas if k in s) or "-",
                "record": path.stem + (f", {bands_path.stem}" if band_cell(proj, bands, s) != "-" else ""),
            }
        )
    return rows


COLUMNS = ("exp", "claim", "paper", "projected", "band", "measured", "record")


def markdown(rows: list[dict[str, str]]) -> str:
    out = [
        "| exp | claim | paper | projected (paper machine, simulator) | band over assumed inputs: "
        "central [low, high] | measured here | record |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [r.get(k, "-").replace("|", "/") for k in COLUMNS]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_bands(results: Path, experiments: list[str], quick: bool) -> Path | None:
    """results/bands_<stamp>.json: the headline bands (sim/headlines.py) of the headlines
    whose experiment is in `experiments`; None when none is."""
    from hmoe_jax.sim.headlines import HEADLINES, headline_bands

    names = [h.name for h in HEADLINES if h.experiment in experiments]
    if not names:
        return None
    t0 = time.perf_counter()
    # --quick: e06's mixes at its --quick sizes, as the --quick e06 record it sits beside
    rec = headline_bands(names, progress=lambda m: print(f"[reproduce] {m}", flush=True), quick=quick)
    # the other headlines' bands carry over from the newest bands record, so a run of some
    # experiments does not drop the rest from the table (band_cell flags a stale central)
    prev_path = newest("bands", results)
    if prev_path is not None:
        prev = json.loads(prev_path.read_text())
        for k, h in prev.get("headlines", {}).items():
            if k not in rec["headlines"]:
                rec["headlines"][k] = {**h, "carried_over_from": h.get("carried_over_from", prev_path.stem)}
    rec.update(
        experiment="bands",
        claim="sensitivity of each headline projection to the profile's assumed and carried-over inputs",
        config={"quick": quick, "seconds": round(time.perf_counter() - t0, 1)},
        summary={
            k: {x: h[x] for x in ("central", "low", "high", "fits")} for k, h in rec["headlines"].items()
        },
    )
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"bands_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return path


def write_readme(table: str) -> Path:
    path = ROOT / "experiments" / "README.md"
    text = path.read_text() if path.exists() else "# Experiments\n"
    block = (
        f"{BEGIN}\n## Reproduction table (generated by `hmoe reproduce` from the newest records)\n\n"
        f"{table}\n{END}"
    )
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    return path


def add_reproduce_parser(sub: Any) -> None:
    p = sub.add_parser("reproduce", help="run every experiment, render paper_figs/, print the claims table")
    p.add_argument("--quick", action="store_true", help="each experiment's --quick sizes")
    p.add_argument("--only", default=None, help="comma-separated experiment names or prefixes (e03,e04)")
    p.add_argument(
        "--table-only", action="store_true", help="rebuild the table and figures from existing records"
    )
    p.add_argument(
        "--bands-only",
        action="store_true",
        help="recompute the selected experiments' headline bands on today's simulator (no experiment runs), "
        "then the table and figures",
    )
    p.add_argument(
        "--out-dir", default=None, help="records directory (default results/); the table reads it too"
    )
    p.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    names = experiment_names()
    if not names:
        print(
            f"hmoe reproduce: no experiments/eNN_*.py under {Path.cwd()} or {ROOT}: run it from the root "
            "of a source checkout (the experiments and figure scripts are not part of the installed package)",
            file=sys.stderr,
        )
        return 2
    results = Path(args.out_dir).resolve() if args.out_dir else ROOT / "results"
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        names = [n for n in names if any(n.startswith(w) for w in want)]
    else:
        for n, why in RUN_ONLY_WHEN_NAMED.items():
            if n in names and not args.table_only:
                print(f"[reproduce] {n}: not run ({why})", flush=True)
        names = [n for n in names if n not in RUN_ONLY_WHEN_NAMED]
    status: dict[str, Any] = {}
    t_all = time.perf_counter()
    if args.table_only and args.bands_only:
        print("hmoe reproduce: --table-only and --bands-only exclude each other", file=sys.stderr)
        return 2
    for name in names if not (args.table_only or args.bands_only) else []:
        if not (ROOT / "experiments" / f"{name}.py").exists():
            status[name] = "missing"
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", f"experiments.{name}", *(["--quick"] if args.quick else [])]
        cmd += ["--out-dir", str(results)]
        print(f"[reproduce] {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
        status[name] = {"rc": rc, "s": round(time.perf_counter() - t0, 1)}
        print(f"[reproduce] {name}: rc {rc} in {status[name]['s']} s", flush=True)
    if not args.table_only:
        bands = write_bands(results, names, args.quick)
        if bands is not None:
            status["bands"] = str(bands)
            print(f"[reproduce] bands written to {bands}", flush=True)
    for name in [*names, "bands"]:
        fig = ROOT / "paper_figs" / f"fig_{name}.py"
        rec = newest(name, results)
        if fig.exists() and rec is not None:
            # figures of records elsewhere (--out-dir) go beside them, never over paper_figs/
            out = [] if results == ROOT / "results" else ["--out", str(results / f"{name}.png")]
            if name == "bands":  # one tornado per headline: a directory, not one file
                out = ["--out-dir", str(ROOT / "paper_figs" if results == ROOT / "results" else results)]
            cmd = [sys.executable, str(fig), str(rec), *out]
            rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL).returncode
            if rc:
                print(f"[reproduce] figure {fig.name}: rc {rc}", flush=True)
    # the figures that are not one record's: e20's SLP timeline (the Chrome trace it writes
    # beside the records) and the shipped model's training run
    extra = {
        "slp_trace": ROOT / "results" / "slp_trace.json",
        "train_loss": ROOT / "hmoe_jax" / "assets" / "deepseek_v3_stdlib" / "train_record.json",
    }
    for stem, src in extra.items():
        fig = ROOT / "paper_figs" / f"fig_{stem}.py"
        if fig.exists() and src.exists():
            out = (ROOT / "paper_figs" if results == ROOT / "results" else results) / f"{stem}.png"
            rc = subprocess.run(
                [sys.executable, str(fig), str(src), "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL
            ).returncode
            if rc:
                print(f"[reproduce] figure {fig.name}: rc {rc}", flush=True)
    table = markdown(table_rows(results))
    path = write_readme(table) if results == ROOT / "results" else None
    print(table)
    print(f"[reproduce] table written to {path or '(not written: --out-dir is not results/)'}", flush=True)
    print(
        json.dumps(
            {"experiments": status, "total_s": round(time.perf_counter() - t_all, 1), "readme": str(path)}
        )
    )
    return 0 if all(not isinstance(v, dict) or v["rc"] == 0 for v in status.values()) else 1
