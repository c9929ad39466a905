"""Whole distributed prefill (CP attention + SmallEP or EP, layer by layer, streamed
weights) vs the single-device reference forward, on 1, 2 and 4 stand-in devices, f32 and
FP8: full-sequence logits, the decode cache, the greedy continuation from the distributed
prefill, and the per-rank weight traffic (each rank receives only its own experts).

Tolerance as in test_dist_ops.py (reordered f32 sums): 1e-5 * max|ref|. Greedy tokens
must be identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.model.generate import generate
from hmoe_jax.model.model import forward, forward_nocache, init_cache
from hmoe_jax.model.params import MoEParams
from hmoe_jax.quant.fp8 import Fp8Tensor
from hmoe_jax.runtime.dist import make_mesh
from hmoe_jax.runtime.dist_prefill import dist_generate, dist_prefill
from hmoe_jax.runtime.dist_stream import RankStreamer
from tests.test_dist_ops import assert_close
from tests.test_dist_params import random_params, tiny_config

# 3 layers (1 dense, 2 MoE) keep the reference compile short.
CFG = tiny_config("deepseek_v3_tiny", num_hidden_layers=3, first_k_dense_replace=1)


def _expert_leaf_bytes(experts, lo, hi) -> int:
    return sum(int(np.asarray(x[lo:hi]).nbytes) for x in jax.tree_util.tree_leaves(experts))


# One prompt length for every case, so each compiled program (reference and distributed) is
# reused across cases: 13 is a multiple of 2N for no N, so every case pads and masks.
T, NEW, MAX_LEN = 13, 8, 64  # MAX_LEN: generate()'s cache bucket for T + NEW


@functools.cache
def _case(fp8: bool):
    params = random_params(CFG, seed=4, fp8=fp8)
    prompt = np.random.default_rng(9).integers(2, CFG.vocab_size, T).tolist()
    logits, cache = forward(params, CFG, np.asarray([prompt]), init_cache(CFG, 1, MAX_LEN), 0)
    return params, prompt, logits, cache


CASES = [
    ("smallep", False, 1),
    ("smallep", False, 2),
    ("smallep", False, 4),
    ("ep", False, 4),
    ("smallep", True, 4),
    ("ep", True, 2),
]


@pytest.mark.parametrize("scheme,fp8,n", CASES)
def test_dist_prefill_matches_reference(scheme, fp8, n):
    params, prompt, ref_logits, ref_cache = _case(fp8)
    t = T
    res = dist_prefill(
        params, CFG, np.asarray([prompt]), make_mesh(n), moe_scheme=scheme, all_logits=True, max_len=MAX_LEN
    )

    assert_close(res.logits, ref_logits, f"dslp/{scheme} logits N={n} T={t} fp8={fp8}")
    assert_close(res.logits_last, ref_logits[:, -1], "last-token logits")
    assert_close(res.cache.latent, ref_cache.latent, "latent cache")
    assert_close(res.cache.k_rope, ref_cache.k_rope, "k_rope cache")
    assert not np.asarray(res.cache.latent)[:, :, t:].any(), "pad / unused cache slots must be zero"

    # Each rank received exactly its own experts' bytes, once per MoE layer, and nothing else.
    el = CFG.n_routed_experts // n
    for i, layer in enumerate(params.layers):
        recs = [r for r in res.stream.log if r.layer == i and r.what == "experts"]
        if not isinstance(layer.ffn, MoEParams):
            assert recs == []
            continue
        assert sorted(r.rank for r in recs) == list(range(n))
        for r in recs:
            assert r.experts == (r.rank * el, (r.rank + 1) * el)
            assert r.bytes == _expert_leaf_bytes(layer.ffn.experts, *r.experts)

    moe_layers = [c for c in res.comm if "moe" in c]
    assert len(moe_layers) == CFG.num_hidden_layers - CFG.first_k_dense_replace
    assert all(c["moe"]["scheme"] == scheme for c in moe_layers)
    if n == 1:
        assert all(c["attention"]["total_bytes"] == 0 for c in res.comm)
        assert all(c["moe"]["total_bytes"] == 0 for c in moe_layers)


@pytest.mark.parametrize("scheme,fp8,n", [("smallep", False, 2), ("ep", True, 2)])
def test_greedy_continuation_after_dist_prefill(scheme, fp8, n):
    params, prompt, *_ = _case(fp8)
    ref = generate(params, CFG, prompt, NEW, stop_ids=())
    got, _ = dist_generate(params, CFG, prompt, NEW, make_mesh(n), moe_scheme=scheme, stop_ids=())
    assert got.tokens == ref.tokens
    # and the teacher-forced argmax of the whole rollout agrees (decode-consistency)
    full = np.asarray(forward_nocache(params, CFG, jnp.asarray([prompt + ref.tokens[:-1]])))[0]
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == ref.tokens


@pytest.mark.parametrize("fp8", [False, True])
def test_streamer_puts_each_ranks_experts_on_its_device_only(fp8):
    params = random_params(CFG, seed=6, fp8=fp8)
    experts = params.layers[-1].ffn.experts
    n = 4
    mesh = make_mesh(n)
    st = RankStreamer(mesh)
    dev_experts = st.experts(7, experts)
    el = CFG.n_routed_experts // n
    for host, dev in zip(jax.tree_util.tree_leaves(experts), jax.tree_util.tree_leaves(dev_experts)):
        assert dev.shape == host.shape
        shards = sorted(dev.addressable_shards, key=lambda s: s.index[0].start)
        assert len(shards) == n
        for r, s in enumerate(shards):
            assert s.device == mesh.devices.flat[r]
            assert s.data.shape == (el, *host.shape[1:])
            assert (np.asarray(s.data) == np.asarray(host[r * el : (r + 1) * el])).all()
    if fp8:
        assert isinstance(dev_experts.gate, Fp8Tensor) and dev_experts.gate.w.dtype == experts.gate.w.dtype
    assert st.expert_bytes_by_rank() == {
        r: _expert_leaf_bytes(experts, r * el, (r + 1) * el) for r in range(n)
    }


def test_dist_prefill_rejects_bad_input():
    params = _case(False)[0]
    mesh = make_mesh(2)
    with pytest.raises(ValueError, match="token ids must be in \\[0, 512\\)"):
        dist_prefill(params, CFG, np.array([[1, 512]]), mesh)
    with pytest.raises(ValueError, match="tokens must be \\[B, T\\]"):
        dist_prefill(params, CFG, np.array([1, 2]), mesh)
    with pytest.raises(ValueError, match="moe_scheme 'x'"):
        dist_prefill(params, CFG, np.array([[1, 2]]), mesh, moe_scheme="x")
    with pytest.raises(ValueError, match="max_len=1 is shorter than the prompt"):
        dist_prefill(params, CFG, np.array([[1, 2]]), mesh, max_len=1)
    with pytest.raises(RuntimeError, match="dropped .* pairs in layer 1"):
        dist_prefill(params, CFG, np.arange(T)[None], mesh, moe_scheme="ep", ep_capacity=1)
