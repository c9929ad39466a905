"""`hmoe generate`: text or token ids from a prompt, on the plain one-device model path or
on the hybrid engine (--schedule NAME; a --checkpoint runs `auto` by default).

  hmoe generate [--checkpoint DIR] (--prompt TEXT | --tokens 1,2,3) [--max-new-tokens N]
                [--temperature T] [--top-p P] [--seed S] [--ignore-eos] [--max-context N] [--json]
                [--schedule NAME --devices N --trace FILE --link-gbps X --acc-tflops-cap Y --system S]

With --json the LAST stdout line is one JSON object. set_gpu_mem_fraction sizes JAX's GPU
allocator from the plan's memory budget before the backend starts (cli/app.py calls it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from hmoe_jax.cli.run import Run, add_run_args, build_run, check_context, prompt_ids
from hmoe_jax.io.errors import InputError

DEFAULT_MAX_NEW_TOKENS = 32


def _warmup(run: Run, ids: list[int], max_new_tokens: int, temperature: float, top_p: float) -> float:
    """Compile what generate() will run (prefill, decode step, sampling, key splits) so
    that TTFT and decode times measure execution, not XLA compilation. Returns seconds."""
    import numpy as np

    from hmoe_jax.model.generate import generate
    from hmoe_jax.model.model import forward, init_cache
    from hmoe_jax.plan.buckets import cache_len

    t0 = time.perf_counter()
    n_warm = min(2, max_new_tokens)
    generate(
        run.params,
        run.cfg,
        ids,
        n_warm,
        expert_fn=run.expert_fn,
        temperature=temperature,
        top_p=top_p,
        stop_ids=(),
    )

    if cache_len(len(ids) + max_new_tokens) != cache_len(len(ids) + n_warm):
        # The real run uses a longer cache: its prefill and decode are other shapes.
        cache = init_cache(run.cfg, 1, cache_len(len(ids) + max_new_tokens))
        _, cache = forward(run.params, run.cfg, np.asarray([ids], np.int32), cache, 0, run.expert_fn)
        logits, _ = forward(
            run.params, run.cfg, np.asarray([ids[-1:]], np.int32), cache, len(ids), run.expert_fn
        )
        logits.block_until_ready()
    return time.perf_counter() - t0


def _median_s(decode_s: list[float]) -> float:
    return float(statistics.median(decode_s)) if decode_s else float("nan")


def _generate_record(run: Run, ids: list[int], res: Any, text: str, warmup_s: float) -> dict[str, Any]:
    """The fields every `generate --json` line has, whichever path produced `res`
    (tpot_s: median seconds per token after the first, on both paths)."""
    tpot_s = _median_s(res.decode_s)
    return {
        "model": run.model,
        "checkpoint": str(run.checkpoint),
        "tokenizer": run.tokenizer.name,
        "prompt_tokens": len(ids),
        "prompt_ids": ids,
        "tokens": res.tokens,
        "text": text,
        "ttft_s": res.ttft_s,
        "tpot_s": tpot_s if math.isfinite(tpot_s) else None,
        "decode_s": res.decode_s,
        "warmup_s": warmup_s,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from hmoe_jax.model.generate import generate

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise InputError(
            f"need --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature} and {args.top_p}"
        )
    run = build_run(args)
    ids = prompt_ids(args, run)
    source = "--tokens" if args.tokens is not None else f"--prompt (encoded by {run.tokenizer.name})"
    check_context(len(ids), args.max_new_tokens, run, source)
    temperature, top_p = float(args.temperature), float(args.top_p)
    # A real checkpoint runs the hybrid engine (auto) unless told otherwise: the plain
    # one-device model.generate cannot hold a real-scale model. The embedded tiny default
    # keeps the plain path unless --schedule is given.
    schedule = args.schedule or ("auto" if getattr(args, "checkpoint", None) else "none")
    if schedule != "none":
        args.schedule = schedule
        return cmd_generate_engine(args, run, ids)
    if args.top_k:
        raise InputError(
            "--top-k needs the hybrid engine (--schedule NAME); the plain path has temperature/top-p"
        )
    warmup_s = 0.0 if args.no_warmup else _warmup(run, ids, args.max_new_tokens, temperature, top_p)
    res = generate(
        run.params,
        run.cfg,
        ids,
        args.max_new_tokens,
        expert_fn=run.expert_fn,
        temperature=temperature,
        top_p=top_p,
        seed=args.seed,
        stop_ids=() if args.ignore_eos else None,
    )
    text = run.tokenizer.decode(res.tokens)
    tpot_s = res.tpot_s
    print(text)
    rate = f", {1.0 / tpot_s:.1f} tokens/s" if math.isfinite(tpot_s) and tpot_s > 0 else ""
    print(
        f"[{run.model}] prompt {len(ids)} tokens, generated {len(res.tokens)}; "
        f"TTFT {res.ttft_s * 1e3:.1f} ms, decode {tpot_s * 1e3:.2f} ms/token (median){rate}"
        + (f"; warmup/compile {warmup_s:.2f} s" if warmup_s else "")
    )
    if args.json:
        record = {
            **_generate_record(run, ids, res, text, warmup_s),
            "temperature": temperature,
            "top_p": top_p,
            "seed": args.seed,
            "schedule": "none",  # plain model.generate; --schedule runs the hybrid engine
        }
        print(json.dumps(record))
    return 0


# ---- hybrid engine flags (hmoe_jax.engine.engine; owner: engine) ----------------------


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from hmoe_jax.schedules.registry import schedule_names

    p.add_argument(
        "--schedule",
        choices=sorted(set(schedule_names()) | {"dslp", "none"}),
        default=None,
        help="run the hybrid engine with this prefill schedule (decode: routed experts on the CPU); "
        "default: auto with --checkpoint, none (plain one-device model.generate) for the embedded model",
    )
    p.add_argument(
        "--precision",
        choices=["bf16", "f32"],
        default="bf16",
        help="engine accelerator precision: bf16 activations/cache with f32 accumulation (default), or f32",
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0 = off)"
    )
    p.add_argument(
        "--devices", type=int, default=None, help="accelerators (stand-in CPU devices without a GPU)"
    )
    p.add_argument(
        "--trace", type=Path, default=None, help="write a Chrome trace-event JSON (Perfetto) of the run"
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="cap host->accelerator copies at this rate (emulation; not for performance claims)",
    )
    p.add_argument(
        "--acc-tflops-cap",
        type=float,
        default=None,
        help="cap the stand-in accelerator's compute rate (emulation, with --link-gbps)",
    )
    p.add_argument("--system", default=None, help="configs/systems/<name>.json or a path (SLP/auto policy)")


def cmd_generate_engine(args: argparse.Namespace, run: Run, ids: list[int]) -> int:
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.model.sampling import SamplingParams
    from hmoe_jax.plan.system import SystemSpec, load_system
    from hmoe_jax.plan.trace import TraceRecorder
    from hmoe_jax.schedules.registry import SCHEDULES

    sampling = SamplingParams(
        temperature=float(args.temperature),
        top_p=float(args.top_p),
        top_k=int(args.top_k),
        seed=int(args.seed),
    )
    try:
        sampling.validate()
    except ValueError as e:
        raise InputError(str(e)) from None
    if args.schedule not in SCHEDULES:
        raise InputError(
            f"--schedule {args.schedule}: not registered in this build (registered: {sorted(SCHEDULES)})"
        )
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise InputError(f"--link-gbps must be > 0, got {args.link_gbps}")
    if args.acc_tflops_cap is not None and args.acc_tflops_cap <= 0:
        raise InputError(f"--acc-tflops-cap must be > 0, got {args.acc_tflops_cap}")
    if args.trace is not None and not args.trace.resolve().parent.is_dir():
        raise InputError(f"--trace: directory {args.trace.parent} does not exist")
    devices = args.devices or 1
    system = load_system(args.system) if args.system else SystemSpec(num_accelerators=devices)
    from hmoe_jax.runtime.placement import PlacementError
    from hmoe_jax.schedules.base import ScheduleError

    try:
        eng = Engine(
            run.host_params,
            run.cfg,
            devices=devices,
            system=system,
            link_gbps=args.link_gbps,
            acc_tflops_cap=args.acc_tflops_cap,
            precision=args.precision,
            max_batch=1,
            max_len=len(ids) + args.max_new_tokens,
        )
        stops = () if args.ignore_eos else None
        t0 = time.perf_counter()
        if not args.no_warmup:  # compile prefill + decode pieces of this schedule and length
            eng.generate(ids, min(2, args.max_new_tokens), schedule=args.schedule, stop_ids=())
        warmup_s = time.perf_counter() - t0 if not args.no_warmup else 0.0
        trace = TraceRecorder() if args.trace is not None else None
        res = eng.generate(
            ids, args.max_new_tokens, schedule=args.schedule, stop_ids=stops, trace=trace, sampling=sampling
        )
    except (PlacementError, ScheduleError) as e:
        raise InputError(str(e)) from None
    if trace is not None:
        trace.meta.update(model=run.model, schedule=res.schedule, link_gbps=args.link_gbps, devices=devices)
        trace.write(args.trace)
    eng.close()
    text = run.tokenizer.decode(res.tokens)
    tpot_s = _median_s(res.decode_s)
    print(text)
    print(
        f"[{run.model}] schedule {res.schedule} ({args.schedule}) on {eng.placement.describe()}; prompt {len(ids)} "
        f"tokens, generated {len(res.tokens)}; TTFT {res.ttft_s * 1e3:.1f} ms, decode {tpot_s * 1e3:.2f} ms/token"
        + (f"; trace {args.trace}" if args.trace else "")
    )
    if args.json:
        record = {
            **_generate_record(run, ids, res, text, warmup_s),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "precision": args.precision,
            "seed": args.seed,
            "schedule": res.schedule,
            "schedule_requested": args.schedule,
            "devices": devices,
            "link_gbps": args.link_gbps,
            "acc_tflops_cap": args.acc_tflops_cap,
            "prefill_s": res.prefill_s,
            "streamed_bytes": res.streamed_bytes,
            "trace": str(args.trace) if args.trace else None,
        }
        print(json.dumps(record))
    return 0


def add_generate_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text or token ids")
    add_run_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer.json or bytes)")
    src.add_argument("--tokens", help="prompt token ids, comma-separated")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos_token_id")
    g.add_argument("--no-warmup", action="store_true", help="include XLA compilation in TTFT/decode times")
    g.add_argument("--json", action="store_true", help="end stdout with one JSON line")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def set_gpu_mem_fraction(args: argparse.Namespace) -> float | None:
    """`hmoe generate` on the engine: XLA_PYTHON_CLIENT_MEM_FRACTION from its plan's memory
    budget (plan/memory.py, estimated: no weights, no jax), so JAX's GPU allocator may take
    what the plan needs (JAX's default 0.75 of a 32 GB card is less than an slp prefill's
    peak). JAX reads it once, when its GPU backend starts, which is after this; a value the
    user set wins; CPU-only runs ignore it. Returns the fraction set, or None."""
    if getattr(args, "command", None) != "generate" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return None
    ckpt = getattr(args, "checkpoint", None)
    schedule = args.schedule or ("auto" if ckpt else "none")
    if schedule in ("none", "reference") or not ckpt:
        return None
    try:
        from hmoe_jax.config import load_config
        from hmoe_jax.plan.memory import gpu_mem_fraction
        from hmoe_jax.plan.system import SystemSpec, load_system
        from hmoe_jax.schedules.registry import get_schedule

        cfg = load_config(Path(ckpt) / "config.json")
        devices = args.devices or 1
        system = load_system(args.system) if args.system else SystemSpec(num_accelerators=devices)
        # prompt tokens: exact for --tokens; the UTF-8 byte count bounds a byte-level BPE's
        tokens = len(args.tokens.split(",")) if args.tokens else len(args.prompt.encode()) + 2
        sched = get_schedule(schedule)
        if schedule == "auto":
            sched = get_schedule(sched.choose(system, tokens, devices))
        budget = sched.budget(cfg, system, tokens, devices=sched.uses_devices(devices))
    except Exception:  # a bad config or system errors later, with its own message
        return None
    if budget is None or not budget.fits:
        return None  # the engine's plan refuses it with the numbers
    frac = gpu_mem_fraction(budget, system)
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{frac:.2f}"
    return frac
