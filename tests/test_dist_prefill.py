"""Distributed prefill through the engine (schedules `dslp` = CP attention + SmallEP, `ep` =
CP attention + standard EP; weights streamed per rank) vs the single-device reference
forward, on 1, 2 and 4 stand-in devices, f32 and FP8: full-sequence logits, the decode
cache, the greedy continuation from the distributed prefill, and the per-rank weight
traffic (each rank receives only its own experts).

Tolerance as in test_dist_ops.py (reordered f32 sums): 1e-5 * max|ref|. Greedy tokens
must be identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.engine.engine import Engine
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.model import forward, forward_nocache, init_cache
from hmoe_jax.model.params import MoEParams
from hmoe_jax.parallel.mesh import make_mesh
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.quant.fp8 import Fp8Tensor
from hmoe_jax.runtime.dist_stream import RankStreamer
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import assert_close, model_config

# 3 layers (1 dense, 2 MoE) keep the reference compile short.
CFG = model_config("deepseek_v3_tiny", num_hidden_layers=3, first_k_dense_replace=1)
CFG_F32 = dataclasses.replace(CFG, quant=None)  # plans size ring slots from cfg.quant


def _expert_leaf_bytes(experts, lo, hi) -> int:
    return sum(int(np.asarray(x[lo:hi]).nbytes) for x in jax.tree_util.tree_leaves(experts))


# One prompt length for every case, so each compiled program (reference and distributed) is
# reused across cases: 13 is a multiple of 2N for no N, so every case pads and masks.
T, NEW, MAX_LEN = 13, 8, 64  # MAX_LEN: greedy_rollout()'s cache bucket for T + NEW


@functools.cache
def _case(fp8: bool):
    params = random_params(CFG, seed=4, fp8=fp8)
    prompt = np.random.default_rng(9).integers(2, CFG.vocab_size, T).tolist()
    logits, cache = forward(params, CFG, np.asarray([prompt]), init_cache(CFG, 1, MAX_LEN), 0)
    return params, prompt, logits, cache


@functools.cache
def _engine(fp8: bool, n: int) -> Engine:
    # experts_ref on the host: the reference rollout uses it too (the FFI op rounds to bf16).
    cfg = CFG if fp8 else CFG_F32
    return Engine(
        _case(fp8)[0], cfg, devices=n, system=SystemSpec(num_accelerators=n), expert_fn="ref", precision="f32"
    )


CASES = [
    ("smallep", False, 1),
    ("smallep", False, 2),
    ("smallep", False, 4),
    ("ep", False, 4),
    ("smallep", True, 4),
    ("ep", True, 2),
]
SCHEDULE = {"smallep": "dslp", "ep": "ep"}


@pytest.mark.parametrize("scheme,fp8,n", CASES)
def test_dist_prefill_matches_reference(scheme, fp8, n):
    params, prompt, ref_logits, ref_cache = _case(fp8)
    eng = _engine(fp8, n)
    cache = eng.new_cache(MAX_LEN)
    logits, run, _, plan = eng.prefill(np.asarray(prompt), cache, SCHEDULE[scheme], all_logits=True)
    assert plan.meta["devices"] == n and plan.meta["moe_scheme"] == scheme

    assert_close(logits[None], ref_logits, f"{plan.schedule} logits N={n} T={T} fp8={fp8}")
    kv = cache.to_kvcache()
    assert_close(kv.latent, ref_cache.latent, "latent cache")
    assert_close(kv.k_rope, ref_cache.k_rope, "k_rope cache")
    assert not np.asarray(kv.latent)[:, :, T:].any(), "pad / unused cache slots must be zero"

    # Each rank received exactly its own experts' bytes, once per MoE layer, and nothing else.
    st = run.dslp
    el = CFG.n_routed_experts // n
    for i, layer in enumerate(params.layers):
        recs = [r for r in st.streamer.log if r.layer == i and r.what == "experts"]
        if not isinstance(layer.ffn, MoEParams):
            assert recs == []
            continue
        assert sorted(r.rank for r in recs) == list(range(n))
        for r in recs:
            assert r.experts == (r.rank * el, (r.rank + 1) * el)
            assert r.bytes == _expert_leaf_bytes(layer.ffn.experts, *r.experts)

    assert len(st.comm) == CFG.num_hidden_layers - CFG.first_k_dense_replace
    assert all(c["moe"]["scheme"] == scheme for c in st.comm)
    if n == 1:
        assert all(c["moe"]["total_bytes"] == 0 for c in st.comm)


@pytest.mark.parametrize("scheme,fp8,n", [("smallep", False, 2), ("ep", True, 2)])
def test_greedy_continuation_after_dist_prefill(scheme, fp8, n):
    params, prompt, *_ = _case(fp8)
    ref = greedy_rollout(params, CFG, prompt, NEW)
    got = _engine(fp8, n).generate(prompt, NEW, schedule=SCHEDULE[scheme], stop_ids=())
    assert got.schedule == SCHEDULE[scheme]
    assert got.tokens == ref
    # and the teacher-forced argmax of the whole rollout agrees (decode-consistency)
    full = np.asarray(forward_nocache(params, CFG, jnp.asarray([prompt + ref[:-1]])))[0]
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == ref


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
    eng = _engine(False, 2)
    with pytest.raises(ValueError, match="token id 512 out of range \\[0, 512\\)"):
        eng.generate([1, 512], 1, schedule="dslp")
    with pytest.raises(RuntimeError, match="dropped .* pairs in layer 1"):
        eng.prefill(np.arange(T), eng.new_cache(MAX_LEN), "ep", ep_capacity=1)
