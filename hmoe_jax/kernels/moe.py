"""Fused routed-MoE CPU op (`hmoe_moe_experts`, xla_ffi/src/moe_*.cc) and its reference.

`moe_experts(x, ids, weights, experts)` is a drop-in `ExpertFn` (hmoe_jax.model.moe): it
returns sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], for one
layer's stacked routed experts in DeepSeek block-FP8 (Fp8Tensor) or our INT4
(hmoe_jax.quant.int4.Int4Tensor). The op receives the whole layer's arrays plus the ids,
so no expert weight is sliced or copied per call (pass host arrays that are 64-byte
aligned, see hmoe_jax.kernels.gemm.device_put_zero_copy, for XLA to hand them over without a copy).

Numerics (both schedules, every ISA path): x is rounded to bf16 once, silu(g) * u is
rounded to bf16 before the down projection, products are exact in f32 and summed in f32
per 128-block (FP8) / group (INT4), block scales applied after each block's sum, the k
expert outputs are combined in f32 in slot order j = 0..k-1. `moe_experts_ref` with
`bf16_activations=True` (default) models exactly those roundings, so f32 summation order
separates the two, plus the occasional bf16 rounding flip of an h element that this order
(or exp's last ulp) pushes across a rounding boundary (tests/test_kernels_moe.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.kernels import ffi
from hmoe_jax.model.params import ExpertsParams
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize

_TARGET = "hmoe_moe_experts"
_SCHEDULES = {"fine": 0, "coarse": 1}
_ISAS = {"portable": 0, "avx2": 1, "avx512": 2}  # the ISAs with kernels (no AMX kernel)
_FP8, _INT4 = 0, 1
STATS_LEN = 13  # xla_ffi/src/moe_ffi.cc, enum Stat
STAT_NAMES = (
    "ptr_gate_w",
    "ptr_up_w",
    "ptr_down_w",
    "ptr_gate_scale",
    "ptr_up_scale",
    "ptr_down_scale",
    "active_experts",
    "active_weight_bytes",
    "isa",
    "threads",
    "queues",  # task queues: numa_nodes (fine) or 1 (coarse)
    "node0_experts",  # active experts owned by NUMA node 0
    "tasks",  # gate/up + down tasks of the plan
)


def _int4_types() -> tuple[type, ...]:
    try:
        from hmoe_jax.quant.int4 import Int4Tensor
    except ImportError:  # the INT4 format module is optional for FP8-only use
        return ()
    return (Int4Tensor,)


def _arrays(t: Any, name: str) -> tuple[int, Any, Any, int]:
    """(format, values, scales, group_size) of one stacked weight; errors name the operand."""
    if isinstance(t, Fp8Tensor):
        if (t.block_n, t.block_k) != (128, 128):
            raise ValueError(f"experts.{name}: FP8 blocks must be 128x128, got {t.block_n}x{t.block_k}")
        return _FP8, t.w, t.scale_inv, 0
    int4 = _int4_types()
    if int4 and isinstance(t, int4):
        return _INT4, t.q, t.scale, int(t.group)
    raise TypeError(f"experts.{name}: expected Fp8Tensor or Int4Tensor, got {type(t).__name__}")


def _check(x: Any, ids: Any, weights: Any, experts: ExpertsParams) -> list[tuple[int, Any, Any, int]]:
    if x.ndim != 2:
        raise ValueError(f"moe_experts: x must be [M, D], got shape {tuple(x.shape)}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"moe_experts: x must be float32 or bfloat16, got {x.dtype}")
    m, d = x.shape
    if ids.ndim != 2 or ids.shape[0] != m:
        raise ValueError(f"moe_experts: ids must be [M={m}, k], got shape {tuple(ids.shape)}")
    if ids.dtype != jnp.int32:
        raise TypeError(f"moe_experts: ids must be int32, got {ids.dtype}")
    if tuple(weights.shape) != tuple(ids.shape) or weights.dtype != jnp.float32:
        raise ValueError(
            f"moe_experts: weights must be float32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}"
        )
    parts = [_arrays(getattr(experts, n), n) for n in ("gate", "up", "down")]
    if len({p[0] for p in parts}) != 1:
        raise TypeError("moe_experts: experts.gate/up/down must share one format (all FP8 or all INT4)")
    e, i, dg = experts.gate.shape
    want = {"gate": (e, i, d), "up": (e, i, d), "down": (e, d, i)}
    for n in want:
        got = tuple(getattr(experts, n).shape)
        if got != want[n]:
            raise ValueError(f"moe_experts: experts.{n} must be {want[n]} for x [M, {d}], got {got}")
    if not isinstance(ids, jax.core.Tracer):
        ids_np = np.asarray(ids)
        bad = (ids_np < 0) | (ids_np >= e)
        if bad.any():
            t, j = map(int, np.argwhere(bad)[0])
            raise ValueError(f"moe_experts: ids[{t}, {j}] = {int(ids_np[t, j])} is out of range [0, {e})")
    return parts


def _call(x, ids, weights, experts, schedule, numa_nodes, max_isa, num_threads, gate_up_slice, down_slice):
    ffi.register_all()
    if schedule not in _SCHEDULES:
        raise ValueError(f"moe_experts: schedule must be one of {sorted(_SCHEDULES)}, got {schedule!r}")
    if isinstance(max_isa, str) and max_isa not in _ISAS:
        raise ValueError(
            f"moe_experts: max_isa must be None, an int or one of {sorted(_ISAS)}, got {max_isa!r}"
        )
    parts = _check(x, ids, weights, experts)
    m, d = x.shape
    operands = [x, ids, weights]
    for _, values, scales, _ in parts:
        # FP8 values travel as float8_e4m3fn or as their uint8 bits; never bitcast here
        # (a bitcast inside jit copies the whole stack: shared/NOTES.md).
        operands += [values, scales]
    out_types = (
        jax.ShapeDtypeStruct((m, d), jnp.float32),
        jax.ShapeDtypeStruct((2 * STATS_LEN,), jnp.int32),  # int64 stats as lo/hi words (x64 off)
    )
    call = jax.ffi.ffi_call(_TARGET, out_types)
    y, stats = call(
        *operands,
        weight_format=np.int64(parts[0][0]),
        group_size=np.int64(parts[0][3]),
        schedule=np.int64(_SCHEDULES[schedule]),
        numa_nodes=np.int64(numa_nodes),
        max_isa=np.int64(-1 if max_isa is None else _ISAS.get(max_isa, max_isa)),
        num_threads=np.int64(num_threads),
        gate_up_slice=np.int64(gate_up_slice),
        down_slice=np.int64(down_slice),
    )
    return y, stats


def moe_experts(
    x: jax.Array,  # [M, D] f32 | bf16
    ids: jax.Array,  # [M, k] int32
    weights: jax.Array,  # [M, k] f32
    experts: ExpertsParams,
    *,
    schedule: str = "fine",
    numa_nodes: int = 1,
    max_isa: str | int | None = None,
    num_threads: int = 0,
    gate_up_slice: int = 128,
    down_slice: int = 256,
) -> jax.Array:  # [M, D] f32
    """Routed experts of one layer on the CPU through the fused FFI op (usable under jit).

    schedule: "fine" (tasks per (expert, output slice), per-expert barriers) or "coarse"
    (one task per expert and phase, global barriers: the ablation baseline).
    numa_nodes: split experts (contiguous id blocks) and threads into this many groups.
    max_isa: cap the kernel path ("portable", "avx2", "avx512"); None = best available.
    num_threads: threads of our pool to use (0 = all; HMOE_NUM_THREADS sizes the pool).
    gate_up_slice (multiple of 64) / down_slice: output columns per task (fine schedule).
    """
    y, _ = _call(
        x, ids, weights, experts, schedule, numa_nodes, max_isa, num_threads, gate_up_slice, down_slice
    )
    return y


def moe_experts_raw(x, ids, weights, experts, **kw) -> tuple[jax.Array, jax.Array]:
    """Traceable (y [M, D] f32, raw stats [2 * STATS_LEN] int32); decode with decode_stats."""
    opts = dict(schedule="fine", numa_nodes=1, max_isa=None, num_threads=0, gate_up_slice=128, down_slice=256)
    opts.update(kw)
    return _call(x, ids, weights, experts, **opts)


def decode_stats(raw: Any) -> dict[str, int]:
    """The op's stats: the weight buffer addresses XLA handed the handler (the zero-copy
    check: they equal the arrays' own addresses), active experts, their bytes, ISA, threads."""
    words = np.asarray(raw).astype(np.int64).reshape(STATS_LEN, 2)
    vals = (words[:, 0] & 0xFFFFFFFF) | (words[:, 1] << 32)
    return dict(zip(STAT_NAMES, (int(v) for v in vals)))


