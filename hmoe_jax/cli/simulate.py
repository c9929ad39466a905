"""`hmoe simulate`: a request's TTFT, prefill and decode rates on a hardware profile, timed by
the simulator (hmoe_jax/sim/) over the plans the engine's schedules build; no weights, no jax.

  hmoe simulate --model deepseek_v3 --system paper_epyc9355_rtx5090 --schedule slp \\
      --prompt-len 32768 [--decode-tokens 128] [--batch 1] [--devices 1] [--int4] [--json]

--system names a profile in configs/systems/<NAME>.toml (`local` is written by `hmoe
calibrate`) or a path to one. The last stdout line (with --json: the only one) is one JSON
object: ttft_s, prefill_tok_per_s, decode_tok_per_s (per request), binding resources (the
resource that bound the critical path, and each one's share), and the profile's "assumed:"
inputs, so a projection names what it rests on.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hmoe_jax.config import named_model_config
from hmoe_jax.io.errors import InputError


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a request (TTFT, prefill / decode tok/s) on a hardware profile, no weights",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="configs/models/<NAME>.json, e.g. deepseek_v3")
    p.add_argument("--system", required=True, help="configs/systems/<NAME>.toml profile or a path")
    p.add_argument("--schedule", required=True, choices=["cpu", "slp", "dslp", "ep", "auto"])
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, default=0, help="decode steps after the prompt (0)")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (1)")
    p.add_argument(
        "--devices", dest="sim_devices", type=int, default=None, help="accelerators of the box to use"
    )
    p.add_argument("--int4", action="store_true", help="routed experts in our INT4 format (CPU decode)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_simulate)


def simulate_record(args: argparse.Namespace) -> dict[str, Any]:
    from hmoe_jax.sim.profile import load_profile
    from hmoe_jax.sim.run import simulate_request

    if args.prompt_len < 1 or args.batch < 1 or args.decode_tokens < 0:
        raise InputError(
            f"--prompt-len and --batch must be >= 1 and --decode-tokens >= 0, got "
            f"{args.prompt_len}, {args.batch}, {args.decode_tokens}"
        )
    cfg = named_model_config(args.model)
    prof = load_profile(args.system)
    if args.sim_devices is not None:
        prof = prof.with_accelerators(args.sim_devices)
    try:
        rec = simulate_request(
            cfg,
            prof,
            args.schedule,
            args.prompt_len,
            decode_tokens=args.decode_tokens,
            batch=args.batch,
            expert_format="int4" if args.int4 else "fp8",
        )
    except ValueError as e:  # schedule arithmetic (ScheduleError) and profile gaps name their numbers
        raise InputError(str(e)) from None
    rec["model"] = args.model
    rec["assumed_inputs"] = sorted(prof.assumptions())
    return rec


def cmd_simulate(args: argparse.Namespace) -> int:
    rec = simulate_record(args)
    if not args.json:
        pre = rec["prefill"]["binding_share"]
        print(
            f"{rec['model']} on {rec['profile']} ({rec['accelerators']} accelerator(s)), {rec['schedule']}, "
            f"{rec['prompt_len']} prompt tokens"
        )
        print(f"  TTFT {rec['ttft_s']:.3f} s, prefill {rec['prefill_tok_per_s']:.1f} tok/s, bound by {pre}")
        if not rec["fits"]:
            print(f"  does not fit: {rec['memory_message']}")
        if rec.get("decode"):
            print(
                f"  decode {rec['decode_tok_per_s']:.2f} tok/s per request (batch {rec['batch']}, "
                f"{rec['decode_agg_tok_per_s']:.2f} aggregate), bound by {rec['decode']['binding_share']}"
            )
        if rec["assumed_inputs"]:
            print(f"  assumed inputs: {', '.join(rec['assumed_inputs'])}")
    slim = {k: v for k, v in rec.items() if k not in ("prefill", "decode")}
    slim["binding_share"] = {"prefill": rec["prefill"]["binding_share"]}
    if rec.get("decode"):
        slim["binding_share"]["decode"] = rec["decode"]["binding_share"]
    print(json.dumps(slim))
    return 0
