"""`hmoe simulate`: a request's TTFT, prefill and decode rates on a hardware profile, timed by
the simulator (hmoe_jax/sim/) over the plans the engine's schedules build; no weights, no jax.

  hmoe simulate --model deepseek_v3 --system paper_epyc9355_rtx5090 --schedule slp \\
      --prompt-len 32768 [--decode-tokens 128] [--batch 1] [--devices 1] [--int4] [--json]
      [--set link.h2d_gbps=112 ...] [--sweep accelerator.compute_efficiency=0.5,0.7,0.85]
      [--ring-slots N] [--gemm-dtype fp32|bf16|fp8] [--decode-mode fused|separate|...] [--bands]

--system names a profile in configs/systems/<NAME>.toml (`local` is written by `hmoe
calibrate`) or a path to one. The last stdout line (with --json: the only one) is one JSON
object (with --sweep: a JSON list, one object per value): ttft_s, prefill_tok_per_s,
decode_tok_per_s (per request), binding resources (the resource that bound the critical
path, and each one's share), the profile's "assumed:" inputs and absent optional keys with
the default each took (assumed_inputs), and for a decode the CPU kernel efficiency it
carries (decode_kernel), so a projection names what it rests on.

What-ifs (every one is listed under "whatif" in the record and printed as WHAT-IF):
--set section.key=VALUE (repeatable) overrides a profile value (its source becomes
"what-if: --set"); --sweep section.key=a,b,c runs one projection per value; --ring-slots N
sizes the slp plan's staging ring (the schedule's ring_slots override); --gemm-dtype prices
every accelerator GEMM flop at that dtype (the plan's compute_dtype part and its fp8_flops
part alike; measured attention-piece rates are kept); --decode-mode picks the decode plan's
form and executor (sim/run.DECODE_MODES). --bands adds each metric's [low, high] band over
the profile's assumed and carried-over inputs (sim/bands.py states the method).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hmoe_jax.config import ConfigError, named_model_config
from hmoe_jax.io.errors import InputError

DECODE_MODE_HELP = (
    "decode plan and executor: fused (default: attention + gating one attn_route op, worker-thread "
    "executor), separate (attn and route as two ops), fused-serial / separate-serial (every op one "
    "at a time); a non-default mode is a what-if"
)


def add_simulate_parser(sub: Any) -> None:
    from hmoe_jax.sim.run import DECODE_MODES, GEMM_DTYPES

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
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="what-if: override one profile value (repeatable)",
    )
    p.add_argument(
        "--sweep", default=None, metavar="SECTION.KEY=A,B,C", help="what-if: one projection per value"
    )
    p.add_argument("--ring-slots", type=int, default=None, help="what-if: the slp plan's ring size")
    p.add_argument(
        "--gemm-dtype",
        choices=list(GEMM_DTYPES),
        default=None,
        help="what-if: price every GEMM at this dtype",
    )
    p.add_argument("--decode-mode", choices=list(DECODE_MODES), default=None, help=DECODE_MODE_HELP)
    p.add_argument("--bands", action="store_true", help="[low, high] bands over the assumed inputs")
    p.set_defaults(func=cmd_simulate)


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
    """'section.key=value' -> (dotted key, value text), the key checked against the schema."""
    from hmoe_jax.plan.profile import split_key

    key, eq, value = text.partition("=")
    if not eq or not value.strip():
        raise InputError(f"{flag} {text!r}: expected SECTION.KEY=VALUE, e.g. link.h2d_gbps=112")
    try:
        split_key(key.strip())
    except ConfigError as e:
        raise InputError(f"{flag} {text!r}: {e}") from None
    return key.strip(), value.strip()


def _whatif(args: argparse.Namespace, base: Any, prof: Any, sets: dict[str, str]) -> dict[str, Any]:
    """The record's "whatif" block: every override and flag, with what it replaced."""
    out: dict[str, Any] = {}
    if sets:
        out["set"] = [
            {
                "key": k,
                "value": prof[k],
                "was": base.get(*k.split(".")),
                "was_src": base.src[k.split(".")[0]].get(k.split(".")[1], "absent: simulator default"),
                "src": prof.src[k.split(".")[0]][k.split(".")[1]],
            }
            for k in sets
        ]
    if args.ring_slots is not None:
        out["ring_slots"] = args.ring_slots
    if args.gemm_dtype is not None:
        out["gemm_dtype"] = {
            "dtype": args.gemm_dtype,
            "note": "every accelerator GEMM flop priced at this dtype: the plan's compute_dtype part and its "
            "fp8_flops part (the FP8 GEMMs it runs) alike; prefill attention pieces priced at a measured "
            "attn_<form>_tflops keep that rate; the plan (ops, ring) is the one the engine builds",
        }
    if args.decode_mode not in (None, "fused"):
        out["decode_mode"] = args.decode_mode
    return out