def moe_experts_with_stats(x, ids, weights, experts, **kw) -> tuple[jax.Array, dict[str, int]]:
    """moe_experts (eagerly) plus decode_stats of the same call."""
    y, raw = moe_experts_raw(x, ids, weights, experts, **kw)
    return y, decode_stats(raw)


# ---- reference ----------------------------------------------------------------------


def _dequant(t: Any) -> jax.Array:
    if isinstance(t, Fp8Tensor):
        return dequantize(t, jnp.float32)
    int4 = _int4_types()
    if int4 and isinstance(t, int4):
        from hmoe_jax.quant.int4 import dequantize_int4

        return dequantize_int4(t, jnp.float32)
    return jnp.asarray(t, jnp.float32)


def _round_bf16(v: jax.Array) -> jax.Array:
    return v.astype(jnp.bfloat16).astype(jnp.float32)


def moe_experts_ref(
    x: jax.Array,  # [M, D]
    ids: jax.Array,  # [M, k] int32
    weights: jax.Array,  # [M, k] f32
    experts: ExpertsParams,
    *,
    bf16_activations: bool = True,
) -> jax.Array:  # [M, D] f32
    """Plain-JAX twin of moe_experts: dequantize, every expert on every token (dense, for
    small shapes), f32 at HIGHEST precision, combined with C[t, e] = sum_j w[t, j] [ids[t, j]
    == e]. With bf16_activations it rounds x and silu(g) * u to bf16 like the op."""
    hi = jax.lax.Precision.HIGHEST
    gate, up, down = (_dequant(t) for t in (experts.gate, experts.up, experts.down))
    xa = jnp.asarray(x).astype(jnp.float32)  # [M, D]
    if bf16_activations:
        xa = _round_bf16(xa)
    g = jnp.einsum("td,eid->tei", xa, gate, precision=hi)  # [M, E, I]
    u = jnp.einsum("td,eid->tei", xa, up, precision=hi)
    h = g / (1.0 + jnp.exp(-g)) * u
    if bf16_activations:
        h = _round_bf16(h)
    o = jnp.einsum("tei,edi->ted", h, down, precision=hi)  # [M, E, D]
    m, e = xa.shape[0], gate.shape[0]
    c = jnp.zeros((m, e), jnp.float32).at[jnp.arange(m)[:, None], ids].add(weights)  # [M, E]
    return jnp.einsum("te,ted->td", c, o, precision=hi)


