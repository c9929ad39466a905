"""`hmoe calibrate`: measure this machine (hmoe_jax/measure/calibrate.py) and write its
simulator profile (configs/systems/local.toml, measure/local_profile.py).

  hmoe calibrate [--out PATH] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hmoe_jax.measure.calibrate import calibrate
from hmoe_jax.measure.local_profile import write_profile


def add_calibrate_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write its simulator profile (local.toml)")
    p.add_argument(
        "--out",
        default=None,
        help="profile path (default: configs/systems/local.toml of the checkout in the current directory, else the package's)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON line")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hmoe_jax.runtime.placement import configure_stand_ins
    from hmoe_jax.sim.profile import load_profile, profiles_dir

    try:  # two stand-in devices (host + acc) for the hop measurement, before jax starts
        configure_stand_ins(1)
    except Exception:
        pass
    m = calibrate(quick=args.quick, devices=1)
    # inside a source checkout, its configs/ (what its experiments read, also when the
    # package is a plain `pip install .` whose own configs are a copy in site-packages)
    from hmoe_jax.cli.reproduce import find_root

    here = find_root() / "configs" / "systems"
    out = Path(args.out) if args.out else (here if here.is_dir() else profiles_dir()) / "local.toml"
    write_profile(out, m)
    load_profile(str(out))  # what was written must load
    print(f"[calibrate] wrote {out} in {m['calibrate_s']:.0f} s", flush=True)
    if args.json:
        print(json.dumps(m))
    return 0
