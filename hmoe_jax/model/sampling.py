"""Per-request sampling for a batch of rows: greedy, temperature, top-k, top-p, seed.

Each row has its own parameters. A row's random key is fold_in(key(seed), step), where
step counts the tokens that request has sampled, so a request draws the same tokens
whatever else is in its batch and whenever it was admitted. temperature == 0 is greedy:
the argmax of the f32 logits, bit-stable. Filtering order (as vLLM and HF apply it):
temperature, then top-k (keep the k largest; 0 = off), then top-p (keep the smallest set
of the remaining tokens, in descending order, whose probability reaches top_p; the top
token always stays), then min-p (drop tokens below min_p x the top token's probability), then one categorical
draw.

Logit processors (process_rows; vLLM's order, before temperature, greedy rows included):
min_tokens (a row's stop ids at -inf while it has fewer than min_tokens output tokens),
logit_bias (added), repetition_penalty (HF's, over prompt and output tokens: positive
logits divided, negative multiplied), frequency / presence penalties (OpenAI's, over output
tokens only: logit - frequency x count - presence x [count > 0]). A row's history goes to
the device as padded id lists (O(B x tokens) host work, not O(B x V)) and is scattered into
[B, V] counts there. Neutral parameters leave a row's logits bit-identical, so a batch that
mixes processed and plain rows samples the plain rows exactly as without them; a batch with
no processed row takes the unchanged path (greedy: argmax of the raw f32 logits).

Structured output (model/structured.py): a row's RowHistory may carry an allowed-token
bitmask (int32 words, bit t % 32 of word t // 32). It is applied first, before the logit
processors, greedy rows included: a disallowed token's logit becomes -inf. Rows without one
get an all-ones mask in a masked batch (their logits unchanged, bit for bit); a batch with no
masked row takes the paths above unchanged.

Log-probabilities (token_logprobs) are the log-softmax of the raw f32 logits, before any
processor or filter (vLLM's default): the chosen token's and the top k, ties lower id first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # top alternatives per position (vLLM's default max_logprobs; OpenAI allows 20)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the model's log-softmax of its raw f32 logits, before
    any sampling transform (penalties, logit_bias, temperature, top-k / top-p / min-p), which
    is what vLLM reports by default. `top`: the k most likely tokens, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 16
    stop_ids: tuple[int, ...] | None = None  # None: the model's eos ids
    # Logit processors, applied before temperature in this order (vLLM's): min_tokens (stop
    # ids masked until that many tokens exist), logit_bias (added), repetition_penalty (HF's:
    # over prompt and output tokens, positive logits divided, negative multiplied),
    # frequency / presence penalties (OpenAI's: over output tokens only). min_p filters after
    # top-p: tokens below min_p x the top probability are dropped. All apply to greedy too.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_p: float = 0.0
    min_tokens: int = 0
    # Report log-probabilities (TokenLogprob): None = not at all; k = the chosen token's and
    # the k most likely. prompt_logprobs: the same for every prompt token after the first.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: (kind, spec) with kind "json_object" (spec "") or "json_schema"
    # (spec: the schema as JSON text); the engine masks every step to the grammar
    # (model/structured.py)
    structured: tuple[str, str] | None = None

    @property
    def processed(self) -> bool:
        """True when some logit processor changes the logits (the plain greedy path is off)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_p
            or self.min_tokens
        )

    def validate(self) -> SamplingParams:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"sampling: temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling: top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"sampling: seed must be in [0, 2^32), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"sampling: {name} must be in [-2, 2], got {v}")
        if not (self.repetition_penalty > 0 and np.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"sampling: repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"sampling: logit_bias {tok}: {bias} needs a token id >= 0 and a bias in [-100, 100]"
                )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling: min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling: min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"sampling: {name} must be in [0, {MAX_LOGPROBS}], got {v}")
        if self.structured is not None:
            from hmoe_jax.model.structured import schema_of

            if not (isinstance(self.structured, tuple) and len(self.structured) == 2):
                raise ValueError(f"sampling: structured must be (kind, spec), got {self.structured!r}")
            schema_of(*self.structured)
        return self


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming a logit_bias token id outside the model's vocabulary."""
    for tok, _ in params.logit_bias:
        if tok >= vocab_size:
            raise ValueError(f"logit_bias: token id {tok} is not below the vocabulary size {vocab_size}")


