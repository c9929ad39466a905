"""Re-simulate committed e03 / e04 / e05 / e06 records with today's simulator and compare.

    python -m experiments.common.resim_check                      # the newest full record of each
    python -m experiments.common.resim_check results/e04_slp_prefill_<stamp>.json ...

A restructure that must not change the simulator (or the plans it times) is checked here: the
measured rows of each record are kept as they were (times, read probes, link caps), their
simulated side is recomputed by the same function the experiment uses (e03/e04/e05 `sim_here`,
e06's `resimulate`), the projection rows are recomputed from scratch, and every simulated row
field and summary key is compared with the committed value after a JSON round trip (floats
survive it exactly, so "identical" means bit-identical). Exit status 1 and a list of the keys
that moved if anything differs. Nothing is written under results/.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ("e03_decode", "e04_slp_prefill", "e05_dslp_smallep", "e06_concurrency")


def _bench_cfg(quick: bool):
    from hmoe_jax.io.bench_twin import bench_twin_config

    return bench_twin_config(quick=quick)


def _resim_e03(rec: dict[str, Any]) -> tuple[list[dict], dict]:
    from experiments import e03_decode as e03
    from hmoe_jax.plan.profile import load_profile

    quick = rec["config"]["quick"]
    cfg = _bench_cfg(quick)
    here = [{**r, **e03.sim_here(cfg, r)} for r in rec["rows"] if r["part"] == "measured_here"]
    proj = e03.projection(quick)
    return here + proj, e03.summarise(here, proj, load_profile(e03.PAPER_MACHINE))


def _resim_e04(rec: dict[str, Any]) -> tuple[list[dict], dict]:
    from experiments import e04_slp_prefill as e04
    from hmoe_jax.plan.profile import load_profile

    quick = rec["config"]["quick"]
    cfg = _bench_cfg(quick)
    here = [
        {**r, **e04.sim_here(cfg, r, e04.HERE_MAX_LEN)} for r in rec["rows"] if r["part"] == "measured_here"
    ]
    proj, extra = e04.projection(quick)
    return here + proj, e04.summarise(here, extra, load_profile(e04.PAPER_MACHINE))


def _resim_e05(rec: dict[str, Any]) -> tuple[list[dict], dict]:
    from experiments import e05_dslp_smallep as e05
    from hmoe_jax.plan.profile import load_profile

    cfg = e05.here_config()
    here = [{**r, **e05.sim_here(cfg, r)} for r in rec["rows"] if r["part"] == "measured_here"]
    proj, extra = e05.projection(rec["config"]["quick"])
    return here + proj, e05.summarise(here, extra, load_profile(e05.PAPER_MACHINE))


def _resim_e06(path: Path) -> tuple[list[dict], dict]:
    from experiments.common.simserve import resimulate

    _, rows, summary = resimulate(str(path))
    return rows, summary


def resimulate_record(path: Path) -> tuple[dict[str, Any], list[dict], dict]:
    """(committed record, recomputed rows, recomputed summary), both JSON round-tripped."""
    from experiments.common.record import _json_default

    rec = json.loads(path.read_text())
    name = rec["experiment"]
    if name == "e03_decode":
        rows, summary = _resim_e03(rec)
    elif name == "e04_slp_prefill":
        rows, summary = _resim_e04(rec)
    elif name == "e05_dslp_smallep":
        rows, summary = _resim_e05(rec)
    elif name == "e06_concurrency":
        rows, summary = _resim_e06(path)
    else:
        raise SystemExit(
            f"{path}: experiment {name!r} has no re-simulation (known: {', '.join(EXPERIMENTS)})"
        )
    rt = json.loads(json.dumps({"rows": rows, "summary": summary}, default=_json_default, allow_nan=True))
    return rec, rt["rows"], rt["summary"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(rec: dict[str, Any], rows: list[dict], summary: dict) -> list[str]:
    """Every summary key whose recomputed value differs from the record's, and the rows that
    are in one list but not the other (rows compare whole, as canonical JSON, ignoring their
    order: e06 writes its measured parts in the order they ran, a re-simulation appends)."""

    def canon(r: dict) -> str:
        return json.dumps(r, sort_keys=True, allow_nan=True)

    old_rows, new_rows = Counter(map(canon, rec["rows"])), Counter(map(canon, rows))
    out = [f"row only in the record: {r[:300]}" for r in (old_rows - new_rows).elements()]
    out += [f"row only in the re-simulation: {r[:300]}" for r in (new_rows - old_rows).elements()]
    for k in sorted(set(rec["summary"]) | set(summary)):
        if not _same(rec["summary"].get(k), summary.get(k)):
            out.append(f"summary.{k}: {rec['summary'].get(k)!r} -> {summary.get(k)!r}")
    return out


def newest_full(experiment: str) -> Path:
    paths = sorted((ROOT / "results").glob(f"{experiment}_*.json"))
    full = [p for p in paths if not json.loads(p.read_text())["config"]["quick"]]
    if not full:
        raise SystemExit(f"no full {experiment} record under {ROOT / 'results'}")
    return full[-1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [newest_full(e) for e in EXPERIMENTS]
    bad = 0
    for p in paths:
        print(f"[resim] {p.name} ...", flush=True)
        rec, rows, summary = resimulate_record(p)
        diff = differences(rec, rows, summary)
        if diff:
            bad += 1
            print(f"[resim] {p.name}: {len(diff)} rows or summary keys differ", flush=True)
            for d in diff[:40]:
                print(f"  {d}", flush=True)
        else:
            print(f"[resim] {p.name}: identical ({len(rows)} rows, {len(summary)} summary keys)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
