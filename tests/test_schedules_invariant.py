"""The Done-when invariant: every registered schedule generates exactly the reference greedy
rollout (hmoe_jax.model.generate.greedy_rollout with experts_ref) on tiny f32 and FP8 models, on 1, 2 and 4
stand-in accelerators, and its prefill logits match the teacher-forced reference.

Adding one line to hmoe_jax/schedules/registry.py brings a new schedule under this test.
Single-accelerator schedules (max_devices == 1) are run once, at 1 device: on more devices
they run the identical plan on the first one (the skip says so).

Tolerance: the engine and the reference compute the same f32 math with different
association (per-layer pieces vs one fused forward, grouped GEMMs vs the dense all-expert
einsum, partial sums per expert group), so logits differ by f32 rounding only: observed
~5e-6 on logits of magnitude ~1-5; we allow 1e-4 absolute + 1e-4 relative, far below the
~1e-1 gaps between the top logits that decide the tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine
from hmoe_jax.model.generate import greedy_rollout, teacher_forced_logits
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.schedules.registry import schedule_class, schedule_names
from tests.helpers import reference_engine

PROMPT_LEN, NEW_TOKENS = 12, 4
ATOL = RTOL = 1e-4


@functools.cache
def model(dtype: str):
    cfg = named_model_config("deepseek_v3_tiny")
    if dtype == "f32":
        cfg = dataclasses.replace(cfg, quant=None)
    params = random_params(cfg, seed=3)
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, cfg.vocab_size, PROMPT_LEN)]
    ref = greedy_rollout(params, cfg, prompt, NEW_TOKENS)
    ref_logits = teacher_forced_logits(params, cfg, prompt)
    return cfg, params, prompt, ref, ref_logits


@functools.cache
def engine(dtype: str, devices: int) -> Engine:
    cfg, params, *_ = model(dtype)
    return reference_engine(params, cfg, devices)


CASES = [(s, d, n) for s in schedule_names() for d in ("f32", "fp8") for n in (1, 2, 4)]


@pytest.mark.parametrize("schedule,dtype,devices", CASES, ids=[f"{s}-{d}-{n}dev" for s, d, n in CASES])
def test_schedule_matches_reference_rollout(schedule: str, dtype: str, devices: int):
    cls = schedule_class(schedule)
    # A single-accelerator schedule still runs on an engine that holds 2 or 4 stand-ins:
    # placement must pick its device correctly and leave the others alone.
    if devices < cls.min_devices:
        pytest.skip(f"{schedule} needs >= {cls.min_devices} accelerators")
    cfg, _, prompt, ref_tokens, ref_logits = model(dtype)
    eng = engine(dtype, devices)
    res = eng.generate(prompt, NEW_TOKENS, schedule=schedule, stop_ids=(), all_logits=True)
    assert res.tokens == ref_tokens, (
        f"{schedule} ({res.schedule}) tokens {res.tokens} != reference {ref_tokens}"
    )
    got = res.prefill_logits
    if got.shape[0] == 1:  # a schedule that computes the last position only
        ref_logits = ref_logits[-1:]
    assert got.shape == ref_logits.shape
    np.testing.assert_allclose(got, ref_logits, atol=ATOL, rtol=RTOL)