def _filter_row(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    min_p: jax.Array | float = 0.0,
) -> jax.Array:
    """[V] f32 -> [V] f32 logits with filtered tokens at -inf (temperature applied)."""
    v = logits.shape[-1]
    z = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-z)  # descending; ties keep the lower id first (stable)
    zs = z[order]
    rank = jnp.arange(v)
    keep = rank < jnp.where(top_k > 0, top_k, v)
    zs = jnp.where(keep, zs, -jnp.inf)
    probs = jax.nn.softmax(zs)
    # rank 0 (the argmax) is kept explicitly: a top_p below f32's smallest normal (~1.2e-38)
    # flushes to 0 on the device, `0 < 0` would drop every token and the draw from all -inf
    # would return token 0 whatever the logits.
    keep = keep & (((jnp.cumsum(probs) - probs) < top_p) | (rank == 0))
    # min-p is relative to the top token, so the renormalisation after top-p cannot change it
    keep = keep & ((probs >= min_p * probs[0]) | (rank == 0))
    return jnp.full((v,), -jnp.inf, jnp.float32).at[order].set(jnp.where(keep, zs, -jnp.inf))


@jax.jit
def sample_rows(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
    step: jax.Array,
    min_p: jax.Array | None = None,
) -> jax.Array:
    """logits [B, V] f32; per row temperature, top_p, min_p [B] f32, top_k, step [B] int32,
    seed [B] uint32 -> token ids [B] int32."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if min_p is None:
        min_p = jnp.zeros_like(temperature)

    def draw(lg, t, p, k, s, n, m):
        key = jax.random.fold_in(jax.random.key(s), n)
        return jax.random.categorical(key, _filter_row(lg, t, p, k, m)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_p, top_k, seed, step, min_p)
    return jnp.where(temperature > 0, drawn, greedy)


class RowHistory(NamedTuple):
    """What the logit processors read of one row: its prompt ids, the ids it has generated
    so far and its stop ids (masked while fewer than min_tokens were generated)."""

    prompt: Sequence[int]
    output: Sequence[int]
    stops: Collection[int]
    # structured output: the tokens allowed next as an int32 bitmask [ceil(V / 32)] (bit
    # t % 32 of word t // 32); None = every token
    allowed: np.ndarray | None = None


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Id lists -> [B, W] int32, -1 padded; W a power of two (few compiled shapes)."""
    width = max(1, max((len(r) for r in rows), default=1))
    width = max(8, 1 << (width - 1).bit_length())
    out = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = np.asarray(r, np.int32)
    return out


