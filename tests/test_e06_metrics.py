"""e06's latency bookkeeping against hand-computed values: the mean token gap of a decode
over the span around a prefill window (a stall through the window must show), and the
mixed-throughput formula's pieces."""

from __future__ import annotations

import types

import pytest

from hmoe_jax.sim.replay import window_tpot as _window_tpot


def req(times):
    return types.SimpleNamespace(token_s=list(times))


def test_window_tpot_spans_the_window_and_shows_a_stall():
    steady = req([i / 10 for i in range(13)])
    # window [0.15, 0.35]: from token at 0.1 to token at 0.4 -> 3 gaps of 0.1
    assert _window_tpot([steady], 0.15, 0.35) == pytest.approx(0.1)
    stalled = req([0.0, 0.1, 1.1, 1.2])  # nothing produced while a prefill ran in [0.15, 1.0]
    assert _window_tpot([stalled], 0.15, 1.0) == pytest.approx(1.0)
    # averaged over decodes (steady: 0.1 -> 1.0 in 9 gaps)
    assert _window_tpot([steady, stalled], 0.15, 1.0) == pytest.approx((0.1 + 1.0) / 2)


def test_window_tpot_without_a_span_is_none():
    assert _window_tpot([req([0.0, 0.1])], 0.2, 0.3) is None  # ended before the window closed
    assert _window_tpot([], 0.0, 1.0) is None
