"""`hmoe generate`: text or token ids from a prompt, on the hybrid engine (Engine.generate,
the one generate loop; model/sampling.py, the one sampler). --schedule picks the prefill
schedule; without it a --checkpoint runs `auto` and the embedded tiny model `reference`
(the plain model forward as one op), so one --seed draws one token stream on every path.

  hmoe generate [--checkpoint DIR] (--prompt TEXT | --tokens 1,2,3) [--max-new-tokens N]
                [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--max-context N]
                [--generation-config auto|none|DIR]
                [--schedule NAME --precision P --devices N --trace FILE --link-gbps X --acc-tflops-cap Y
                 --system S] [--no-warmup] [--json]

With --json the LAST stdout line is one JSON object. set_gpu_mem_fraction sizes JAX's GPU
allocator from the plan's memory budget on the real card before the backend starts (cli/app.py
calls it); --require-gpu (cli/run.py) refuses a silent CPU fallback.
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

from hmoe_jax.cli.run import (
    DEFAULT_MAX_NEW_TOKENS,
    Run,
    add_generation_config_arg,
    add_run_args,
    build_run,
    check_context,
    prompt_ids,
)
from hmoe_jax.io.errors import InputError


def _median_s(decode_s: list[float]) -> float:
    return float(statistics.median(decode_s)) if decode_s else float("nan")


def _generate_record(run: Run, ids: list[int], res: Any, text: str, warmup_s: float) -> dict[str, Any]:
    """The run-independent fields of a `generate --json` line (tpot_s: median seconds per
    token after the first)."""
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


def default_schedule(args: argparse.Namespace) -> str:
    """--schedule, else `auto` for a --checkpoint (a real-scale model needs the hybrid
    placement) and `reference` for the embedded tiny model (the plain model forward)."""
    return args.schedule or ("auto" if getattr(args, "checkpoint", None) else "reference")


def sampling_params(
    args: argparse.Namespace,
    defaults: Any = None,
    n_prompt: int | None = None,
    max_context: int | None = None,
) -> Any:
    """The request's SamplingParams (InputError if bad). A flag that is given wins; else the
    checkpoint's generation_config.json default (`defaults`, io/generation_config.py); else
    the builtin default (greedy, top_p 1, top_k off, DEFAULT_MAX_NEW_TOKENS; the file's
    repetition_penalty / min_p / presence / frequency penalties have no flag). A
    max_new_tokens from generation_config.json is cut to the room the context leaves after
    the prompt (vLLM's rule), as an explicit --max-new-tokens is not: that one errors."""
    from hmoe_jax.io.generation_config import NO_DEFAULTS
    from hmoe_jax.model.sampling import SamplingParams

    d = defaults or NO_DEFAULTS

    def pick(flag: Any, default: Any, builtin: Any) -> Any:
        return flag if flag is not None else (default if default is not None else builtin)

    max_new = args.max_new_tokens
    if max_new is None and d.max_new_tokens is not None:
        room = max_context - n_prompt if n_prompt is not None and max_context is not None else None
        max_new = d.max_new_tokens if room is None else max(1, min(d.max_new_tokens, room))
    sampling = SamplingParams(
        temperature=float(pick(args.temperature, d.temperature, 0.0)),
        top_p=float(pick(args.top_p, d.top_p, 1.0)),
        top_k=int(pick(args.top_k, d.top_k, 0)),
        seed=int(args.seed),
        max_new_tokens=int(max_new if max_new is not None else DEFAULT_MAX_NEW_TOKENS),
        stop_ids=() if args.ignore_eos else None,
        # no flags for these: the file's value, else the builtin (off)
        repetition_penalty=float(pick(None, d.repetition_penalty, 1.0)),
        min_p=float(pick(None, d.min_p, 0.0)),
        presence_penalty=float(pick(None, d.presence_penalty, 0.0)),
        frequency_penalty=float(pick(None, d.frequency_penalty, 0.0)),
    )
    try:
        return sampling.validate()
    except ValueError as e:
        raise InputError(str(e)) from None


# ---- engine flags (hmoe_jax.engine.engine) ----------------------------------------


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from hmoe_jax.schedules.registry import schedule_names

    p.add_argument(
        "--schedule",
        choices=sorted(set(schedule_names()) | {"dslp"}),
        default=None,
        help="the engine's prefill schedule (decode: routed experts on the CPU); default: auto with "
        "--checkpoint, reference (the plain model forward) for the embedded model",
    )
    p.add_argument(
        "--precision",
        choices=["bf16", "f32"],
        default="bf16",
        help="engine accelerator precision: bf16 activations/cache with f32 accumulation (default), or f32",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="keep the k most likely tokens when sampling (0 = off; default: generation_config.json's, else 0)",
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
    p.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="host memcpy threads of the slp staging ring (default: ceil(link rate / this host's measured "
        "one-thread memcpy rate), at most the cores available and 8)",
    )
    p.add_argument(
        "--system",
        default=None,
        help="configs/systems/<NAME>.toml profile or a path: the auto policy's thresholds and the plans' "
        "rates, with --devices of its accelerators (default: the paper box, one RTX 5090)",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.plan.system import SystemSpec, load_system
    from hmoe_jax.plan.trace import TraceRecorder
    from hmoe_jax.runtime.placement import PlacementError
    from hmoe_jax.schedules.base import ScheduleError
    from hmoe_jax.schedules.registry import SCHEDULES

    # Flag errors before the model loads.
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    temperature = 0.0 if args.temperature is None else args.temperature
    top_p = 1.0 if args.top_p is None else args.top_p
    if temperature < 0 or not 0 < top_p <= 1:
        raise InputError(f"need --temperature >= 0 and 0 < --top-p <= 1, got {temperature} and {top_p}")
    sampling_params(args)  # the flags alone (no generation_config.json yet): InputError if bad
    schedule = default_schedule(args)
    if schedule not in SCHEDULES:
        raise InputError(
            f"--schedule {schedule}: not registered in this build (registered: {sorted(SCHEDULES)})"
        )
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise InputError(f"--link-gbps must be > 0, got {args.link_gbps}")
    if args.acc_tflops_cap is not None and args.acc_tflops_cap <= 0:
        raise InputError(f"--acc-tflops-cap must be > 0, got {args.acc_tflops_cap}")
    if args.copy_threads is not None and args.copy_threads < 1:
        raise InputError(f"--copy-threads must be >= 1, got {args.copy_threads}")
    if args.trace is not None and not args.trace.resolve().parent.is_dir():
        raise InputError(f"--trace: directory {args.trace.parent} does not exist")
    run = build_run(args)
    ids = prompt_ids(args, run)
    source = "--tokens" if args.tokens is not None else f"--prompt (encoded by {run.tokenizer.name})"
    sampling = sampling_params(args, run.generation, len(ids), run.max_context)
    check_context(len(ids), sampling.max_new_tokens, run, source)
    devices = args.devices or 1
    system = load_system(args.system, devices) if args.system else SystemSpec(num_accelerators=devices)
    try:
        eng = Engine(
            run.host_params,
            run.cfg,
            devices=devices,
            system=system,
            link_gbps=args.link_gbps,
            acc_tflops_cap=args.acc_tflops_cap,
            copy_threads=args.copy_threads,
            precision=args.precision,
            max_batch=1,
            max_len=len(ids) + sampling.max_new_tokens,
            require_gpu=args.require_gpu,
        )
        warmup_s = 0.0 if args.no_warmup else _warmup(eng, ids, schedule, sampling)
        trace = TraceRecorder() if args.trace is not None else None
        res = eng.generate(
            ids,
            sampling.max_new_tokens,
            schedule=schedule,
            stop_ids=sampling.stop_ids,
            trace=trace,
            sampling=sampling,
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
    rate = f", {1.0 / tpot_s:.1f} tokens/s" if math.isfinite(tpot_s) and tpot_s > 0 else ""
    print(
        f"[{run.model}] schedule {res.schedule} ({schedule}) on {eng.placement.describe()}; prompt {len(ids)} "
        f"tokens, generated {len(res.tokens)}; TTFT {res.ttft_s * 1e3:.1f} ms, decode {tpot_s * 1e3:.2f} "
        f"ms/token (median){rate}"
        + (f"; warmup/compile {warmup_s:.2f} s" if warmup_s else "")
        + (f"; trace {args.trace}" if args.trace else "")
    )
    if args.json:
        record = {
            **_generate_record(run, ids, res, text, warmup_s),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "precision": args.precision,
            "seed": sampling.seed,
            "schedule": res.schedule,
            "schedule_requested": schedule,
            "devices": devices,
            "system": system.name,
            "link_gbps": args.link_gbps,
            "acc_tflops_cap": args.acc_tflops_cap,
            "prefill_s": res.prefill_s,
            "streamed_bytes": res.streamed_bytes,
            "trace": str(args.trace) if args.trace else None,
        }
        print(json.dumps(record))
    return 0


def _warmup(eng: Any, ids: list[int], schedule: str, sampling: Any) -> float:
    """Compile what the timed run executes (this schedule's prefill of this prompt, the
    decode step on the same pool shapes, the sampler for these parameters) with a 2-token
    run, so TTFT and decode times measure execution, not XLA compilation. It draws from a
    fresh request (token n's key is fold_in(key(seed), n)), so the timed stream is the
    same with or without it. Returns seconds."""
    import dataclasses

    t0 = time.perf_counter()
    short = dataclasses.replace(sampling, max_new_tokens=min(2, sampling.max_new_tokens), stop_ids=())
    eng.generate(ids, short.max_new_tokens, schedule=schedule, stop_ids=(), sampling=short)
    return time.perf_counter() - t0


def add_generate_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text or token ids")
    add_run_args(g)
    add_generation_config_arg(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer.json or bytes)")
    src.add_argument("--tokens", help="prompt token ids, comma-separated")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default: generation_config.json's max_new_tokens (cut to the context), else {DEFAULT_MAX_NEW_TOKENS}",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default, unless generation_config.json sets one)",
    )
    g.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos_token_id")
    g.add_argument("--no-warmup", action="store_true", help="include XLA compilation in TTFT/decode times")
    g.add_argument("--json", action="store_true", help="end stdout with one JSON line")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def set_gpu_mem_fraction(args: argparse.Namespace) -> float | None:
    """`hmoe generate` / `hmoe serve` on the engine: XLA_PYTHON_CLIENT_MEM_FRACTION from the
    plan's memory budget on this machine's real GPU (engine/gpu.py: nvidia-smi, no jax; the
    plan estimated, no weights), so JAX's GPU allocator may take what the plan needs (JAX's
    default 0.75 of a 32 GB card is less than an slp prefill's peak). --system gives the
    rest of the machine; a warning says when its card's memory disagrees with the real one.
    JAX reads the variable once, when its GPU backend starts, which is after this (cli/app.py
    calls it first); a value the user set wins; no GPU: nothing set. generate plans its
    prompt; serve an `auto` plan of a --max-model-len prompt (default 4096), per --pd worker.
    Returns the fraction set, or None."""
    command = getattr(args, "command", None)
    ckpt = getattr(args, "checkpoint", None)
    if command not in ("generate", "serve") or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ or not ckpt:
        return None  # not the engine, the user's setting, or the embedded tiny model
    if command == "generate":
        schedule = default_schedule(args)
        # prompt tokens: exact for --tokens; the UTF-8 byte count bounds a byte-level BPE's
        tokens = len(args.tokens.split(",")) if args.tokens else len(args.prompt.encode()) + 2
        devices = args.devices or 1
    else:
        schedule, tokens = "auto", args.max_model_len or 4096
        devices = max(1, (args.devices or 2) // 2) if getattr(args, "pd", False) else (args.devices or 1)
    if schedule in ("reference", "none"):  # the plain forward: no plan
        return None
    try:
        from hmoe_jax.config import load_config
        from hmoe_jax.engine.gpu import set_gpu_mem_fraction as set_fraction
        from hmoe_jax.plan.system import load_system

        cfg = load_config(Path(ckpt) / "config.json")
        system = load_system(args.system, devices) if args.system else None
        return set_fraction(cfg, schedule, min(tokens, cfg.max_position_embeddings), devices, system)
    except Exception:  # a bad config, system or schedule errors later, with its own message
        return None
