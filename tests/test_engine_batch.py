"""Many sequences through the engine: 1..6 requests with different prompt lengths, admitted
at different steps and finishing at different steps, decode together in batched steps
(rows of the KV pool at their own positions); each must get exactly the tokens of the
independent reference rollout (hmoe_jax.model.generate.greedy_rollout: plain model, dense attention,
experts_ref, one sequence), for every registered prefill schedule (f32 policy: exact
maths up to f32 summation order, so greedy tokens are identical). Also: the pool frees
rows when sequences finish or are cancelled, and says clearly when it is exhausted.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine, PoolExhausted
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.schedules.registry import schedule_class, schedule_names
from tests.helpers import reference_engine

SYSTEM = SystemSpec(
    auto_slp_min_tokens=8, auto_dslp_min_tokens=8, cpu_prefill_chunk_tokens=8, slp_experts_per_slot=4
)
# (prompt length, new tokens, arrival step): every sequence is admitted while others decode
# and several finish while others go on.
REQUESTS = [(5, 6, 0), (12, 3, 0), (8, 5, 1), (16, 2, 2), (9, 4, 2), (3, 5, 4)]


@functools.cache
def model():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=11)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n, _, _ in REQUESTS]
    refs = [greedy_rollout(params, cfg, p, m) for p, (_, m, _) in zip(prompts, REQUESTS)]
    return cfg, params, prompts, refs


@functools.cache
def engine(devices: int) -> Engine:
    cfg, params, *_ = model()
    return reference_engine(params, cfg, devices, max_batch=6, max_len=64)


def run_mixed(eng: Engine, schedule: str, prompts, requests):
    """Admit each request at its arrival step (prefill with `schedule`), then one batched
    decode step for all unfinished sequences; until all are done."""
    seqs: dict[int, object] = {}
    step, batch_sizes = 0, []
    while len(seqs) < len(requests) or any(not s.done for s in seqs.values()):
        for i, (_, n_new, arrival) in enumerate(requests):
            if arrival == step:
                seqs[i] = eng.start(
                    prompts[i], SamplingParams(max_new_tokens=n_new, stop_ids=()), schedule=schedule
                )
        active = [s for s in seqs.values() if not s.done]
        if active:
            eng.step(active)
            batch_sizes.append(len(active))
        step += 1
    return [seqs[i].tokens for i in range(len(requests))], batch_sizes


@pytest.mark.parametrize("schedule", schedule_names())
def test_batched_sequences_get_their_solo_tokens(schedule):
    cls = schedule_class(schedule)
    devices = 2 if (cls.max_devices is None or cls.max_devices > 1) else 1
    cfg, _, prompts, refs = model()
    eng = engine(devices)
    got, batch_sizes = run_mixed(eng, schedule, prompts, REQUESTS)
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"{schedule}: request {i} (prompt {REQUESTS[i][0]} tokens) got {g}, alone {r}"
    assert max(batch_sizes) >= 4 and len(set(batch_sizes)) >= 3  # really batched, at varying sizes
    assert eng.pool.in_use == 0  # every finished sequence gave its row back


def test_pool_exhaustion_and_cancel_free_rows():
    cfg, _, prompts, _ = model()
    eng = Engine(model()[1], cfg, expert_fn="ref", precision="f32", max_batch=2, max_len=64)
    sp = SamplingParams(max_new_tokens=4, stop_ids=())
    a = eng.start(prompts[0], sp, schedule="cpu")
    b = eng.start(prompts[1], sp, schedule="cpu")
    with pytest.raises(PoolExhausted, match="all 2 rows in use"):
        eng.start(prompts[2], sp, schedule="cpu")
    assert eng.pool.in_use == 2  # the refused request took nothing
    eng.cancel(a)
    assert a.finish_reason == "cancelled" and eng.pool.in_use == 1
    c = eng.start(prompts[2], sp, schedule="cpu")  # the freed row is reused
    assert c.row == a.row
    with pytest.raises(PoolExhausted, match="exceeds the pool's row length of 64"):
        eng.cancel(b), eng.start(prompts[3], SamplingParams(max_new_tokens=60, stop_ids=()), schedule="cpu")


def test_sampled_request_is_reproducible_whatever_its_batch():
    """A sampled request draws the same tokens alone and inside a batch (its key depends on
    its seed and its own step count only); greedy rows in the same batch stay greedy."""
    cfg, _, prompts, refs = model()
    eng = engine(1)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_new_tokens=5, stop_ids=())
    alone = eng.generate(prompts[2], 5, schedule="cpu", stop_ids=(), sampling=sp).tokens
    s1 = eng.start(prompts[2], sp, schedule="cpu")
    s2 = eng.start(prompts[0], SamplingParams(max_new_tokens=6, stop_ids=()), schedule="cpu")
    while not (s1.done and s2.done):
        eng.step([s for s in (s1, s2) if not s.done])
    assert s1.tokens == alone
    assert s2.tokens == refs[0]


def test_processed_request_is_reproducible_whatever_its_batch():
    """With logit processors and min-p (issue #28) a seeded request still draws the same
    tokens alone and beside a plain greedy and a plain sampled request, which keep theirs."""
    cfg, _, prompts, refs = model()
    eng = engine(1)
    sp = SamplingParams(
        temperature=0.9,
        min_p=0.05,
        seed=77,
        max_new_tokens=5,
        stop_ids=(),
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logit_bias=((7, 2.0),),
        logprobs=1,
    )
    plain = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=5, stop_ids=())
    alone = eng.generate(prompts[2], 5, schedule="cpu", stop_ids=(), sampling=sp).tokens
    plain_alone = eng.generate(prompts[1], 5, schedule="cpu", stop_ids=(), sampling=plain).tokens
    s1 = eng.start(prompts[2], sp, schedule="cpu")
    s2 = eng.start(prompts[0], SamplingParams(max_new_tokens=6, stop_ids=()), schedule="cpu")
    s3 = eng.start(prompts[1], plain, schedule="cpu")
    while not (s1.done and s2.done and s3.done):
        eng.step([s for s in (s1, s2, s3) if not s.done])
    assert s1.tokens == alone and [lp.token for lp in s1.logprobs] == alone
    assert s2.tokens == refs[0] and s2.logprobs == []
    assert s3.tokens == plain_alone


def test_pool_rows_from_a_byte_budget():
    cfg, params, *_ = model()
    from hmoe_jax.runtime.kvpool import bytes_per_row

    row = bytes_per_row(cfg, 64, np.float32)  # f32 policy: f32 cache
    eng = Engine(
        params, cfg, expert_fn="ref", precision="f32", max_len=64, kv_budget_bytes=3 * row + row // 2
    )
    assert eng.max_batch == 3 and eng.pool.rows == 3 and eng.pool.nbytes == 3 * row
    with pytest.raises(PoolExhausted, match="rows=0 must be >= 1"):
        Engine(params, cfg, expert_fn="ref", precision="f32", max_len=64, kv_budget_bytes=row // 2)
