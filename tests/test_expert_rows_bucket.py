"""plan/buckets.expected_expert_rows_bucket: the rows a dense grouped GEMM pays for (the slp
plan's dense_rows, priced on a stand-in), against routing drawn the way the plans assume it
(each token picks k distinct experts uniformly) and against exact enumeration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hmoe_jax.plan.buckets import expected_expert_rows_bucket, expert_rows_bucket


def _exact(tokens: int, p: float) -> float:
    """E[bucket(X) (X > 0)], X ~ Binomial(tokens, p), term by term with math.comb."""
    return sum(
        expert_rows_bucket(x) * math.comb(tokens, x) * p**x * (1 - p) ** (tokens - x)
        for x in range(1, tokens + 1)
    )


@pytest.mark.parametrize("tokens", [1, 3, 17, 64, 200])
def test_one_expert_is_the_binomial_expectation(tokens):
    assert expected_expert_rows_bucket(tokens, 1, 8, 32) == pytest.approx(_exact(tokens, 8 / 32), rel=1e-9)
    assert expected_expert_rows_bucket(tokens, 1, 8, 256) == pytest.approx(_exact(tokens, 8 / 256), rel=1e-9)


@pytest.mark.parametrize(("tokens", "group"), [(64, 1), (256, 1), (1024, 1), (256, 4)])
def test_matches_drawn_uniform_routing(tokens, group):
    """1,000 draws of a whole layer's routing (32 experts, top-8): the mean bucket of a
    group's rows (0 when empty) lands within 1.5% of the expectation. At 256 tokens the
    groups average 64 rows but pay ~94: the padding the stand-in's measured slp prefill
    showed (27 of 64 groups at 128 rows)."""
    e, k, draws = 32, 8, 1_000
    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((draws, tokens, e)), axis=-1)[..., :k]  # k distinct experts each
    counts = np.zeros((draws, e), np.int64)
    for d in range(draws):
        counts[d] = np.bincount(picks[d].ravel(), minlength=e)
    rows = counts.reshape(draws, e // group, group).sum(-1)
    buckets = np.vectorize(lambda r: expert_rows_bucket(r) if r else 0)(rows)
    got = expected_expert_rows_bucket(tokens, group, k, e)
    assert buckets.mean() == pytest.approx(got, rel=0.015)
    assert got > tokens * k * group / e * 1.2  # well above the routed rows' mean


def test_a_group_that_always_fills_and_an_empty_one():
    assert expected_expert_rows_bucket(100, 1, 8, 8) == expert_rows_bucket(100)  # every token routed here
    assert expected_expert_rows_bucket(0, 1, 8, 32) == 0.0


def test_the_slp_plan_gives_each_group_its_routed_and_dense_rows():
    """Each experts_acc op of an slp plan: rows = the routed rows' mean (tokens x k x G / E,
    its flops), dense_rows = G x the expected bucket (what a dense grouped GEMM pays)."""
    from hmoe_jax.config import named_model_config
    from hmoe_jax.plan import costs
    from hmoe_jax.plan.profile import load_profile
    from hmoe_jax.sim.run import build_plan

    cfg = named_model_config("deepseek_v3_bench")
    plan, _ = build_plan(cfg, load_profile("local"), "slp", 256)
    groups = [op for op in plan.ops if op.kind == "experts_acc"]
    assert groups
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for op in groups:
        lo, hi = op.args["experts"]
        g = hi - lo
        assert op.args["rows"] == 256 * k * g // e
        assert op.flops == costs.expert_flops(cfg, op.args["rows"])
        assert op.args["dense_rows"] == pytest.approx(g * expected_expert_rows_bucket(256, g, k, e), abs=1e-3)
