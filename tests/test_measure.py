"""hmoe_jax/measure/timing.py, the one timing helper (calibrate, experiments, tools), on a
scripted clock: each call advances a fake perf_counter by a known duration, so the expected
medians are written down here, not measured."""

from __future__ import annotations

import pytest

from hmoe_jax.measure import timing


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def call(self, durations_s: list[float]):
        """A function whose k-th call takes durations_s[k] seconds of the fake clock."""
        it = iter(durations_s)

        def fn():
            self.now_s += next(it)

        return fn


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", c)
    monkeypatch.setattr(timing.time, "process_time", c)
    return c


def test_median_time_skips_warmup_and_between(clock):
    # warm-up call takes 100 s (compilation): not a sample; the probe before each timed call
    # takes 50 s: not timed either
    fn = clock.call([100.0, 5.0, 1.0, 3.0])
    probes = []

    def probe():
        probes.append(1)
        clock.now_s += 50.0

    st = timing.median_time(fn, repeats=3, warmup=1, between=probe)
    assert (st.median_s, st.best_s, st.worst_s, st.n) == (3.0, 1.0, 5.0, 3)
    assert len(probes) == 3


def _recording(clock, order: list):
    """variant(name, durations_s) -> a call on the fake clock that appends `name` to order."""

    def variant(name, durations_s):
        f = clock.call(durations_s)

        def g():
            order.append(name)
            f()

        return g

    return variant


def test_interleaved_timings_round_robin_per_call(clock):
    order = []
    variant = _recording(clock, order)

    # 2 calls per sample: a sample is the mean of two back-to-back calls
    out = timing.interleaved_timings(
        {"a": variant("a", [9.0, 9.0, 2.0, 4.0, 6.0, 8.0]), "b": variant("b", [9.0, 1.0, 3.0])},
        rounds=2,
        warmup=1,
        calls_per_sample={"a": 2, "b": 1},
    )
    assert order == ["a", "a", "b"] * 3  # warm-ups, then each round: a's two calls, b's one
    assert out["a"].median_s == pytest.approx((3.0 + 7.0) / 2) and out["a"].n == 2
    assert out["b"].median_s == pytest.approx(2.0) and out["b"].cpu_median_s == pytest.approx(2.0)


class _Probe:
    """A probe on the fake clock: reads 10, 30, 20 GB/s; its own time is not in any call's."""

    def __init__(self, clock) -> None:
        self.clock, self.rates = clock, iter([10.0, 30.0, 20.0])

    def gbps(self) -> float:
        self.clock.now_s += 7.0
        return next(self.rates)

    def tflops(self) -> None:
        self.clock.now_s += 7.0

    def stream_gbps(self) -> None:
        self.clock.now_s += 7.0


def test_side_by_side_probes_each_round(clock):
    # 2 warm-up calls, then 3 rounds of 2 calls: per-call means 1.5, 3.5, 2.5
    fn = clock.call([50.0, 50.0, 1.0, 2.0, 3.0, 4.0, 2.0, 3.0])
    t_s, gbps = timing.side_by_side(_Probe(clock), fn, calls=2, rounds=3)
    assert (t_s, gbps) == (2.5, 20.0)


def test_side_by_side_points_time_every_variant_each_round_in_alternating_order(clock):
    order = []
    variant = _recording(clock, order)

    # 1 warm-up call each, then 3 rounds of 1 call each: a, b / b, a / a, b
    fns = {"a": variant("a", [50.0, 1.0, 5.0, 3.0]), "b": variant("b", [50.0, 2.0, 8.0, 4.0])}
    ts, gbps = timing.side_by_side_points(_Probe(clock), fns, calls=1, rounds=3)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert ts == {"a": 3.0, "b": 4.0} and gbps == 20.0


def test_no_samples_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        timing.median_time(lambda: None, repeats=0)
