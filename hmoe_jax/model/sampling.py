"""Per-request sampling for a batch of rows: greedy, temperature, top-k, top-p, seed.

Each row has its own parameters. A row's random key is fold_in(key(seed), step), where
step counts the tokens that request has sampled, so a request draws the same tokens
whatever else is in its batch and whenever it was admitted. temperature == 0 is greedy:
the argmax of the f32 logits, bit-stable. Filtering order (as vLLM and HF apply it):
temperature, then top-k (keep the k largest; 0 = off), then top-p (keep the smallest set
of the remaining tokens, in descending order, whose probability reaches top_p; the top
token always stays), then one categorical draw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
        return self


def _filter_row(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
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
    return jnp.full((v,), -jnp.inf, jnp.float32).at[order].set(jnp.where(keep, zs, -jnp.inf))


@jax.jit
def sample_rows(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    seed: jax.Array,
    step: jax.Array,
) -> jax.Array:
    """logits [B, V] f32; per row temperature, top_p [B] f32, top_k, step [B] int32, seed [B]
    uint32 -> token ids [B] int32."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(lg, t, p, k, s, n):
        key = jax.random.fold_in(jax.random.key(s), n)
        return jax.random.categorical(key, _filter_row(lg, t, p, k)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_p, top_k, seed, step)
    return jnp.where(temperature > 0, drawn, greedy)


def sample_batch(logits: jax.Array, params: Sequence[SamplingParams], steps: Sequence[int]) -> np.ndarray:
    """Host wrapper: one SamplingParams and step count per row -> ids [B] (numpy)."""
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
        )
    )


def filtered_probs_ref(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Reference in numpy (f64): the distribution sample_rows draws one row from."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    keep = np.arange(z.size) < (top_k if top_k > 0 else z.size)
    p = np.where(keep, np.exp(zs - zs[keep].max()), 0.0)
    p /= p.sum()
    keep &= ((np.cumsum(p) - p) < top_p) | (np.arange(z.size) == 0)
    out = np.zeros_like(z)
    out[order] = np.where(keep, p, 0.0)
    return out / out.sum()
