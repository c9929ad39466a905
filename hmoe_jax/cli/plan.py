"""`hmoe plan`: a plan's accelerator memory and time budget for a model config, a system and
a prompt length, without weights (plan/memory.py; the time by the simulator, sim/run.py).

  hmoe plan --model deepseek_v3 --system paper_epyc9355_rtx5090 --devices 1 --schedule slp \
      --prompt-len 32768 --json

--system names a hardware profile, configs/systems/<NAME>.toml (the files `hmoe simulate`
and `hmoe generate --system` read) or a path to one; --devices picks that many of its
accelerators (default: all it has).

With --measure (the default) the accelerator pieces the schedule runs are compiled (not
run) at the real shapes with ShapeDtypeStruct operands on this machine's JAX backend
(measure/compile_probe.py) and their memory_analysis() temporaries replace the estimates;
on a machine without a GPU that is XLA:CPU, which fuses differently from XLA:GPU and
upcasts bf16 dot operands to f32 (so its temporaries are an upper bound there). dslp's
per-rank pieces (shard_map over N devices) are compiled over N stand-in CPU devices under
the GPU policy's dtypes (compile_probe.probe_dslp_pieces; estimated only when fewer than N
devices exist, e.g. one GPU). Exit status 0 when the plan fits, 3 when it does not (1: bad
input).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hmoe_jax.cli.run import DEFAULT_MAX_NEW_TOKENS
from hmoe_jax.config import ConfigError, ModelConfig, load_config, named_model_config
from hmoe_jax.io.errors import InputError

EXIT_DOES_NOT_FIT = 3
KEY_BLOCK = 512  # model/attention.py's default key block


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="print a plan's accelerator memory and time budget (no weights needed)",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when the plan fits the accelerator memory, 3 when it does not, 1 on bad input.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="configs/models/<NAME>.json, e.g. deepseek_v3")
    src.add_argument("--config", help="a config.json (or a checkpoint directory holding one)")
    p.add_argument("--system", required=True, help="configs/systems/<NAME>.toml profile or a path")
    p.add_argument("--schedule", choices=["slp", "dslp", "cpu", "auto"], required=True)
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens (one sequence)")
    p.add_argument("--kv-rows", type=int, default=1, help="KV pool rows (sequences) on the accelerator (1)")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help=f"tokens per KV pool row (default: prompt + {DEFAULT_MAX_NEW_TOKENS} new tokens, rounded up to the "
        f"{KEY_BLOCK}-token attention key block, at most max_position_embeddings)",
    )
    p.add_argument(
        "--devices",
        dest="plan_devices",
        type=int,
        default=None,
        metavar="N",
        help="accelerators of the box to use (default: all the profile has)",
    )
    p.add_argument(
        "--measure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the pieces (not run) and use their measured temporaries (default: on)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_plan)


def _model(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    if args.model is not None:
        return named_model_config(args.model), args.model
    return load_config(args.config), str(args.config)


def default_max_len(cfg: ModelConfig, prompt_len: int) -> int:
    want = -(-(prompt_len + DEFAULT_MAX_NEW_TOKENS) // KEY_BLOCK) * KEY_BLOCK
    return max(prompt_len, min(want, cfg.max_position_embeddings))


def _measured(
    cfg: ModelConfig, system: Any, name: str, tokens: int, max_len: int, ranks: int
) -> tuple[dict, dict]:
    """(piece_temps for the schedule, pieces record) from compiling the pieces."""
    import jax

    from hmoe_jax.measure import compile_probe as C

    if name == "dslp":
        try:  # stand-in CPU devices for the mesh; only possible before jax's backend starts
            jax.config.update("jax_num_cpu_devices", max(ranks, 1))
        except RuntimeError:
            pass
        if len(jax.devices()) < ranks:  # e.g. one GPU: the per-rank pieces stay estimated
            return {}, {}
        probes = C.probe_dslp_pieces(cfg, tokens, ranks)
        return C.piece_temps(probes), {k: p.as_dict() for k, p in probes.items()}
    n = tokens if name == "slp" else min(tokens, system.cpu_prefill_chunk_tokens)
    probes = C.probe_slp_pieces(cfg, n, max_len=max_len, experts_per_slot=system.slp_experts_per_slot)
    if name == "cpu":
        probes = {k: v for k, v in probes.items() if k != "experts_group"}
    return C.piece_temps(probes), {k: p.as_dict() for k, p in probes.items()}


def plan_record(args: argparse.Namespace) -> dict[str, Any]:
    from hmoe_jax.plan import costs
    from hmoe_jax.plan.memory import gpu_mem_fraction
    from hmoe_jax.plan.profile import load_profile
    from hmoe_jax.plan.system import SystemSpec
    from hmoe_jax.schedules.base import ScheduleError
    from hmoe_jax.schedules.registry import get_schedule
    from hmoe_jax.sim.run import time_plan

    cfg, model = _model(args)
    prof = load_profile(args.system)
    if args.plan_devices is not None:
        prof = prof.with_accelerators(args.plan_devices)
    system = SystemSpec.from_profile(prof)
    t = int(args.prompt_len)
    if t < 1 or args.kv_rows < 1:
        raise InputError(f"--prompt-len and --kv-rows must be >= 1, got {t} and {args.kv_rows}")
    max_len = default_max_len(cfg, t) if args.max_len is None else int(args.max_len)
    if max_len < t:
        raise InputError(f"--max-len {max_len} must be >= --prompt-len {t}")
    devices = system.num_accelerators
    name = args.schedule
    if name == "auto":
        name = get_schedule("auto").choose(system, t, devices)
    opts: dict[str, Any] = {"kv_rows": args.kv_rows, "max_len": max_len}
    n = get_schedule(name).uses_devices(devices)
    temps, pieces = _measured(cfg, system, name, t, max_len, n) if args.measure else ({}, {})
    sched = get_schedule(name, piece_temps=temps or None, **opts)
    try:
        budget = sched.budget(cfg, system, t, devices=n)
    except ScheduleError as e:
        raise InputError(str(e)) from None
    rec: dict[str, Any] = {
        "model": model,
        "system": system.name,
        "schedule_requested": args.schedule,
        "prompt_len": t,
        "devices": n,
        **budget.as_dict(),  # schedule, fits, acc_peak_bytes, resident/ring/cache/temp_bytes, ...
    }
    in_context = max_len <= cfg.max_position_embeddings
    rec["in_context"] = in_context
    if not in_context:
        rec["fits"] = False
        rec["message"] = (
            f"{name}: a {max_len}-token row exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}; memory: {budget.message}"
        )
    rec.update(
        est_prefill_s=None, binding_share=None, bound=None, est_layer_copy_s=None, est_layer_compute_s=None
    )
    if budget.fits:
        plan = sched.plan(cfg, system, t, devices=n)
        timed = time_plan(plan, cfg, prof)  # the simulator: the one timing model
        rec["est_prefill_s"] = round(timed.total_s, 4)
        rec["binding_share"] = timed.summary()["binding_share"]
        rec["compute_dtype"] = plan.meta.get("compute_dtype")
        for k in ("bound", "est_layer_copy_s", "est_layer_compute_s"):
            rec[k] = plan.meta.get(k)
    rec["gpu_mem_fraction"] = gpu_mem_fraction(budget, system)
    rec["pieces"] = pieces
    if pieces:
        import jax

        rec["measure_backend"] = jax.default_backend()
    rec["attn_flops_per_layer"] = costs.attn_flops(cfg, t, cache_len=max_len)
    return rec


def _table(rec: dict[str, Any]) -> str:
    g = lambda b: f"{b / 2**30:8.2f} GiB"
    kind = "measured" if rec["temp_measured"] else "estimated"
    rows = [
        f"{rec['model']} on {rec['system']}, {rec['schedule']} ({rec['schedule_requested']}), "
        f"{rec['prompt_len']} tokens, {rec['devices']} accelerator(s)",
        f"  resident weights {g(rec['resident_bytes'])}",
        f"  ring             {g(rec['ring_bytes'])}  ({rec['ring_slots']} slots)",
        f"  KV cache         {g(rec['cache_bytes'])}  ({rec['kv_rows']} x {rec['max_len']} tokens)",
        f"  temporaries      {g(rec['temp_bytes'])}  ({rec['temp_stage']}, {kind})",
        f"  peak             {g(rec['acc_peak_bytes'])}  of {g(rec['usable_bytes'])} usable",
        f"  fits             {rec['fits']}",
    ]
    if rec["est_prefill_s"] is not None:
        rows.append(f"  est. prefill     {rec['est_prefill_s']:8.2f} s    ({rec['bound']})")
    rows.append(f"  {rec['message']}")
    return "\n".join(rows)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        rec = plan_record(args)
    except ValueError as e:  # schedule / config arithmetic errors name their numbers
        if isinstance(e, (ConfigError, InputError)):
            raise
        raise InputError(str(e)) from None
    print(json.dumps(rec) if args.json else _table(rec))
    return 0 if rec["fits"] else EXIT_DOES_NOT_FIT
