"""The simulator against the engine on the tiny model, on this machine (loose bound, so the
calibration cannot silently rot): decode steps and a cpu prefill, each timed by the engine
(blocking executor) and by hmoe_jax/sim/ on this machine's profile, calibrated in the same
run (`hmoe calibrate --quick`: the `calibrated_profile` fixture of tests/conftest.py).
The tiny model's weights sit in cache: its times are the per-op overheads the profile
measured from traces of OTHER runs (calibration prefills and steps), plus small reads.
The 10% validation on the real-shape bench twin is experiments e03/e04.

A wall-clock check: the `timing` lane (`python -m pytest -m timing`), not the default run."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.timing
# simulated / measured within [1/LOOSE, LOOSE]; measured is the BEST of several calls: on
# this shared 2-core VM a neighbour can double a 4 ms step, and the profile's overheads are
# medians of a calibration run, not of a loaded moment
LOOSE = 2.5
# the tiny model's cpu prefill is many small pieces whose per-op costs the profile takes from
# medians of other runs: with a calibration of 2026-12-05 20:44 its 64-token prefill measured
# 13-19 ms against 7.7 ms simulated (1.7-2.4x), 21-26 ms in a loaded hour; the bench twin's
# rows (e04) are within 8-14%. 4x still catches a unit or pricing error.
LOOSE_CPU_PREFILL = 4.0


@pytest.fixture(scope="module")
def tiny_engine():
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.synthetic import ensure_default_checkpoint
    from hmoe_jax.plan.system import SystemSpec

    cfg, params = load_checkpoint(ensure_default_checkpoint(progress=False), progress=False)
    eng = Engine(params, cfg, system=SystemSpec(), precision="bf16", max_batch=4, max_len=256)
    yield cfg, eng
    eng.close()


def _ratio_ok(sim_s: float, measured_s: float, loose: float = LOOSE) -> bool:
    return 1 / loose <= sim_s / measured_s <= loose


def test_tiny_decode_step_within_the_loose_bound(tiny_engine, calibrated_profile):
    from hmoe_jax.model.sampling import SamplingParams
    from hmoe_jax.sim.run import simulate_decode_step

    cfg, eng = tiny_engine
    for b in (1, 4):
        seqs = [eng.start([5 + i, 6, 7, 8], SamplingParams(max_new_tokens=16, stop_ids=())) for i in range(b)]
        ts = []
        for i in range(8):
            t = time.perf_counter()
            toks, rows, pos = eng.step_inputs(seqs)
            eng.take_step(seqs, eng.decode_rows(toks, rows, pos, eng.pool, mode="serial"), 0.0)
            if i >= 2:  # compiled by now
                ts.append(time.perf_counter() - t)
        for s in seqs:
            eng.cancel(s)
        measured = min(ts)
        sim = simulate_decode_step(cfg, calibrated_profile, 8, batch=b, max_len=256)["step_s"]
        assert _ratio_ok(sim, measured), (
            f"B={b}: simulated {sim * 1e3:.2f} ms vs measured {measured * 1e3:.2f} ms"
        )


def test_tiny_cpu_prefill_within_the_loose_bound(tiny_engine, calibrated_profile):
    from hmoe_jax.sim.run import simulate_request

    cfg, eng = tiny_engine
    ids = np.arange(3, 67, dtype=np.int32)
    cache = eng.new_cache(256)
    eng.prefill(ids, cache, schedule="cpu")  # compile
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        eng.prefill(ids, cache, schedule="cpu")
        ts.append(time.perf_counter() - t)
    measured = min(ts)
    sim = simulate_request(cfg, calibrated_profile, "cpu", len(ids), max_len=256)["ttft_s"]
    assert _ratio_ok(sim, measured, LOOSE_CPU_PREFILL), (
        f"simulated {sim * 1e3:.2f} ms vs measured {measured * 1e3:.2f} ms"
    )
