"""The `hmoe` command line: one module per command (generate, logits, convert, plan,
simulate, calibrate, reproduce, serve), cli/run.py (how a model is loaded for a command)
and cli/app.py (the parser and main()). `hmoe_jax.cli:main` is the `hmoe` console script
(pyproject.toml); `python -m hmoe_jax.cli` runs the same (cli/__main__.py). Command modules
import cli/run.py and lower layers, never cli/app.py (it imports them)."""

from hmoe_jax.cli.app import main

__all__ = ["main"]