def bf16_dot_peak_flops(num_threads: int = 0, iters: int = 20_000_000, repeats: int = 3) -> float:
    """Measured bf16 dot-product peak (FLOP/s) of this machine: register-resident vdpbf16ps
    chains on `num_threads` threads of our pool (xla_ffi/src/moe_peak*.cc), best of
    `repeats` (a neighbour's load only ever lowers it). RuntimeError without AVX-512-BF16."""
    ffi.register_all()
    if not ffi.cpu_features()["avx512"]:
        raise RuntimeError("bf16_dot_peak_flops needs AVX-512-BF16, which this CPU lacks")
    call = jax.ffi.ffi_call(
        "hmoe_bf16_dot_peak", jax.ShapeDtypeStruct((2,), jnp.float32), has_side_effect=True
    )
    return max(
        float(np.asarray(call(iters=np.int64(iters), num_threads=np.int64(num_threads)))[0])
        for _ in range(repeats)
    )


def fma_peak_flops(num_threads: int = 0, iters: int = 20_000_000, repeats: int = 3) -> float:
    """Measured f32 FMA peak (FLOP/s) of this machine: register-resident 8-lane vfmadd chains
    on `num_threads` threads of our pool (xla_ffi/src/moe_peak*.cc), best of `repeats`. The
    compute probe on CPUs without AVX-512-BF16. RuntimeError without AVX2 + FMA."""
    ffi.register_all()
    if not ffi.cpu_features()["avx2"]:
        raise RuntimeError("fma_peak_flops needs AVX2 + FMA, which this CPU lacks")
    call = jax.ffi.ffi_call("hmoe_fma_peak", jax.ShapeDtypeStruct((2,), jnp.float32), has_side_effect=True)
    return max(
        float(np.asarray(call(iters=np.int64(iters), num_threads=np.int64(num_threads)))[0])
        for _ in range(repeats)
    )
