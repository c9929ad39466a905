"""How a model is loaded for a command: the `Run` every model-running command (generate,
logits, serve) consumes, the flags that build it and the prompt/token checks they share.

Options that change how a model runs (expert path, schedule, devices, ...) are added in
`add_run_args` and turned into the `Run` in `build_run`; commands only consume a `Run`.
Bad input raises InputError (io/errors.py): cli/app.py prints its one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.errors import InputError
from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults

# hmoe generate's default --max-new-tokens; hmoe plan sizes its default KV row with it
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
    generation: GenerationDefaults = NO_DEFAULTS  # generation_config.json sampling defaults
    _device_params: Any = None

    @property
    def params(self) -> Any:
        """host_params on the default device, for the plain model forward (`hmoe logits`);
        placed on first use only, so the engine (which does its own placement from the host
        copy) never pays for a whole-model transfer to the default device."""
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
    p.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="config.json keys overridden before the model is built (vLLM's flag), e.g. "
        "'{\"num_experts_per_tok\": 2}'; unknown keys, ignored keys and keys that change weight "
        "shapes are errors",
    )
    p.add_argument(
        "--experts-format",
        choices=("stored", "int4"),
        default="stored",
        help="routed experts as stored (default) or converted at load to INT4 group 64 "
        "(hmoe_jax/quant/int4.py) from this checkpoint's own experts: bf16 as stored, FP8 "
        "dequantized first (so INT4 of an FP8 checkpoint carries both roundings)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars or notes on stderr")
    p.add_argument(
        "--require-gpu",
        action="store_true",
        help="fail unless JAX found a GPU (a broken CUDA install falls back to CPU with only a warning)",
    )


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    """--generation-config for the commands that sample (generate, serve)."""
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|none|DIR",
        help="default sampling parameters from generation_config.json: auto (default) the checkpoint's "
        "if present, DIR a folder holding one, none the builtin defaults; explicit flags / request "
        "fields win",
    )


def build_run(args: argparse.Namespace) -> Run:
    """Load the model and resolve run options. New run flags plug in here. JAX's platforms
    are checked first (engine/gpu.py: the hybrid engine needs the cpu backend; --require-gpu
    refuses a CPU fallback), before the weights load."""
    from hmoe_jax.engine.gpu import check_gpu, check_platforms

    check_platforms()
    if getattr(args, "require_gpu", False):
        check_gpu(required=True)
    from hmoe_jax.io.default_model import default_checkpoint
    from hmoe_jax.io.generation_config import load_generation_config
    from hmoe_jax.io.load_options import apply_hf_overrides, describe, parse_hf_overrides, with_experts_format
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.tokenizer import load_tokenizer
    from hmoe_jax.model.moe import experts_ref

    progress = not args.quiet
    overrides_text = getattr(args, "hf_overrides", None)
    overrides = parse_hf_overrides(overrides_text) if overrides_text is not None else {}
    experts_format = getattr(args, "experts_format", "stored")
    if args.checkpoint is None:
        ckpt, model = default_checkpoint(progress=progress)
    else:
        ckpt = args.checkpoint
        model = ckpt.name
    # before the weights: a malformed generation_config.json fails fast
    generation = load_generation_config(ckpt, getattr(args, "generation_config", None))
    if generation.source is not None and not args.quiet:
        print(f"hmoe: {generation.describe()}", file=sys.stderr)
    stored_cfg, params = load_checkpoint(ckpt, progress=progress)
    cfg = apply_hf_overrides(stored_cfg, ckpt, overrides)
    params = with_experts_format(params, cfg, experts_format)
    note = describe(stored_cfg, cfg, experts_format)
    if note and not args.quiet:
        print(note, file=sys.stderr)
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
        generation=generation,
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


def enable_compilation_cache() -> None:
    """Persist XLA executables under the hmoe cache (HMOE_XLA_CACHE=0 disables), so a
    second `hmoe generate` skips the tens of seconds of compilation the first one pays."""
    if os.environ.get("HMOE_XLA_CACHE", "1") == "0":
        return
    import jax

    from hmoe_jax.io.synthetic import cache_root

    jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
