"""`hmoe` command line: generate, logits, convert.

Interfaces are stable (other tools call them):
  hmoe generate [--checkpoint DIR] (--prompt TEXT | --tokens 1,2,3) [--max-new-tokens N]
                [--temperature T] [--top-p P] [--seed S] [--ignore-eos] [--max-context N] [--json]
                [--schedule NAME --devices N --trace FILE --link-gbps X --acc-tflops-cap Y --system S]  (hybrid engine)
  hmoe logits   [--checkpoint DIR] --tokens 1,2,3 --out FILE.npy
  hmoe convert  --checkpoint IN --out OUT [--format fp8|bf16|f32|arena] [--shard-bytes N]
  hmoe plan     (--model NAME | --config FILE) --system S --schedule slp|dslp|cpu|auto --prompt-len T
                [--kv-rows N] [--max-len L] [--measure/--no-measure] [--json]  (exit 3: does not fit)
  hmoe simulate --model NAME --system PROFILE --schedule S --prompt-len T [--decode-tokens K] [--batch B]
                [--devices N] [--int4] [--json]  (the simulator, hmoe_jax/sim/; no weights, no jax)
  hmoe calibrate [--out PATH] [--quick] [--json]  (measure this machine: configs/systems/local.toml)
  hmoe reproduce [--quick] [--only e03,e04] [--table-only]  (experiments, paper_figs/, claims table)
  hmoe serve    [--checkpoint DIR] [--host H] [--port P] [--policy NAME] ...  (OpenAI-compatible server)
  hmoe bench serve --url URL (--scenario NAME | --dataset FILE) ...        (load generator; cli_serve.py)
Without --checkpoint, the shipped trained default (deepseek_v3_stdlib, FP8, inside the
package; hmoe_jax.io.default_model) is used; HMOE_DEFAULT_MODEL=synthetic selects the
synthetic deepseek_v3_tiny twin (cached on first use). With --json the LAST stdout line is one JSON object.

Options that change how a model runs (expert path, schedule, devices, ...) are added in
`add_run_args` and turned into the `Run` in `build_run`; commands only consume a `Run`.
Bad input raises ConfigError / CheckpointError / InputError; main() prints their one-line
message to stderr and returns 1 (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hmoe_jax.config import ConfigError, ModelConfig
from hmoe_jax.io.errors import CheckpointError, InputError

DEFAULT_MAX_NEW_TOKENS = 32


@dataclasses.dataclass
class Run:
    """Everything a command needs to execute a model, built once from parsed args."""

    cfg: ModelConfig
    host_params: Any  # ModelParams as loaded: the one host copy (memmaps, aligned expert stacks)
    tokenizer: Any  # hmoe_jax.io.tokenizer.Tokenizer
    model: str  # human/JSON name of the model
    checkpoint: Path
    expert_fn: Any  # hmoe_jax.model.moe.ExpertFn
    max_context: int
    _device_params: Any = None

    @property
    def params(self) -> Any:
        """host_params on the default device, for the plain model path; placed on first use
        only, so the engine path (which does its own placement from the host copy) never
        pays for a whole-model transfer to the default device."""
        if self._device_params is None:
            import jax

            self._device_params = jax.device_put(self.host_params)
        return self._device_params


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="HF-format checkpoint dir (default: the shipped trained tiny model)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit in tokens (default: max_position_embeddings)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars or notes on stderr")


def build_run(args: argparse.Namespace) -> Run:
    """Load the model and resolve run options. New run flags plug in here."""

    from hmoe_jax.io.default_model import default_checkpoint
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.tokenizer import load_tokenizer
    from hmoe_jax.model.moe import experts_ref

    progress = not args.quiet
    if args.checkpoint is None:
        ckpt, model = default_checkpoint(progress=progress)
    else:
        ckpt = args.checkpoint
        model = ckpt.name
    cfg, params = load_checkpoint(ckpt, progress=progress)
    max_context = cfg.max_position_embeddings
    if args.max_context is not None:
        if not 1 <= args.max_context <= cfg.max_position_embeddings:
            raise InputError(
                f"--max-context {args.max_context} must be in [1, max_position_embeddings={cfg.max_position_embeddings}]"
            )
        max_context = args.max_context
    return Run(
        cfg=cfg,
        host_params=params,
        tokenizer=load_tokenizer(ckpt, cfg.vocab_size),
        model=model,
        checkpoint=ckpt,
        expert_fn=experts_ref,
        max_context=max_context,
    )


def parse_tokens(text: str, flag: str = "--tokens") -> list[int]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts:
        raise InputError(f"{flag}: expected comma-separated token ids like 1,2,3, got {text!r}")
    try:
        return [int(s) for s in parts]
    except ValueError:
        bad = next(s for s in parts if not s.lstrip("-").isdigit())
        raise InputError(f"{flag}: {bad!r} is not an integer token id") from None


def check_ids(ids: Sequence[int], vocab_size: int, flag: str) -> None:
    for i in ids:
        if not 0 <= i < vocab_size:
            raise InputError(f"{flag}: token id {i} out of range [0, vocab_size={vocab_size})")


def check_context(n_prompt: int, n_new: int, run: Run, source: str) -> None:
    limit = (
        "--max-context" if run.max_context != run.cfg.max_position_embeddings else "max_position_embeddings"
    )
    if n_new == 0 and n_prompt > run.max_context:
        raise InputError(
            f"{source}: {n_prompt} tokens exceed the context of {run.max_context} tokens ({limit})"
        )
    if n_prompt + n_new > run.max_context:
        raise InputError(
            f"{source}: prompt of {n_prompt} tokens + {n_new} new tokens = {n_prompt + n_new} "
            f"exceeds the context of {run.max_context} tokens ({limit})"
        )


def prompt_ids(args: argparse.Namespace, run: Run) -> list[int]:
    if args.tokens is not None:
        ids = parse_tokens(args.tokens)
        check_ids(ids, run.cfg.vocab_size, "--tokens")
        return ids
    ids = run.tokenizer.encode(args.prompt)
    check_ids(ids, run.cfg.vocab_size, f"--prompt (encoded by {run.tokenizer.name})")
    if not ids:
        raise InputError("--prompt: encodes to no tokens")
    return ids


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


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from hmoe_jax.model.generate import teacher_forced_logits

    ids = parse_tokens(args.tokens)
    if not args.out.parent.is_dir():  # before the forward pass, not after it
        raise InputError(f"--out: directory {args.out.parent} does not exist")
    run = build_run(args)
    check_ids(ids, run.cfg.vocab_size, "--tokens")
    check_context(len(ids), 0, run, "--tokens")
    logits = np.asarray(teacher_forced_logits(run.params, run.cfg, ids, run.expert_fn), np.float32)  # [T, V]
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} logits ({run.model})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from hmoe_jax.io.writer import convert_checkpoint

    if args.shard_bytes is not None and args.shard_bytes <= 0:
        raise InputError(f"--shard-bytes must be > 0, got {args.shard_bytes}")
    if args.format == "arena":  # the shared host weight arena (hmoe_jax.io.arena); no shards
        from hmoe_jax.io.arena import write_arena

        write_arena(args.checkpoint, args.out, progress=not args.quiet)
    else:
        convert_checkpoint(
            args.checkpoint, args.out, fmt=args.format, shard_bytes=args.shard_bytes, progress=not args.quiet
        )
    print(f"wrote {args.out} ({args.format})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hmoe_jax.io.writer import DEFAULT_CONVERT_SHARD_BYTES, FORMATS

    ap = argparse.ArgumentParser(
        prog="hmoe", description="CPU-GPU hybrid MoE inference (DeepSeek-V3 / Kimi-K2) in JAX"
    )
    sub = ap.add_subparsers(dest="command", required=True)

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

    lg = sub.add_parser("logits", help="teacher-forced logits of every position")
    add_run_args(lg)
    lg.add_argument("--tokens", required=True, help="token ids, comma-separated")
    lg.add_argument("--out", type=Path, required=True, help="output .npy, float32 [T, vocab]")
    lg.set_defaults(func=cmd_logits)

    cv = sub.add_parser("convert", help="convert a checkpoint (e.g. bf16/f32 -> DeepSeek FP8)")
    cv.add_argument("--checkpoint", type=Path, required=True, help="input checkpoint dir")
    cv.add_argument("--out", type=Path, required=True, help="output checkpoint dir")
    cv.add_argument("--format", choices=[*sorted(FORMATS), "arena"], default="fp8")
    cv.add_argument(
        "--shard-bytes", type=int, default=DEFAULT_CONVERT_SHARD_BYTES, help="max bytes per shard"
    )
    cv.add_argument("--quiet", action="store_true")
    cv.set_defaults(func=cmd_convert)

    from hmoe_jax.cli_plan import add_plan_parser

    add_plan_parser(sub)  # hmoe plan: memory and time budget of a plan, no weights
    from hmoe_jax.cli_serve import add_serve_parsers

    add_serve_parsers(sub)  # hmoe serve (OpenAI-compatible server), hmoe bench serve (load generator)
    from hmoe_jax.cli_calibrate import add_calibrate_parser
    from hmoe_jax.cli_reproduce import add_reproduce_parser
    from hmoe_jax.cli_sim import add_simulate_parser

    add_simulate_parser(sub)  # hmoe simulate: a request's times on a profile (sim/), no weights
    add_calibrate_parser(sub)  # hmoe calibrate: measure this machine, write configs/systems/local.toml
    add_reproduce_parser(sub)  # hmoe reproduce: every experiment, figures, claims table
    return ap


def enable_compilation_cache() -> None:
    """Persist XLA executables under the hmoe cache (HMOE_XLA_CACHE=0 disables), so a
    second `hmoe generate` skips the tens of seconds of compilation the first one pays."""
    if os.environ.get("HMOE_XLA_CACHE", "1") == "0":
        return
    import jax

    from hmoe_jax.io.synthetic import cache_root

    jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. argv None means a real command line: then the persistent compilation
    cache is enabled (in-process callers such as tests keep their own jax settings)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", None) is not None:
        if args.devices < 1:
            print(f"hmoe: error: --devices must be >= 1, got {args.devices}", file=sys.stderr)
            return 1
        from hmoe_jax.runtime.placement import PlacementError, configure_stand_ins

        try:  # before jax initialises its backend: host + N stand-in CPU devices
            configure_stand_ins(args.devices)
        except PlacementError as e:
            print(f"hmoe: error: {e}", file=sys.stderr)
            return 1
    if argv is None and getattr(args, "needs_jax", True):  # `hmoe bench` is an HTTP client: no jax
        enable_compilation_cache()
        set_gpu_mem_fraction(args)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, InputError) as e:
        print(f"hmoe: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unwritable --out, permission errors: the message names the path
        print(f"hmoe: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