def simulate_record(args: argparse.Namespace, extra_set: tuple[str, str] | None = None) -> dict[str, Any]:
    from hmoe_jax.plan.profile import WHATIF_SRC, load_profile
    from hmoe_jax.sim.headlines import decode_kernel
    from hmoe_jax.sim.run import request_plans, simulate_request

    if args.prompt_len < 1 or args.batch < 1 or args.decode_tokens < 0:
        raise InputError(
            f"--prompt-len and --batch must be >= 1 and --decode-tokens >= 0, got "
            f"{args.prompt_len}, {args.batch}, {args.decode_tokens}"
        )
    if args.ring_slots is not None and (args.ring_slots < 1 or args.schedule not in ("slp", "auto")):
        raise InputError(
            f"--ring-slots {args.ring_slots}: the slp schedule's staging ring size, >= 1 "
            f"(--schedule {args.schedule} has no slp ring)"
        )
    if args.decode_mode is not None and not args.decode_tokens:
        raise InputError(f"--decode-mode {args.decode_mode}: the decode steps' plan, give --decode-tokens N")
    cfg = named_model_config(args.model)
    base = load_profile(args.system)
    if args.sim_devices is not None:
        base = base.with_accelerators(args.sim_devices)
    sets = dict(parse_assignment(a, "--set") for a in args.overrides)
    if extra_set is not None:
        sets[extra_set[0]] = extra_set[1]
    try:
        prof = base.with_values(sets, why=WHATIF_SRC)
    except ConfigError as e:
        raise InputError(f"--set: {e}") from None
    kw = {
        "decode_tokens": args.decode_tokens,
        "batch": args.batch,
        "prefill_options": {"ring_slots": args.ring_slots} if args.ring_slots is not None else None,
        "decode_mode": args.decode_mode or "fused",
        "gemm_dtype": args.gemm_dtype,
    }
    fmt = "int4" if args.int4 else "fp8"
    try:
        rec = simulate_request(cfg, prof, args.schedule, args.prompt_len, expert_format=fmt, **kw)
    except ValueError as e:  # schedule arithmetic (ScheduleError) and profile gaps name their numbers
        if args.ring_slots is not None and "unknown option" in str(e):
            raise InputError(
                f"--ring-slots: the slp schedule's ring, but auto chose another schedule ({e})"
            ) from None
        raise InputError(str(e)) from None
    rec["model"] = args.model
    rec["assumed_inputs"] = dict(sorted(prof.assumptions().items()))
    if args.decode_tokens:
        rec["decode_kernel"] = decode_kernel(prof, fmt, args.batch)
        rec["decode_mode"] = args.decode_mode or "fused"
    whatif = _whatif(args, base, prof, sets)
    if whatif:
        rec["whatif"] = whatif
    if args.bands:
        from hmoe_jax.sim.bands import band

        metrics = ["ttft_s", "prefill_tok_per_s"] + (["decode_tok_per_s"] if args.decode_tokens else [])
        rec["bands"] = band(
            lambda p: simulate_request(cfg, p, args.schedule, args.prompt_len, expert_format=fmt, **kw),
            prof,
            metrics,
            plans=lambda p: [d["plan"] for d in request_plans(cfg, p, args.schedule, args.prompt_len, **kw)],
            cfg=cfg,
            expert_format=fmt,
        )
    return rec


