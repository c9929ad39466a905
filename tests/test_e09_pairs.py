"""bench.stats.paired_ratios: side-by-side ratios of two servers' runs keyed alike (e09 pairs
each one-client run of hmoe with llama-server's made right after it)."""

import pytest

from hmoe_jax.bench.stats import paired_ratios


def test_pairs_by_key_in_key_order_and_skips_what_has_no_partner():
    ours = {(0, 1): 18.0, (0, 0): 20.0, (1, 0): 30.0}  # (1, 0): its peer run failed
    theirs = {(0, 0): 16.0, (0, 1): 20.0, (1, 1): 10.0}  # (1, 1): no run of ours
    assert paired_ratios(ours, theirs) == pytest.approx([20.0 / 16.0, 18.0 / 20.0])


def test_a_zero_or_empty_side_gives_no_ratio():
    assert paired_ratios({0: 5.0}, {0: 0.0}) == []
    assert paired_ratios({}, {0: 1.0}) == []
    assert paired_ratios({0: 1.0}, {}) == []
