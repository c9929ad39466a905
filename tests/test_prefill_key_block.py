"""runtime.run.prefill_key_block: the key block a prefill chunk's attention walks with, against
the keys the plan prices (plan.costs.attn_flops) and the walk model.attention runs (restated
here from its code: n_kb blocks of gcd(block, row length) keys up to the chunk's end)."""

import math

import pytest

from hmoe_jax.plan import costs
from hmoe_jax.plan.buckets import cache_len, prefill_bucket
from hmoe_jax.runtime.run import K_BLOCK, prefill_key_block


def _walked_keys(bk: int, start: int, tokens: int, row_len: int) -> int:
    """Keys model.attention's traced walk visits for a single query block (tokens <= q_block):
    blocks of key_block(bk, row) up to position start + tokens - 1."""
    b = math.gcd(bk, row_len)
    return min((start + tokens - 1) // b + 1, row_len // b) * b


def _priced_keys(k_block: int, start: int, tokens: int) -> int:
    b = costs.key_block(k_block, cache_len(start + tokens))
    return -(-(start + tokens) // b) * b


CASES = [
    (k, t, s)
    for k in (512, 256)
    for t in (64, 128, 188, 256, 512)
    for s in (0, 64, 128, 512, 1024, 1536, 3000)
]


@pytest.mark.parametrize("k_block,tokens,start", CASES)
def test_walk_visits_at_most_the_priced_keys_on_a_long_row(k_block, tokens, start):
    row = 4096
    bk = prefill_key_block(k_block, tokens, start + tokens)
    assert cache_len(start + tokens) % bk == 0 and bk <= k_block
    walked = _walked_keys(bk, start, tokens, row)
    assert start + tokens <= walked <= _priced_keys(k_block, start, tokens)


@pytest.mark.parametrize("tokens", [64, 128, 256, 512, 1024, 1536])
def test_a_first_chunk_walks_exactly_the_priced_keys(tokens):
    bk = prefill_key_block(K_BLOCK, tokens, tokens)
    assert _walked_keys(bk, 0, tokens, 4096) == _priced_keys(K_BLOCK, 0, tokens) == tokens
    # the old block (the row's gcd with 512) walked a whole 512-key block for short chunks
    assert _walked_keys(K_BLOCK, 0, tokens, 4096) == max(tokens, 512)


@pytest.mark.parametrize("chunk", [64, 128, 256, 512, 1024])
@pytest.mark.parametrize("prompt", [100, 700, 1300, 3000])
def test_serving_chunks_take_the_block_warm_up_compiled(chunk, prompt):
    # a prompt cut into chunks of `chunk` tokens, each padded (Engine.prefill_seq): every
    # chunk's block is the one of the same padded length at position 0 (warm-up's)
    for start in range(0, prompt, chunk):
        tp = prefill_bucket(min(chunk, prompt - start))
        assert prefill_key_block(K_BLOCK, tp, start + tp) == prefill_key_block(K_BLOCK, tp, tp)


def test_default_matches_the_attention_pieces_and_the_cost_model():
    import inspect

    from hmoe_jax.runtime import pieces

    assert inspect.signature(pieces._attention).parameters["k_block"].default == K_BLOCK
    assert inspect.signature(costs.attn_flops).parameters["k_block"].default == K_BLOCK
