"""Error types for bad input. Each message is one line that names the file, tensor or
option and says what was expected and what was found; the CLI prints it and exits
non-zero without a traceback (hmoe_jax.cli.app.main catches these and ConfigError)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory or safetensors file we cannot load faithfully."""


class InputError(ValueError):
    """Bad user input: token ids out of range, prompt longer than the context, bad flags."""
