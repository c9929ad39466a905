"""e10: frozen, held-out validation of the simulator (issue 27 item 5).

Runs e03 (decode steps), e04 (prefill, with its emulated slow link) and e06 (serving mixes
replayed on the simulated clock) N rounds each as subprocesses, interleaved round by round so
that a drift of this VM spreads over all three, or reads existing records (--from-records).
The records must all carry the same simulator fingerprint (hmoe_jax/sim/frozen.py: the
simulator's sources and configs/systems/local.toml hashed); records that differ are refused,
never pooled. It reports, per experiment and per regime, the distribution of the signed %
errors (simulated - measured) / measured over rounds x rows: median, min/max, p90 of |error|,
the signed errors and whether they are all of one sign; per case (one row identity) the
spread over rounds; the two named cases (the link-bound prefill, a prefill sharing the CPU
with decodes); and the issue's Done-when checks as booleans. A check without data is null
with its reason: no number here is made up.

    python -m experiments.e10_frozen_validation [--quick] [--rounds 3]
    python -m experiments.e10_frozen_validation --from-records 'results/e10_rounds/<stamp>/*.json'

The rounds' records go to <out-dir>/e10_rounds/<stamp>/ (not among the claims table's runs).
Run it on a quiet machine; a structure change to the simulator after a frozen run needs a new
one (the fingerprint changes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from experiments.common.record import REPO_ROOT, emit_record, parse_args
from hmoe_jax.sim.validation import EXPERIMENTS, MIN_ROUNDS, aggregate

CLAIM = "the simulator's errors on this machine, frozen (sources and profile hashed) over repeated rounds"


# --- running the rounds ----------------------------------------------------------------------


def run_round(exp: str, quick: bool, out_dir: Path) -> Path:
    """One experiment as a subprocess; the path of the record it wrote."""
    cmd = [sys.executable, "-m", f"experiments.{exp}", "--out-dir", str(out_dir)] + (
        ["--quick"] if quick else []
    )
    print(f"[e10] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{exp} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("[record] "):
            return Path(line.split(" ", 1)[1].strip())
    raise RuntimeError(f"{exp}: no '[record] <path>' line in its output")


def load(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    if not paths:
        raise FileNotFoundError("--from-records matched no files")
    return [(p, json.loads(Path(p).read_text())) for p in sorted(paths)]


def main(argv: list[str] | None = None) -> dict:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    pre.add_argument("--from-records", default=None, help="a glob of existing e03/e04/e06 records")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = parse_args("e10_frozen_validation", __doc__, rest)
    from hmoe_jax.sim.frozen import local_fingerprint

    tree_fp = local_fingerprint()
    if own.from_records:
        records = load(glob.glob(own.from_records))
        source = f"records {own.from_records}"
    else:
        if own.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {own.rounds}")
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out = Path(args.out_dir) / "e10_rounds" / stamp
        paths = [run_round(e, args.quick, out) for _ in range(own.rounds) for e in EXPERIMENTS]
        records = load([str(p) for p in paths])
        source = f"{own.rounds} rounds run now into {out}"
    agg = aggregate(records)
    args.sim_fingerprint = agg.pop("sim_fingerprint")  # the pooled records' one fingerprint, at the top
    rows = [{"part": "regime", **r} for r in agg.pop("by_regime")] + [
        {"part": "case", **r} for r in agg.pop("by_case")
    ]
    summary = {
        **agg,
        "fingerprint_matches_tree": args.sim_fingerprint["sha256"] == tree_fp["sha256"],
        "tree_fingerprint": tree_fp["sha256"],
    }
    for name, c in summary["checks"].items():
        print(f"[check] {name}: {c['ok']}" + (f" ({c['reason']})" if c.get("reason") else ""), flush=True)
    return emit_record(
        args,
        claim=CLAIM,
        paper_value=None,
        config={
            "rounds": own.rounds if not own.from_records else None,
            "source": source,
            "experiments": list(EXPERIMENTS),
        },
        rows=rows,
        summary=summary,
    )


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # FingerprintMismatch included
        print(f"e10_frozen_validation: {e}", file=sys.stderr)
        sys.exit(2)
