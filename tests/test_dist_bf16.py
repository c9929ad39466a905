"""dslp under the bf16 precision policy (parallel/ with model/precision.py), and the CP
walk's static key-block counts.

- The engine's bf16 dslp prefill (2 stand-in ranks, FP8 tiny model, the stand-in's bf16
  policy) against the single-device f32 reference: logits within a bf16-derived bound,
  greedy tokens equal.
- SmallEP with the GPU policy's FP8 hooks as their `_ref` twins (kernels.fp8_gemm:
  fp8_linear_ref, fp8_grouped_linear_ref: e4m3 activations per 128 channels, grouped
  expert GEMMs) against the f32 moe_block reference, and its payloads in bf16.
- plan.costs.cp_key_blocks against a brute-force count of the key blocks each rank's
  query blocks need (exhaustive over small layouts).

Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9); e4m3 activations keep 4
(2^-4 per element, averaged over K-long sums). Hidden states pass ~10 rounded ops per
layer; we allow 2^-4 of max|ref| for bf16 logits and 2^-3 for the MoE output with e4m3
activations (observed 5.1e-2; 5.0e-3 under the stand-in's bf16 policy), both far above f32
rounding and far below an error that changes a result's structure (a wrong expert or a
dropped pair is O(1)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hmoe_jax.engine.engine import Engine
from hmoe_jax.kernels.fp8_gemm import fp8_grouped_linear_ref, fp8_linear_ref
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.model import forward, init_cache
from hmoe_jax.model.moe import experts_ref, moe_block
from hmoe_jax.model.params import MoEParams
from hmoe_jax.model.precision import BF16_CPU
from hmoe_jax.parallel.mesh import AXIS, make_mesh
from hmoe_jax.parallel.moe import grouped_experts_fn, smallep_moe
from hmoe_jax.plan.costs import cp_key_blocks
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import model_config

CFG = model_config("deepseek_v3_tiny", num_hidden_layers=3, first_k_dense_replace=1)
T, NEW, MAX_LEN = 13, 6, 64
# the GPU policy's hooks, as their jittable reference twins (XLA:CPU runs f32 dots)
GPU_LIKE = dataclasses.replace(BF16_CPU, fp8_matmul=fp8_linear_ref, fp8_grouped_matmul=fp8_grouped_linear_ref)


def _rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@functools.cache
def _case():
    params = random_params(CFG, seed=4, fp8=True)
    prompt = np.random.default_rng(9).integers(2, CFG.vocab_size, T).tolist()
    logits, _ = forward(params, CFG, np.asarray([prompt]), init_cache(CFG, 1, MAX_LEN), 0)
    return params, prompt, np.asarray(logits)[0]


def test_bf16_dslp_prefill_matches_f32_reference_and_greedy_tokens():
    params, prompt, ref_logits = _case()
    eng = Engine(
        params, CFG, devices=2, system=SystemSpec(num_accelerators=2), expert_fn="ref", precision="bf16"
    )
    assert eng.prec.name == "bf16"
    logits, run, _, plan = eng.prefill(np.asarray(prompt), eng.new_cache(MAX_LEN), "dslp", all_logits=True)
    assert plan.meta["compute_dtype"] == "bf16" and plan.meta["precision"] == "bf16"
    err = _rel_err(logits, ref_logits)
    assert 0 < err <= 2**-4, f"bf16 dslp logits: max |err| / max |ref| = {err:.3g}"
    # the MoE payloads were counted in the activation dtype: each of the 2 ranks receives
    # the other's T_pad / 2 rows of D bf16 values
    lay = ZigzagLayout.for_sequence(T, 2)
    want = 2 * (lay.padded_len // 2) * CFG.hidden_size * 2
    assert all(c["moe"]["all_gather_bytes"] == want for c in run.dslp.comm)
    got = eng.generate(prompt, NEW, schedule="dslp", stop_ids=())
    assert got.tokens == greedy_rollout(params, CFG, prompt, NEW)


@pytest.mark.parametrize("prec_name", ["gpu_hooks", "bf16_cpu"])
def test_smallep_under_bf16_policy_matches_f32_moe_block(prec_name):
    prec = GPU_LIKE if prec_name == "gpu_hooks" else BF16_CPU
    n, t = 2, 24
    moe = jax.tree.map(jnp.asarray, random_params(CFG, seed=2, fp8=True).layers[1].ffn)
    x = np.random.default_rng(5).standard_normal((t, CFG.hidden_size)).astype(np.float32)
    x_bf = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # the same input, rounded
    ref = moe_block(moe, CFG, jnp.asarray(x_bf), experts_ref)
    fn = (
        grouped_experts_fn(None, 8192, prec) if prec.fp8_grouped_matmul else grouped_experts_fn(2, 8192, prec)
    )
    specs = MoEParams(
        router=P(), router_bias=P(), experts=jax.tree.map(lambda _: P(AXIS), moe.experts), shared=P()
    )
    f = jax.jit(
        jax.shard_map(
            lambda m, xs: smallep_moe(m, CFG, xs, axis=AXIS, n_ranks=n, expert_fn=fn, prec=prec)[0],
            mesh=make_mesh(n),
            in_specs=(specs, P(AXIS)),
            out_specs=P(AXIS),
        )
    )
    lowered = f.lower(moe, jnp.asarray(x_bf, jnp.bfloat16)).as_text()
    # the collectives carry bf16 (no f32 payload crosses a link)
    for op in ("all_gather", "reduce_scatter"):
        lines = [ln for ln in lowered.splitlines() if f"stablehlo.{op}" in ln or f'"stablehlo.{op}"' in ln]
        assert lines and all("f32" not in ln.split("->")[-1] for ln in lines), (op, lines[:2])
    out = f(moe, jnp.asarray(x_bf, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    err = _rel_err(out, ref)
    assert 0 < err <= 2**-3, f"SmallEP {prec_name}: max |err| / max |ref| = {err:.3g}"


def _needed_key_blocks(chunk: int, ranks: int, b: int, rank: int) -> list[int]:
    """Brute force: for query block i of each of the rank's chunks, the key blocks holding
    any key at or before one of the block's positions (positions past the chunk are pads
    the walk also covers); summed over the rank's two chunks."""
    n_kb = -(-2 * ranks * chunk // b)
    out = []
    for i in range(-(-chunk // b)):
        total = 0
        for c in (rank, 2 * ranks - 1 - rank):
            last = c * chunk + (i + 1) * b - 1  # the block's last (possibly padded) position
            total += min(n_kb, sum(1 for kb in range(n_kb) if kb * b <= last))
        out.append(total)
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_cp_key_blocks_cover_every_rank_and_are_exact_when_blocks_divide_chunks(ranks):
    for chunk in range(1, 25):
        for b in range(1, chunk + 1):
            trips = cp_key_blocks(chunk, ranks, b)
            need = [_needed_key_blocks(chunk, ranks, b, r) for r in range(ranks)]
            for r in range(ranks):
                assert all(t >= nd for t, nd in zip(trips, need[r], strict=True)), (
                    chunk,
                    b,
                    r,
                    trips,
                    need[r],
                )
            if chunk % b == 0:  # zig-zag balance: every rank needs exactly the trip count
                assert all(nd == trips for nd in need), (chunk, b, trips, need)
