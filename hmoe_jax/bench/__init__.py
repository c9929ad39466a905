"""`hmoe bench serve`: a load generator for OpenAI-compatible servers (ours, vLLM, SGLang),
with vLLM's `bench serve` metric definitions and JSON key names. An HTTP client only: it
imports no jax and nothing of the engine (import-linter contract in pyproject.toml)."""


class BenchError(ValueError):
    """Bad bench input or a server that does not answer: one line naming the cause (the CLI
    prints it and exits 1)."""
