"""Per-row sampling (hmoe_jax.model.sampling) against a numpy reference of the filtered
distribution: greedy is the argmax; top-k = 1 is the argmax; empirical frequencies of
many seeded draws match filtered_probs_ref (temperature, top-k, top-p) within a
binomial tolerance; a row's draw depends on its own (seed, step) only."""

from __future__ import annotations

import numpy as np
import pytest

from hmoe_jax.model.sampling import SamplingParams, filtered_probs_ref, sample_batch, sample_rows

V = 12
LOGITS = np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


def _draws(t, p, k, n=4000):
    logits = np.broadcast_to(LOGITS, (n, V))
    ids = sample_rows(
        logits,
        np.full(n, t, np.float32),
        np.full(n, p, np.float32),
        np.full(n, k, np.int32),
        np.arange(n, dtype=np.uint32),
        np.zeros(n, np.int32),
    )
    return np.bincount(np.asarray(ids), minlength=V) / n


def test_greedy_and_top1_are_argmax():
    logits = np.random.default_rng(1).normal(size=(5, V)).astype(np.float32)
    greedy = sample_batch(logits, [SamplingParams()] * 5, [0] * 5)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    top1 = sample_batch(logits, [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(5)], [3] * 5)
    assert top1.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("t,p,k", [(1.0, 1.0, 0), (0.7, 1.0, 4), (1.3, 0.8, 0), (1.0, 0.6, 5)])
def test_frequencies_match_the_filtered_distribution(t, p, k):
    n = 4000
    ref = filtered_probs_ref(LOGITS, t, p, k)
    got = _draws(t, p, k, n)
    assert (got[ref == 0] == 0).all(), "a filtered token was drawn"
    tol = 4.5 * np.sqrt(ref * (1 - ref) / n) + 1e-3  # ~4.5 sigma per token
    assert (np.abs(got - ref) <= tol).all(), (got.round(3), ref.round(3))


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    """The top token always stays: with top_p below its probability nothing else is drawn,
    whatever the temperature and seed."""
    logits = np.random.default_rng(3).normal(size=(1, V)).astype(np.float32)
    drawn = {
        int(sample_batch(logits, [SamplingParams(temperature=t, top_p=1e-6, seed=s)], [s])[0])
        for t in (0.5, 2.0)
        for s in range(5)
    }
    assert drawn == {int(logits.argmax())}


def test_a_rows_draw_depends_on_its_seed_and_step_only():
    logits = np.random.default_rng(2).normal(size=(3, V)).astype(np.float32)
    sp = SamplingParams(temperature=1.0, seed=77)
    alone = sample_batch(logits[1:2], [sp], [5])
    mixed = sample_batch(logits, [SamplingParams(), sp, SamplingParams(temperature=2.0, seed=3)], [0, 5, 9])
    assert mixed[1] == alone[0]
    assert mixed[0] == logits[0].argmax()


def test_bad_parameters_name_the_problem():
    for kw, msg in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw).validate()


@pytest.mark.parametrize("top_p", [1e-40, 1e-30])
def test_a_subnormal_top_p_still_draws_the_argmax(top_p):
    """top_p = 1e-40 is a valid (0, 1] value but flushes to 0 in f32 on the device; the
    argmax must still be drawn (it used to come back as token 0 for every row). Reference:
    numpy's argmax of the logits, and the f64 filtered distribution's one nonzero entry."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2.0, size=(6, V)).astype(np.float32)
    logits[:, 0] = logits.min() - 1.0  # token 0 is never the argmax, so the old bug shows
    want = np.argmax(logits, axis=-1)
    for t in (0.3, 1.0, 4.0):
        params = [SamplingParams(temperature=t, top_p=top_p, seed=s).validate() for s in range(6)]
        got = sample_batch(logits, params, list(range(6)))
        assert got.tolist() == want.tolist(), (t, got, want)
        for row in logits:
            ref = filtered_probs_ref(row, t, top_p, 0)
            assert np.flatnonzero(ref).tolist() == [int(np.argmax(row))]
