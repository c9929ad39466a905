"""The fused routed-MoE CPU op (hmoe_jax.kernels.moe) against its plain-JAX reference.

Tolerances. The op rounds x and silu(g) * u to bf16 and sums in f32; moe_experts_ref with
bf16_activations=True does the same roundings, so what is left is f32 summation order
(per 128-block / group, then blocks, then k slots; and exp() inside silu) plus the rare
bf16 rounding flip of an h element whose f32 value sits on a rounding boundary: one flip
moves that element by one bf16 ulp (2^-8 relative), up to ~2e-4 of max |y| at these shapes
(observed: summation order alone < 3e-5 of max |y|, one flip 1.6e-4). TOL_BF16_REF = 5e-4
allows a few flips and stays well below the effect of the bf16 activations themselves,
which the pure-f32 reference shows (observed 2e-3 to 3.5e-3; we require 0 < err < 1e-2).
Schedules (fine / coarse / NUMA splits / thread counts) run the same kernel calls on the
same rows with column slices aligned to the kernels' tiles, and combine in the same slot
order, so they are compared bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.kernels import ffi

try:
    ffi.register_all()
except ffi.FfiUnavailable as e:  # pragma: no cover - the build is part of the test setup
    pytest.skip(f"_hmoe_ffi not built: {e}", allow_module_level=True)

from hmoe_jax.kernels.gemm import device_put_zero_copy  # noqa: E402
from hmoe_jax.kernels.moe import (  # noqa: E402
    decode_stats,
    moe_experts,
    moe_experts_raw,
    moe_experts_ref,
    moe_experts_with_stats,
)
from hmoe_jax.model.params import ExpertsParams  # noqa: E402
from hmoe_jax.quant.fp8 import Fp8Tensor, quantize_np  # noqa: E402
from hmoe_jax.quant.int4 import quantize_int4_np  # noqa: E402

# D = 384 (3 FP8 blocks), INTER = 192: a partial 64-row FP8 block in the down projection's K
# and in gate/up's N; both multiples of the INT4 group (64).
E, INTER, D = 8, 192, 384
SLICES = dict(gate_up_slice=64, down_slice=128)  # several tasks per expert at these shapes
RNG = np.random.default_rng(1234)
TOL_BF16_REF = 5e-4  # see the module docstring


def _experts(fmt: str, seed: int = 0) -> ExpertsParams:
    rng = np.random.default_rng(seed)

    def mat(*shape):
        w = rng.standard_normal(shape).astype(np.float32) * 0.05
        return quantize_np(w) if fmt == "fp8" else quantize_int4_np(w, group=64)

    return ExpertsParams(gate=mat(E, INTER, D), up=mat(E, INTER, D), down=mat(E, D, INTER))


@pytest.fixture(scope="module", params=["fp8", "int4"])
def experts(request):
    return request.param, _experts(request.param)


def _routing(m: int, k: int, rng=RNG):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).astype(np.int32)
    w = rng.random((m, k)).astype(np.float32)
    x = rng.standard_normal((m, D)).astype(np.float32)
    return x, ids, w


def _rel_err(y, ref) -> float:
    return float(np.abs(np.asarray(y) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max())


@pytest.mark.parametrize("m,k", [(1, 8), (2, 1), (4, 3), (6, 8), (64, 2)])
def test_matches_ref(experts, m, k):
    _, ex = experts
    x, ids, w = _routing(m, k)
    y = moe_experts(x, ids, w, ex, **SLICES)
    ref = moe_experts_ref(x, ids, w, ex)
    assert y.shape == (m, D) and y.dtype == jnp.float32
    assert _rel_err(y, ref) < TOL_BF16_REF
    if m >= 4:  # tokens share experts: each active expert serves several rows
        assert len(np.unique(ids)) < ids.size


def test_every_k_and_f32_reference(experts):
    _, ex = experts
    for k in range(1, 9):
        x, ids, w = _routing(3, k)
        y = np.asarray(moe_experts(x, ids, w, ex, **SLICES))
        assert _rel_err(y, moe_experts_ref(x, ids, w, ex)) < TOL_BF16_REF, k
        err_f32 = _rel_err(y, moe_experts_ref(x, ids, w, ex, bf16_activations=False))
        assert 0 < err_f32 < 1e-2, k  # bf16 activations are visible, and small


def test_repeated_expert_within_a_token(experts):
    _, ex = experts
    x, _, w = _routing(5, 4)
    ids = np.array([[3, 3, 1, 3]] * 5, np.int32)  # one expert twice+ in a row, all tokens alike
    assert _rel_err(moe_experts(x, ids, w, ex, **SLICES), moe_experts_ref(x, ids, w, ex)) < TOL_BF16_REF


@pytest.mark.parametrize("m", [1, 6, 64])
def test_schedules_identical(experts, m):
    _, ex = experts
    x, ids, w = _routing(m, 8 if m < 64 else 3)
    base = np.asarray(moe_experts(x, ids, w, ex, **SLICES))
    variants = [
        dict(schedule="coarse"),
        dict(numa_nodes=2, **SLICES),
        dict(numa_nodes=3, **SLICES),  # more nodes than threads: idle nodes' work is stolen
        dict(numa_nodes=2, num_threads=1, **SLICES),
        dict(num_threads=1, gate_up_slice=128, down_slice=384),
    ]
    for kw in variants:
        np.testing.assert_array_equal(np.asarray(moe_experts(x, ids, w, ex, **kw)), base, err_msg=str(kw))


def test_plan_shape_follows_schedule_and_numa_split():
    """The identical outputs above are not because the options were ignored: the plan
    really has per-node queues, expert ownership by contiguous id blocks, and the task
    counts of each schedule."""
    ex = _experts("fp8")
    x, _, w = _routing(2, 4)
    ids = np.array([[0, 1, 5, 6], [1, 2, 6, 7]], np.int32)  # experts 0, 1, 2 | 5, 6, 7
    n_active, gu_tasks, down_tasks = 6, -(-INTER // 64), -(-D // 128)
    _, fine = moe_experts_with_stats(x, ids, w, ex, numa_nodes=2, **SLICES)
    assert (fine["queues"], fine["node0_experts"]) == (2, 3)
    assert fine["tasks"] == n_active * (gu_tasks + down_tasks)
    _, one = moe_experts_with_stats(x, ids, w, ex, **SLICES)
    assert (one["queues"], one["node0_experts"]) == (1, n_active)
    _, coarse = moe_experts_with_stats(x, ids, w, ex, schedule="coarse", numa_nodes=2)
    assert (coarse["queues"], coarse["tasks"]) == (1, 2 * n_active)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_forced_isa_paths(experts, isa):
    fmt, ex = experts
    feats = ffi.cpu_features()
    if isa != "portable" and not feats[isa]:
        pytest.skip(f"this CPU has no {isa}")
    x, ids, w = _routing(6, 4)
    y, stats = moe_experts_with_stats(x, ids, w, ex, max_isa=isa, **SLICES)
    assert stats["isa"] == {"portable": 0, "avx2": 1, "avx512": 2}[isa]
    assert _rel_err(y, moe_experts_ref(x, ids, w, ex)) < TOL_BF16_REF, (fmt, isa)


def test_bf16_input_and_uint8_fp8_bits():
    ex = _experts("fp8", seed=3)
    x, ids, w = _routing(4, 3)
    xb = x.astype(ml_dtypes.bfloat16)
    y_f32 = np.asarray(moe_experts(xb.astype(np.float32), ids, w, ex, **SLICES))
    np.testing.assert_array_equal(np.asarray(moe_experts(jnp.asarray(xb), ids, w, ex, **SLICES)), y_f32)
    as_u8 = lambda t: Fp8Tensor(w=np.asarray(t.w).view(np.uint8), scale_inv=t.scale_inv)
    ex_u8 = ExpertsParams(gate=as_u8(ex.gate), up=as_u8(ex.up), down=as_u8(ex.down))
    np.testing.assert_array_equal(
        np.asarray(moe_experts(xb.astype(np.float32), ids, w, ex_u8, **SLICES)), y_f32
    )


def test_under_jit_and_repeated_calls_are_stable(experts):
    _, ex = experts
    f = jax.jit(lambda x, i, w, e: moe_experts(x, i, w, e, **SLICES))
    x, ids, w = _routing(4, 4)
    first = np.asarray(f(x, ids, w, ex))
    assert _rel_err(first, moe_experts_ref(x, ids, w, ex)) < TOL_BF16_REF
    for _ in range(50):  # the pool's region hand-off, back to back (spinning workers)
        np.testing.assert_array_equal(np.asarray(f(x, ids, w, ex)), first)


_PTR_KEYS = ["ptr_gate_w", "ptr_gate_scale", "ptr_up_w", "ptr_up_scale", "ptr_down_w", "ptr_down_scale"]


def test_concurrent_callers_get_their_own_results():
    """Two Python threads calling the op at once (XLA may also run two calls concurrently):
    the pool serialises regions and the scratch is locked, so each gets its exact result."""
    import threading

    ex = _experts("int4", seed=9)
    cases = [_routing(m, 4) for m in (3, 5)]
    want = [np.asarray(moe_experts(*c, ex, **SLICES)) for c in cases]
    bad = []

    def worker(i):
        for _ in range(20):
            if not np.array_equal(np.asarray(moe_experts(*cases[i], ex, **SLICES)), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def _host_leaves(ex: ExpertsParams) -> list[np.ndarray]:
    return [np.asarray(a) for t in (ex.gate, ex.up, ex.down) for a in (t.w, t.scale_inv)]


def _with_leaves(leaves: list) -> ExpertsParams:
    g, gs, u, us, d, ds = leaves
    return ExpertsParams(
        gate=Fp8Tensor(w=g, scale_inv=gs), up=Fp8Tensor(w=u, scale_inv=us), down=Fp8Tensor(w=d, scale_inv=ds)
    )


def _bytes_copied(host: list[np.ndarray], stats: dict[str, int]) -> int:
    """Weight bytes the handler did NOT see at their host address (i.e. XLA copied them)."""
    return sum(a.nbytes for a, key in zip(host, _PTR_KEYS) if stats[key] != a.ctypes.data)


def _offset_copy(a: np.ndarray, offset: int) -> np.ndarray:
    raw = np.empty(a.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_zero_bytes_copied_per_call():
    """64-byte-aligned host arrays reach the handler at their own address, eagerly and
    under jit, as device_put arrays and as plain numpy: 0 weight bytes copied per call."""
    host = [_offset_copy(a, 0) for a in _host_leaves(_experts("fp8", seed=5))]
    as_jax = _with_leaves([device_put_zero_copy(a) for a in host])
    as_np = _with_leaves(host)
    x, ids, w = _routing(2, 4)
    f = jax.jit(lambda x, i, w, e: moe_experts_raw(x, i, w, e, **SLICES))
    for ex in (as_jax, as_np):
        for stats in (moe_experts_with_stats(x, ids, w, ex, **SLICES)[1], decode_stats(f(x, ids, w, ex)[1])):
            assert _bytes_copied(host, stats) == 0, stats
            assert stats["active_experts"] == len(np.unique(ids))


def test_zero_copy_check_sees_a_copy():
    """The check can fail: arrays 16 bytes off a 64-byte boundary are copied by XLA, and
    the pointer echo reports every one of their bytes."""
    host = [_offset_copy(a, 16) for a in _host_leaves(_experts("fp8", seed=6))]
    x, ids, w = _routing(1, 2)
    _, stats = moe_experts_with_stats(x, ids, w, _with_leaves(host), **SLICES)
    assert _bytes_copied(host, stats) == sum(a.nbytes for a in host)


def test_bad_inputs_name_the_operand():
    ex = _experts("fp8", seed=7)
    x, ids, w = _routing(2, 3)
    with pytest.raises(ValueError, match=r"ids\[1, 2\] = 8 is out of range \[0, 8\)"):
        moe_experts(x, np.array([[0, 1, 2], [3, 4, 8]], np.int32), w, ex)
    with pytest.raises(TypeError, match="x must be float32 or bfloat16, got int32"):
        moe_experts(x.astype(np.int32), ids, w, ex)
    with pytest.raises(TypeError, match="ids must be int32"):
        moe_experts(x, ids.astype(np.int64), w, ex)
    with pytest.raises(ValueError, match=r"weights must be float32 \(2, 3\)"):
        moe_experts(x, ids, w[:, :2], ex)
    bad_down = ExpertsParams(gate=ex.gate, up=ex.up, down=ex.gate)
    with pytest.raises(ValueError, match=r"experts.down must be \(8, 384, 192\)"):
        moe_experts(x, ids, w, bad_down)
    with pytest.raises(ValueError, match="schedule must be one of"):
        moe_experts(x, ids, w, ex, schedule="global")
    with pytest.raises(TypeError, match="experts.gate: expected Fp8Tensor or Int4Tensor"):
        moe_experts(x, ids, w, ExpertsParams(gate=np.zeros((E, INTER, D)), up=ex.up, down=ex.down))
    # Checked in C++ (traced ids, attributes): the message names the operand too.
    f = jax.jit(lambda i: moe_experts(x, i, w, ex))
    with pytest.raises(Exception, match=r"ids\[0, 1\] = -1 is out of range \[0, 8\)"):
        np.asarray(f(np.array([[0, -1, 2], [3, 4, 5]], np.int32)))
    with pytest.raises(Exception, match="gate_up_slice must be a positive multiple of 64"):
        np.asarray(moe_experts(x, ids, w, ex, gate_up_slice=100))


def test_plugs_into_the_model_as_expert_fn():
    """Tiny DeepSeek-V3 logits with expert_fn=moe_experts vs the model's experts_ref, on the
    same FP8 weights: they differ only by the op's bf16 activations."""
    from hmoe_jax.model.model import forward_nocache
    from hmoe_jax.model.moe import experts_ref
    from tests.hf_ref import build_hf_model, params_from_state, quantized_state, tiny_config

    cfg = tiny_config("deepseek_v3_tiny", num_hidden_layers=2, first_k_dense_replace=1)
    _, state = build_hf_model(cfg, seed=11)
    params = params_from_state(cfg, quantized_state(cfg, state))
    tokens = jnp.asarray(RNG.integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    ref = np.asarray(forward_nocache(params, cfg, tokens, expert_fn=experts_ref))
    out = np.asarray(forward_nocache(params, cfg, tokens, expert_fn=moe_experts))
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert 0 < err < 2e-2, err
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
