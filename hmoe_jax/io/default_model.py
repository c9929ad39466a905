"""Which checkpoint `hmoe generate` / `hmoe serve` use without --checkpoint.

The default is the trained model shipped inside the package (`hmoe_jax/assets/
deepseek_v3_stdlib/`: DeepSeek-V3 architecture, a few million parameters, trained on the
Python standard library by `python -m hmoe_jax.train`, block-FP8 as DeepSeek releases, with
its byte-level BPE tokenizer.json; docs/training.md). The synthetic random twin of
configs/models/deepseek_v3_tiny.json (hmoe_jax.io.synthetic) stays for tests that need its
exact shapes and for checkouts without the asset: `HMOE_DEFAULT_MODEL=synthetic` selects it.
"""

from __future__ import annotations

import os
from pathlib import Path

from hmoe_jax.io.errors import CheckpointError

TRAINED_MODEL = "deepseek_v3_stdlib"
ENV_VAR = "HMOE_DEFAULT_MODEL"  # "trained" (default) | "synthetic"
CHOICES = ("trained", "synthetic")


def assets_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "assets"


def trained_checkpoint() -> Path | None:
    """The shipped trained checkpoint, or None when this install has no asset."""
    d = assets_dir() / TRAINED_MODEL
    return d if (d / "config.json").exists() and (d / "model.safetensors").exists() else None


def default_checkpoint(progress: bool = True) -> tuple[Path, str]:
    """(checkpoint dir, model name for humans / JSON) of the default model."""
    from hmoe_jax.io.synthetic import DEFAULT_MODEL, DEFAULT_SEED, ensure_default_checkpoint

    choice = os.environ.get(ENV_VAR, "trained") or "trained"
    if choice not in CHOICES:
        raise CheckpointError(f"{ENV_VAR}={choice!r}: expected one of {list(CHOICES)}")
    trained = trained_checkpoint() if choice == "trained" else None
    if trained is not None:
        return trained, f"{TRAINED_MODEL} (trained, FP8)"
    return ensure_default_checkpoint(progress=progress), f"{DEFAULT_MODEL} (synthetic, seed {DEFAULT_SEED})"
