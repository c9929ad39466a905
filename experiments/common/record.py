"""Experiment records: arguments, environment, the JSON record (file + last stdout line)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# the experiments that validate the simulator on this machine's profile: their records carry
# the simulator's fingerprint (hmoe_jax/sim/frozen.py), which e10 checks before pooling rounds
VALIDATION_EXPERIMENTS = ("e03_decode", "e04_slp_prefill", "e05_dslp_smallep", "e06_concurrency")


def parse_args(experiment: str, doc: str | None = None, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m experiments.{experiment}", description=doc)
    p.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "results"), help="where the JSON record goes")
    p.add_argument("--threads", type=int, default=0, help="threads for all variants (0 = all cores)")
    args = p.parse_args(argv)
    args.experiment = experiment
    from hmoe_jax.runtime.host_heap import retain_freed_host_memory

    retain_freed_host_memory()  # before jax's threads allocate: freed host buffers are reused
    # hashed at the start of the run, before any simulation: the sources this process loaded
    args.sim_fingerprint = sim_fingerprint_of(experiment)
    return args


def sim_fingerprint_of(experiment: str) -> dict[str, Any] | None:
    """The simulator's fingerprint for a validation experiment's record, None for the others."""
    if experiment not in VALIDATION_EXPERIMENTS:
        return None
    from hmoe_jax.sim.frozen import local_fingerprint

    return local_fingerprint()


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Where and with what a run happened (goes into every record)."""
    import jax
    import numpy as np

    env: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax_version": jax.__version__,
        "numpy_version": np.__version__,
        "git_sha": _git_sha(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "openblas_env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
    }
    from hmoe_jax.runtime.host_heap import host_heap_state

    env["host_heap"] = host_heap_state()  # runtime/host_heap.py: freed host memory kept for reuse
    try:
        from hmoe_jax.kernels.ffi import cpu_features

        env["cpu_features"] = cpu_features()
    except ImportError:
        env["cpu_features"] = None
    try:
        import threadpoolctl

        env["blas"] = [
            {k: i.get(k) for k in ("internal_api", "version", "num_threads", "architecture")}
            for i in threadpoolctl.threadpool_info()
        ]
    except ImportError:
        env["blas"] = None
    return env


def print_ceiling(what: str, **numbers: float) -> None:
    """Print the theoretical ceiling of a measurement before running it (nanochat style)."""
    parts = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
    print(f"[ceiling] {what}: {parts}", flush=True)


def emit_record(
    args: argparse.Namespace,
    *,
    claim: str,
    paper_value: Any,
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """Write results/<experiment>_<timestamp>.json and print the record as the last line."""
    record: dict[str, Any] = {"experiment": args.experiment}
    fp = getattr(args, "sim_fingerprint", None) or sim_fingerprint_of(args.experiment)
    if fp is not None:
        record["sim_fingerprint"] = fp
    record |= {
        "claim": claim,
        "paper_value": paper_value,
        "config": {"quick": bool(args.quick), "threads": args.threads, **config},
        "environment": environment(),
        "rows": rows,
        "summary": summary,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"{args.experiment}_{stamp}.json"
    text = json.dumps(record, default=_json_default, allow_nan=True)
    path.write_text(text + "\n")
    print(f"[record] {path}", flush=True)
    print(text, flush=True)
    return record


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