def _scatter_rows(ids: jax.Array, vals: jax.Array | float, v: int) -> jax.Array:
    """ids [B, W] (-1 = padding), vals [B, W] or a scalar -> per-row sums [B, V] f32."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    cols = jnp.where(ids >= 0, ids, v)  # padding lands out of range and is dropped
    vals = jnp.broadcast_to(jnp.asarray(vals, jnp.float32), ids.shape)
    return jnp.zeros((ids.shape[0], v), jnp.float32).at[rows, cols].add(vals, mode="drop")


@jax.jit
def mask_rows(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [B, V], bitmask [B, ceil(V / 32)] int32 -> [B, V] f32 with the tokens whose bit
    is clear at -inf (the rest unchanged)."""
    v = logits.shape[-1]
    ids = jnp.arange(v)
    bits = (bitmask[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(bits != 0, logits.astype(jnp.float32), -jnp.inf)


def mask_inputs(history: Sequence[RowHistory], vocab_size: int) -> np.ndarray | None:
    """The [B, ceil(V / 32)] bitmask mask_rows takes (all ones for rows without one), or None
    when no row has one."""
    if not any(h.allowed is not None for h in history):
        return None
    out = np.full((len(history), (vocab_size + 31) // 32), -1, np.int32)
    for i, h in enumerate(history):
        if h.allowed is not None:
            if h.allowed.shape != out.shape[1:]:
                raise ValueError(
                    f"sample_batch: row {i}'s token mask has shape {h.allowed.shape}, not {out.shape[1:]}"
                )
            out[i] = h.allowed
    return out


@jax.jit
def process_rows(
    logits: jax.Array,
    stop_ids: jax.Array,
    bias_ids: jax.Array,
    bias: jax.Array,
    prompt_ids: jax.Array,
    output_ids: jax.Array,
    repetition: jax.Array,
    frequency: jax.Array,
    presence: jax.Array,
) -> jax.Array:
    """The logit processors on logits [B, V] -> [B, V] f32. Per row, padded with -1: stop_ids
    [B, S] (only rows still under min_tokens carry any), bias_ids / bias [B, K], prompt_ids
    [B, P] (rows with a repetition penalty), output_ids [B, L]; repetition, frequency,
    presence [B] f32."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    logits = jnp.where(_scatter_rows(stop_ids, 1.0, v) > 0, -jnp.inf, logits)
    logits = logits + _scatter_rows(bias_ids, bias, v)
    counts = _scatter_rows(output_ids, 1.0, v)
    seen = (counts > 0) | (_scatter_rows(prompt_ids, 1.0, v) > 0)
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def processor_inputs(params: Sequence[SamplingParams], history: Sequence[RowHistory]) -> tuple:
    """The host arrays process_rows takes (ids only where a row's processor needs them)."""
    stops, bias_ids, bias, prompts, outputs = [], [], [], [], []
    for p, h in zip(params, history):
        stops.append(sorted(h.stops) if len(h.output) < p.min_tokens else [])
        bias_ids.append([t for t, _ in p.logit_bias])
        bias.append([b for _, b in p.logit_bias])
        prompts.append(h.prompt if p.repetition_penalty != 1.0 else [])
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        outputs.append(h.output if penalised else [])
    bias_arr = np.zeros(_padded(bias_ids).shape, np.float32)
    for i, b in enumerate(bias):
        bias_arr[i, : len(b)] = b
    return (
        _padded(stops),
        _padded(bias_ids),
        bias_arr,
        _padded(prompts),
        _padded(outputs),
        np.array([p.repetition_penalty for p in params], np.float32),
        np.array([p.frequency_penalty for p in params], np.float32),
        np.array([p.presence_penalty for p in params], np.float32),
    )


def sample_batch(
    logits: jax.Array,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    history: Sequence[RowHistory] | None = None,
) -> np.ndarray:
    """Host wrapper: one SamplingParams and step count per row -> ids [B] (numpy). history
    (one RowHistory per row) is needed when some row's parameters are `processed`; a row's
    history.allowed (structured output) masks its logits before anything else."""
    if history is not None:
        mask = mask_inputs(history, logits.shape[-1])
        if mask is not None:
            logits = mask_rows(logits, mask)
    if any(p.processed for p in params):
        if history is None or len(history) != len(params):
            raise ValueError("sample_batch: logit processors need one RowHistory per row")
        logits = process_rows(logits, *processor_inputs(params, history))
    if all(p.temperature == 0 for p in params):  # the common greedy batch: no sort, no draw
        return np.asarray(jnp.argmax(logits.astype(jnp.float32), axis=-1), np.int32)
    return np.asarray(
        sample_rows(
            logits,
            np.array([p.temperature for p in params], np.float32),
            np.array([p.top_p for p in params], np.float32),
            np.array([p.top_k for p in params], np.int32),
            np.array([p.seed for p in params], np.uint32),
            np.array(list(steps), np.int32),
            np.array([p.min_p for p in params], np.float32),
        )
    )


@functools.partial(jax.jit, static_argnames="k")
def _logprobs_rows(logits: jax.Array, rows: jax.Array, chosen: jax.Array, k: int):
    lp = jax.nn.log_softmax(logits[rows].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, chosen[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)  # equal values: the lower index first
    return picked, top_ids, top_lp


def token_logprobs(
    logits: jax.Array, rows: Sequence[int], chosen: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprob]:
    """For rows[i] of raw logits [B, V]: chosen[i]'s log-probability and the ks[i] most likely
    tokens, computed on the device; only [len(rows), max k] values come to the host."""
    if len(rows) == 0:
        return []
    k = min(max(ks), logits.shape[-1])
    picked, ids, lps = jax.device_get(
        _logprobs_rows(logits, np.asarray(rows, np.int32), np.asarray(chosen, np.int32), k)
    )
    return [
        TokenLogprob(
            int(c),
            float(picked[i]),
            tuple((int(ids[i, j]), float(lps[i, j])) for j in range(min(ks[i], k))),
        )
        for i, c in enumerate(chosen)
    ]


def filtered_probs_ref(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float = 0.0
) -> np.ndarray:
    """Reference in numpy (f64): the distribution sample_rows draws one row from."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    keep = np.arange(z.size) < (top_k if top_k > 0 else z.size)
    p = np.where(keep, np.exp(zs - zs[keep].max()), 0.0)
    p /= p.sum()
    keep &= ((np.cumsum(p) - p) < top_p) | (np.arange(z.size) == 0)
    keep &= (p >= min_p * p[0]) | (np.arange(z.size) == 0)
    out = np.zeros_like(z)
    out[order] = np.where(keep, p, 0.0)
    return out / out.sum()


def process_logits_ref(logits: np.ndarray, params: SamplingParams, history: RowHistory) -> np.ndarray:
    """Reference in numpy (f64) of process_rows for one row [V], written token by token."""
    z = np.asarray(logits, np.float64).copy()
    if len(history.output) < params.min_tokens:
        for t in history.stops:
            z[t] = -np.inf
    for t, b in params.logit_bias:
        z[t] += b
    seen = set(int(t) for t in history.prompt) | set(int(t) for t in history.output)
    for t in seen:
        r = params.repetition_penalty
        z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t in set(int(t) for t in history.output):
        n = sum(1 for o in history.output if o == t)
        z[t] -= params.frequency_penalty * n + params.presence_penalty
    return z


def logprobs_ref(logits: np.ndarray, chosen: int, k: int) -> TokenLogprob:
    """Reference in numpy (f64) of token_logprobs for one raw row [V]."""
    z = np.asarray(logits, np.float64)
    lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    order = np.argsort(-lp, kind="stable")[:k]
    return TokenLogprob(int(chosen), float(lp[chosen]), tuple((int(t), float(lp[t])) for t in order))
