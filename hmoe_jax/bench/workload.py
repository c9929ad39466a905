"""What `hmoe bench serve` sends: scenarios (the paper's request mixes) or a dataset file,
and when: open-loop Poisson / gamma arrivals (vLLM's --request-rate / --burstiness) or all
at once under --max-concurrency (closed loop).

Scenarios (prompt token ids drawn from a seeded generator, outputs of fixed length with
ignore_eos):
  long_prefill  one long prompt alone: the TTFT of a long prefill
  1p1d          one decode stream; once its first token is back, a long prefill arrives
  1p2d          two decode streams, then a long prefill
  decode_n      --num-prompts concurrent decode streams (short prompts)
  join          --num-prompts decode streams; once each has streamed a token, one more prompt
                of --long-prompt-len tokens arrives (one output token: its TTFT while N decode)
  random        --num-prompts requests of --prompt-len / --output-len (+- --range-ratio)
Dataset: JSON Lines (or one JSON list), each {"prompt": text or [ids], "output_len": N}.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

TOKEN_LOW, TOKEN_HIGH = 10, 250  # prompt ids: inside every vocabulary (bytes for byte-level)


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    after_first_token_of: tuple[int, ...] = ()  # start once these requests streamed a token


@dataclasses.dataclass
class ScenarioSizes:
    num_prompts: int = 8
    prompt_len: int = 32
    output_len: int = 32
    long_prompt_len: int = 1024
    range_ratio: float = 0.0


SCENARIOS = ("long_prefill", "1p1d", "1p2d", "decode_n", "join", "random")


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(TOKEN_LOW, TOKEN_HIGH, int(n))]


def scenario(name: str, sizes: ScenarioSizes, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    s = sizes
    if name not in SCENARIOS:
        raise ValueError(f"--scenario {name!r}: known: {', '.join(SCENARIOS)}")

    def req(n_prompt: int, n_out: int, after: tuple[int, ...] = ()) -> BenchRequest:
        return BenchRequest(_ids(rng, n_prompt), int(n_prompt), int(n_out), after)

    if name == "long_prefill":
        return [req(s.long_prompt_len, 1)]
    if name in ("1p1d", "1p2d"):
        n_dec = 1 if name == "1p1d" else 2
        decodes = [req(s.prompt_len, s.output_len) for _ in range(n_dec)]
        return [*decodes, req(s.long_prompt_len, 1, tuple(range(n_dec)))]
    if name == "decode_n":
        return [req(s.prompt_len, s.output_len) for _ in range(s.num_prompts)]
    if name == "join":
        decodes = [req(s.prompt_len, s.output_len) for _ in range(s.num_prompts)]
        return [*decodes, req(s.long_prompt_len, 1, tuple(range(s.num_prompts)))]
    lo = lambda v: max(1, int(v * (1 - s.range_ratio)))
    hi = lambda v: max(lo(v), int(v * (1 + s.range_ratio)))
    return [
        req(
            rng.integers(lo(s.prompt_len), hi(s.prompt_len) + 1),
            rng.integers(lo(s.output_len), hi(s.output_len) + 1),
        )
        for _ in range(s.num_prompts)
    ]


def load_dataset(path: str | Path, num_prompts: int | None = None) -> list[BenchRequest]:
    text = Path(path).read_text()
    try:
        rows = json.loads(text)
        if not isinstance(rows, list):
            rows = [rows]
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "prompt" not in r or "output_len" not in r:
            raise ValueError(f"{path}: row {i} needs 'prompt' (text or token ids) and 'output_len'")
        p = r["prompt"]
        plen = int(r.get("prompt_len", len(p) if isinstance(p, list) else len(p.split())))
        out.append(BenchRequest(p, plen, int(r["output_len"])))
    return out[:num_prompts] if num_prompts else out


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int = 0) -> list[float]:
    """Seconds before each request (vLLM: gamma with shape = burstiness and mean 1 / rate;
    burstiness 1 is Poisson). rate inf: all at once."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]
