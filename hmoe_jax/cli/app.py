"""`hmoe` command line: the parser of every command and main().

Interfaces are stable (other tools call them):
  hmoe generate [--checkpoint DIR] (--prompt TEXT | --tokens 1,2,3) [--max-new-tokens N]
                [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--max-context N] [--json]
                [--schedule NAME --devices N --trace FILE --link-gbps X --acc-tflops-cap Y --system S]  (the engine)
                [--require-gpu]  (generate, logits, serve: fail unless JAX found a GPU; engine/gpu.py)
  hmoe logits   [--checkpoint DIR] --tokens 1,2,3 --out FILE.npy
  hmoe convert  --checkpoint IN --out OUT [--format fp8|bf16|f32|arena] [--shard-bytes N]
  hmoe plan     (--model NAME | --config FILE) --system PROFILE --schedule slp|dslp|cpu|auto --prompt-len T
                [--devices N] [--kv-rows N] [--max-len L] [--measure/--no-measure] [--json]  (exit 3: does not fit)
  hmoe simulate --model NAME --system PROFILE --schedule S --prompt-len T [--decode-tokens K] [--batch B]
                [--devices N] [--int4] [--json]  (the simulator, hmoe_jax/sim/; no weights, no jax)
  (--system PROFILE: configs/systems/PROFILE.toml or a path, the same files for every command;
   --devices N of its accelerators)
  hmoe calibrate [--out PATH] [--quick] [--json]  (measure this machine: configs/systems/local.toml)
  hmoe reproduce [--quick] [--only e03,e04] [--table-only]  (experiments, paper_figs/, claims table)
  hmoe serve    [--checkpoint DIR] [--host H] [--port P] [--policy NAME] ...  (OpenAI-compatible server)
  hmoe bench serve --url URL (--scenario NAME | --dataset FILE) ...        (load generator; cli/serve.py)
Without --checkpoint, the shipped trained default (deepseek_v3_stdlib, FP8, inside the
package; hmoe_jax.io.default_model) is used; HMOE_DEFAULT_MODEL=synthetic selects the
synthetic deepseek_v3_tiny twin (cached on first use). With --json the LAST stdout line is one JSON object.

One module per command in this package (cli/generate.py, cli/plan.py, ...); how a model is
loaded for a command is cli/run.py. Command modules never import this one (it imports them).
Bad input raises ConfigError / CheckpointError / InputError; main() prints their one-line
message to stderr and returns 1 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hmoe_jax.cli.calibrate import add_calibrate_parser
from hmoe_jax.cli.convert import add_convert_parser
from hmoe_jax.cli.generate import add_generate_parser, set_gpu_mem_fraction
from hmoe_jax.cli.logits import add_logits_parser
from hmoe_jax.cli.plan import add_plan_parser
from hmoe_jax.cli.reproduce import add_reproduce_parser
from hmoe_jax.cli.run import enable_compilation_cache
from hmoe_jax.cli.serve import add_serve_parsers
from hmoe_jax.cli.simulate import add_simulate_parser
from hmoe_jax.config import ConfigError
from hmoe_jax.io.errors import CheckpointError, InputError
from hmoe_jax.runtime.host_heap import retain_freed_host_memory


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hmoe", description="CPU-GPU hybrid MoE inference (DeepSeek-V3 / Kimi-K2) in JAX"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)  # hmoe generate: the engine (the embedded model: its reference schedule)
    add_logits_parser(sub)  # hmoe logits: teacher-forced logits
    add_convert_parser(sub)  # hmoe convert: checkpoint formats, the host weight arena
    add_plan_parser(sub)  # hmoe plan: memory and time budget of a plan, no weights
    add_serve_parsers(sub)  # hmoe serve (OpenAI-compatible server), hmoe bench serve (load generator)
    add_simulate_parser(sub)  # hmoe simulate: a request's times on a profile (sim/), no weights
    add_calibrate_parser(sub)  # hmoe calibrate: measure this machine, write configs/systems/local.toml
    add_reproduce_parser(sub)  # hmoe reproduce: every experiment, figures, claims table
    return ap


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
        retain_freed_host_memory()  # before jax's threads allocate (runtime/host_heap.py)
        enable_compilation_cache()
        set_gpu_mem_fraction(args)  # generate / serve: from the plan on the real card, before jax starts
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