def _slim(rec: dict[str, Any]) -> dict[str, Any]:
    slim = {k: v for k, v in rec.items() if k not in ("prefill", "decode")}
    slim["binding_share"] = {"prefill": rec["prefill"]["binding_share"]}
    if rec.get("decode"):
        slim["binding_share"]["decode"] = rec["decode"]["binding_share"]
    return slim


def _print_text(rec: dict[str, Any]) -> None:
    pre = rec["prefill"]["binding_share"]
    print(
        f"{rec['model']} on {rec['profile']} ({rec['accelerators']} accelerator(s)), {rec['schedule']}, "
        f"{rec['prompt_len']} prompt tokens"
    )
    for k, v in rec.get("whatif", {}).items():
        shown = (
            ", ".join(
                f"{s['key']}={s['value']} (was {'absent' if s['was'] is None else s['was']})" for s in v
            )
            if k == "set"
            else v
        )
        print(f"  WHAT-IF {k}: {shown if not isinstance(shown, dict) else shown['dtype']}")
    print(f"  TTFT {rec['ttft_s']:.3f} s, prefill {rec['prefill_tok_per_s']:.1f} tok/s, bound by {pre}")
    if not rec["fits"]:
        print(f"  fits: false ({rec['memory_message']})")
    if rec.get("decode"):
        print(
            f"  decode {rec['decode_tok_per_s']:.2f} tok/s per request (batch {rec['batch']}, "
            f"{rec['decode_agg_tok_per_s']:.2f} aggregate), bound by {rec['decode']['binding_share']}"
        )
        dk = rec["decode_kernel"]
        print(f"  decode carries {dk['key']} = {dk['value']}: {dk.get('src', dk['why'])}")
    for m, b in rec.get("bands", {}).items():
        top = ", ".join(
            f"{r['key']} {r['at_low']:.4g}..{r['at_high']:.4g}" for r in b["inputs"][:3] if r["swing"]
        )
        print(
            f"  band {m}: {b['central']:.4g} [{b['low']:.4g}, {b['high']:.4g}]; moved most by (the "
            f"projection at the input's low..high end) {top or 'nothing'}"
        )
    if rec["assumed_inputs"]:
        print(f"  assumed inputs: {', '.join(rec['assumed_inputs'])}")


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.sweep is None:
        rec = simulate_record(args)
        if not args.json:
            _print_text(rec)
        print(json.dumps(_slim(rec)))
        return 0
    key, values = parse_assignment(args.sweep, "--sweep")
    if key in {parse_assignment(a, "--set")[0] for a in args.overrides}:
        raise InputError(f"--sweep {key}: also given with --set; sweep it or set it, not both")
    recs = [simulate_record(args, (key, v.strip())) for v in values.split(",") if v.strip()]
    if not args.json:
        print(
            f"WHAT-IF sweep of {key} ({recs[0]['profile']}, {recs[0]['schedule']}, {args.prompt_len} tokens)"
        )
        print(f"  {key:>36} | TTFT s   | prefill tok/s | decode tok/s | bound | fits")
        for r in recs:
            dec = f"{r['decode_tok_per_s']:12.2f}" if r.get("decode") else f"{'-':>12}"
            print(
                f"  {r['whatif']['set'][-1]['value']!s:>36} | {r['ttft_s']:8.3f} | {r['prefill_tok_per_s']:13.1f} | "
                f"{dec} | {r['binding']['prefill']} | {str(r['fits']).lower()}"
            )
    print(json.dumps([_slim(r) for r in recs]))
    return 0
