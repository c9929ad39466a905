"""The GPU part of `hmoe calibrate` (a few minutes on one GPU): measure the accelerator and its
link and write a simulator profile for the box over a CPU-side profile of the same host
(hmoe_jax/measure/gpu_profile.py says what is measured and how). tools/gpu_check.py runs the
same measurements as part of its check and writes the profile too.

    hmoe calibrate --out /tmp/host.toml                                   # on the GPU host, ~2 min
    python tools/gpu_calibrate.py --base /tmp/host.toml --out configs/systems/gpu_here.toml
    python tools/gpu_calibrate.py --base local --smoke --allow-cpu        # tiny sizes on the CPU stand-in

--base is required (a GPU profile's CPU side must be the same host's). Without a GPU the run
is refused unless --allow-cpu. One JSON line with every measurement ends stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--base", default=None, help="the host's CPU-side profile (hmoe calibrate --out): required"
    )
    ap.add_argument("--out", default=None, help="profile to write (default: print the measurements only)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a check of the script)")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU stand-in when JAX has no GPU")
    args = ap.parse_args(argv)

    from hmoe_jax.measure import gpu_profile

    try:
        base = gpu_profile.check_base(args.base)
    except gpu_profile.BaseProfileMissing as e:
        raise SystemExit(f"gpu_calibrate: {e}") from None
    from hmoe_jax.engine.gpu import PlatformError, check_gpu, check_platforms

    check_platforms()
    try:
        check_gpu(required=not args.allow_cpu)
    except PlatformError as e:
        raise SystemExit(f"gpu_calibrate: {e}; --allow-cpu runs this on the CPU stand-in") from None
    m = gpu_profile.measure(smoke=args.smoke, allow_cpu=args.allow_cpu)
    if args.out:
        gpu_profile.write_profile(base, Path(args.out), m)
        m["profile"] = args.out
    print(json.dumps(m))
    return m


if __name__ == "__main__":
    main()
