"""Block-scaled FP8 GEMMs for the accelerator (Pallas, Triton backend) and their `_ref` twins.

    x_q, x_scale = quantize_act_fp8(x)               # x [M, K] -> e4m3 [M, K], f32 [M, K/128]
    y = fp8_gemm(x_q, x_scale, w)                    # w Fp8Tensor [N, K] -> y [M, N] bf16
    y = fp8_gemm_grouped(x_q, x_scale, w, sizes)     # w Fp8Tensor [E, N, K], rows sorted by expert
    y = fp8_gemm_decode(x_q, x_scale, w)             # M <= 16: the same kernel, a 16-row tile

DeepSeek-V3's format on both sides: weights e4m3 [N, K] with one f32 scale per 128x128 block
(quant/fp8.py's Fp8Tensor, `scale_inv` multiplies), activations quantised on the fly per token
per 128 channels (DeepSeek's inference `act_quant`: s = amax / 448, q = e4m3(x / s)). For each
128-wide K block the kernel takes one e4m3 x e4m3 dot with f32 accumulation (an FP8 tensor-core
MMA on sm_89+), multiplies that partial by x_scale[m, kb] * w_scale[nb, kb] and adds it to an
f32 accumulator; the result is cast to bf16 once. Weight bytes are read as e4m3 tiles straight
from HBM into the MMA: no bf16 copy of a weight exists anywhere, for any M.

Deviation from upstream `act_quant`: an all-zero 128-channel block gets scale 1 (upstream
divides 0 by 0 and writes NaN codes); its codes are zeros either way, so the product is exact 0.

On CPU every kernel runs in Pallas interpret mode (`interpret=True`, what the tests do); on a GPU
`interpret=False` lowers through Pallas' Triton backend (checked without a GPU by exporting for
`platforms=("cuda",)`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from hmoe_jax.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Tensor, dequantize

QBLOCK = 128  # DeepSeek's quantisation block: 128 channels (activations), 128x128 (weights)
DECODE_ROWS = 16  # Triton's tl.dot needs >= 16 rows: decode batches are padded up to this


def _check_act(op: str, x_q: Any, x_scale: Any) -> tuple[int, int]:
    if x_q.ndim != 2:
        raise ValueError(f"{op}: x_q must be [M, K], got shape {tuple(x_q.shape)}")
    if jnp.dtype(x_q.dtype) != jnp.dtype(FP8_DTYPE):
        raise TypeError(f"{op}: x_q dtype must be float8_e4m3fn, got {jnp.dtype(x_q.dtype)}")
    m, k = x_q.shape
    if k % QBLOCK:
        raise ValueError(
            f"{op}: K={k} must be a multiple of {QBLOCK} (one activation scale per 128 channels)"
        )
    if tuple(x_scale.shape) != (m, k // QBLOCK) or jnp.dtype(x_scale.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(
            f"{op}: x_scale must be float32 [{m}, {k // QBLOCK}], got {jnp.dtype(x_scale.dtype)} {tuple(x_scale.shape)}"
        )
    return m, k


def _check_weight(op: str, w: Fp8Tensor, ndim: int, k: int) -> None:
    if not isinstance(w, Fp8Tensor):
        raise TypeError(f"{op}: w must be an Fp8Tensor, got {type(w).__name__}")
    dims = "[E, N, K]" if ndim == 3 else "[N, K]"
    if len(w.w.shape) != ndim:
        raise ValueError(f"{op}: w.w must be {dims}, got shape {tuple(w.w.shape)}")
    if jnp.dtype(w.w.dtype) != jnp.dtype(FP8_DTYPE):
        raise TypeError(f"{op}: w.w dtype must be float8_e4m3fn, got {jnp.dtype(w.w.dtype)}")
    if (w.block_n, w.block_k) != (QBLOCK, QBLOCK):
        raise ValueError(f"{op}: w blocks must be {QBLOCK}x{QBLOCK}, got {w.block_n}x{w.block_k}")
    n, wk = w.w.shape[-2:]
    if wk != k:
        raise ValueError(f"{op}: w.w K={wk} does not match x_q's K={k}")
    if n % QBLOCK:
        raise ValueError(f"{op}: N={n} must be a multiple of {QBLOCK} (whole weight scale blocks per tile)")
    want = (*w.w.shape[:-2], n // QBLOCK, k // QBLOCK)
    if tuple(w.scale_inv.shape) != want:
        raise ValueError(f"{op}: w.scale_inv must be {want}, got {tuple(w.scale_inv.shape)}")


@contextlib.contextmanager
def cuda_lowering_target(device_kind: str = "NVIDIA H100") -> Iterator[None]:
    """Lower Pallas Triton calls for a GPU this process does not have (jax.export with
    platforms=("cuda",) on a CPU box). jax >= 0.11 asks the default device for its compute
    capability and refuses a CPU one; an abstract CUDA device names the target instead.
    jax 0.10 does not ask, and lowers the same way with or without it. The mesh's one axis is
    Auto: jax 0.11 makes a new AbstractMesh's axes Explicit by default, which types every value
    built inside (an iota, a zeros) as sharded and then refuses to mix it with the arguments."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    target = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = AbstractMesh((1,), ("_",), axis_types=(AxisType.Auto,), abstract_device=target)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


# --- activation quantisation ---------------------------------------------------------------


def quantize_act_fp8(x: Any) -> tuple[jax.Array, jax.Array]:
    """x [M, K] f32|bf16 -> (e4m3 [M, K], f32 scale [M, K/128]); x ~= q * scale per block.
    Plain jnp: on a GPU XLA fuses it into one pass over x (a reduction and a cast)."""
    if x.ndim != 2 or x.shape[-1] % QBLOCK:
        raise ValueError(
            f"quantize_act_fp8: x must be [M, K] with K a multiple of {QBLOCK}, got {tuple(x.shape)}"
        )
    m, k = x.shape
    xb = jnp.asarray(x, jnp.float32).reshape(m, k // QBLOCK, QBLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [M, K/128]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    # x / s is within [-448, 448] by construction; the clip only guards the rounding of amax / 448
    q = jnp.clip(xb / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(m, k), scale


def quantize_act_fp8_ref(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Independent numpy twin (ml_dtypes' round-to-nearest-even cast)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // QBLOCK, QBLOCK)
    amax = np.abs(xb).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(xb / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(m, k), scale


# --- the kernel ----------------------------------------------------------------------------


def _block_dot(
    x_ref: Any, xs_ref: Any, w_ref: Any, ws_ref: Any, w_index: Any, n_kb: int, block_m: int
) -> Any:
    """sum over K blocks of (x_blk . w_blk^T) * x_scale * w_scale, f32 [block_m, 128].
    `w_index(kb)` gives the weight tile's ref index (plain or grouped), `ws_ref` is read
    through the same function's scale index."""

    def body(kb: Any, acc: Any) -> Any:
        k0 = pl.multiple_of(kb * QBLOCK, QBLOCK)
        xq = x_ref[:, pl.ds(k0, QBLOCK)]  # [bm, 128] e4m3
        wq = w_ref[w_index(k0)]  # [128, 128] e4m3, N rows of one scale block
        part = jax.lax.dot_general(
            xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [bm, 128] f32
        xs = xs_ref[kb, :]  # [bm] f32 (scales come in K-major so a K block is one row)
        ws = ws_ref[w_index.scale(kb)]  # scalar f32
        return acc + part * (xs[:, None] * ws)

    return jax.lax.fori_loop(0, n_kb, body, jnp.zeros((block_m, QBLOCK), jnp.float32))


class _DenseIndex:
    def __init__(self, n_block: Any) -> None:
        self.n0 = pl.multiple_of(n_block * QBLOCK, QBLOCK)
        self.nb = n_block

    def __call__(self, k0: Any) -> Any:
        return (pl.ds(self.n0, QBLOCK), pl.ds(k0, QBLOCK))

    def scale(self, kb: Any) -> Any:
        return (self.nb, kb)


class _GroupIndex(_DenseIndex):
    def __init__(self, group: Any, n_block: Any) -> None:
        super().__init__(n_block)
        self.g = group

    def __call__(self, k0: Any) -> Any:
        return (self.g, pl.ds(self.n0, QBLOCK), pl.ds(k0, QBLOCK))

    def scale(self, kb: Any) -> Any:
        return (self.g, self.nb, kb)


def _dense_kernel(
    x_ref: Any, xs_ref: Any, w_ref: Any, ws_ref: Any, o_ref: Any, *, n_kb: int, block_m: int
) -> None:
    acc = _block_dot(x_ref, xs_ref, w_ref, ws_ref, _DenseIndex(pl.program_id(1)), n_kb, block_m)
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_kernel(
    tg_ref: Any, x_ref: Any, xs_ref: Any, w_ref: Any, ws_ref: Any, o_ref: Any, *, n_kb: int, block_m: int
) -> None:
    # program_id is read outside pl.when: interpret mode cannot discharge it inside a cond
    group = tg_ref[pl.program_id(0)]  # this row tile's expert; -1 = a tile past the last group
    n_block = pl.program_id(1)

    @pl.when(group >= 0)
    def _() -> None:
        acc = _block_dot(x_ref, xs_ref, w_ref, ws_ref, _GroupIndex(group, n_block), n_kb, block_m)
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(group < 0)
    def _() -> None:
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _full(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array as the kernel's ref, indexed by hand inside the kernel. On Triton a ref
    is a pointer either way; in interpret mode a whole-array block is not copied per grid
    step (a (128, K) weight block per program measured 2-10x slower there)."""
    return pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))


def _out_type(shape: tuple[int, ...], dtype: Any, args: list) -> jax.ShapeDtypeStruct:
    """The kernel's output type. Inside jax.shard_map (check_vma, as dslp's per-rank pieces
    run) a pallas_call's out_shape must say over which mesh axes its value varies: the union
    of its operands' (an activation varying over the ranks times a replicated weight varies).
    jax 0.10 calls this the aval's manual_axis_type, later versions its vma."""
    avals = [jax.typeof(a) for a in args]
    mat = getattr(avals[0], "manual_axis_type", None)
    if mat is not None:
        varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat.update(varying=varying))
    vma = frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals))
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma) if vma else jax.ShapeDtypeStruct(shape, dtype)


def _call(
    kernel: Any, args: list, in_specs: list, m_pad: int, n: int, block_m: int, interpret: bool
) -> jax.Array:
    from jax.experimental.pallas import triton as pltriton

    return pl.pallas_call(
        kernel,
        out_shape=_out_type((m_pad, n), jnp.bfloat16, args),
        grid=(m_pad // block_m, n // QBLOCK),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, QBLOCK), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        name="hmoe_fp8_gemm",
    )(*args)


def _check_block_m(op: str, block_m: int) -> None:
    if block_m < DECODE_ROWS or block_m & (block_m - 1):
        raise ValueError(
            f"{op}: block_m={block_m} must be a power of two >= {DECODE_ROWS} (Triton dot tiles)"
        )


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def fp8_gemm(
    x_q: Any, x_scale: Any, w: Fp8Tensor, *, block_m: int = 64, interpret: bool = False
) -> jax.Array:
    """y [M, N] bf16 = (x_q * x_scale) . dequant(w)^T with f32 accumulation per 128-K block.
    One program per (block_m rows, 128 columns); M is padded up to block_m (padded rows are
    zero codes with scale 1 and are sliced off)."""
    m, k = _check_act("fp8_gemm", x_q, x_scale)
    _check_weight("fp8_gemm", w, 2, k)
    _check_block_m("fp8_gemm", block_m)
    n = w.w.shape[0]
    m_pad = -(-m // block_m) * block_m
    xq = jnp.pad(x_q, ((0, m_pad - m), (0, 0)))
    xs_t = jnp.pad(x_scale, ((0, m_pad - m), (0, 0)), constant_values=1.0).T  # [K/128, M_pad]
    n_kb = k // QBLOCK
    in_specs = [
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((n_kb, block_m), lambda i, j: (0, i)),
        _full(tuple(w.w.shape)),
        _full(tuple(w.scale_inv.shape)),
    ]
    kernel = functools.partial(_dense_kernel, n_kb=n_kb, block_m=block_m)
    y = _call(kernel, [xq, xs_t, w.w, w.scale_inv], in_specs, m_pad, n, block_m, interpret)
    return y[:m]


def fp8_gemm_decode(x_q: Any, x_scale: Any, w: Fp8Tensor, *, interpret: bool = False) -> jax.Array:
    """Decode (M <= 16): fp8_gemm with a 16-row tile. Each program streams its 128-row slab of
    e4m3 weight bytes once through the MMA (the smallest Triton dot tile is 16 rows, so up to
    15 rows are zero padding: FLOPs are free at decode, the weight bytes are the cost)."""
    if x_q.ndim != 2 or x_q.shape[0] > DECODE_ROWS:
        raise ValueError(f"fp8_gemm_decode: x_q must be [M <= {DECODE_ROWS}, K], got {tuple(x_q.shape)}")
    return fp8_gemm(x_q, x_scale, w, block_m=DECODE_ROWS, interpret=interpret)


def fp8_gemm_ref(x_q: Any, x_scale: Any, w: Fp8Tensor) -> jax.Array:
    """Dequantise both operands to f32, one f32 dot (HIGHEST), cast to bf16."""
    m, k = x_q.shape
    x = jnp.asarray(x_q).astype(jnp.float32) * jnp.repeat(jnp.asarray(x_scale, jnp.float32), QBLOCK, axis=1)
    y = jnp.dot(x, dequantize(w, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)


# --- the precision policy's hook ----------------------------------------------------------


def fp8_linear(x: Any, w: Fp8Tensor, *, interpret: bool = False) -> jax.Array:
    """The bf16 policy's FP8 matmul hook on an accelerator (model/precision.py MatmulFn):
    x [..., K] -> [..., N] f32 through quantize_act_fp8 + fp8_gemm (the decode tile when
    the flattened rows are <= 16). Weights the kernel's tiling does not cover (N or K not
    a multiple of 128, e.g. kv_a_proj_with_mqa's N = 576; non-2D weights) take the policy's
    own fallback: dequantise to bf16, bf16 dot with f32 accumulation (layers.policy_linear)."""
    n, k = w.w.shape[-2:]
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x shape {tuple(x.shape)} must end in K={k} (the weight's input dim)")
    if len(w.w.shape) != 2 or n % QBLOCK or k % QBLOCK or (w.block_n, w.block_k) != (QBLOCK, QBLOCK):
        wd = dequantize(w, jnp.bfloat16)
        return jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), wd, preferred_element_type=jnp.float32)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    x_q, x_s = quantize_act_fp8(x2)
    if x2.shape[0] <= DECODE_ROWS:
        y = fp8_gemm_decode(x_q, x_s, w, interpret=interpret)
    else:
        y = fp8_gemm(x_q, x_s, w, interpret=interpret)
    return y.astype(jnp.float32).reshape(*lead, n)


def fp8_linear_ref(x: Any, w: Fp8Tensor) -> jax.Array:
    """fp8_linear through the references (quantize_act_fp8 + fp8_gemm_ref; same fallback)."""
    n, k = w.w.shape[-2:]
    if len(w.w.shape) != 2 or n % QBLOCK or k % QBLOCK:
        wd = dequantize(w, jnp.bfloat16)
        return jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), wd, preferred_element_type=jnp.float32)
    x_q, x_s = quantize_act_fp8(x.reshape(-1, k))
    return fp8_gemm_ref(x_q, x_s, w).astype(jnp.float32).reshape(*x.shape[:-1], n)


# --- grouped form --------------------------------------------------------------------------


def _group_layout(group_sizes: Any, m: int, n_groups: int, block_m: int) -> tuple[Any, Any, int]:
    """Pad each group to whole row tiles (megablox-style). Returns (dest [M] row of each input
    row in the padded layout, tile_group [T] expert of each tile or -1 past the end, M_pad).
    T = ceil(M / block_m) + E bounds the tile count for any split of M rows into E groups
    (each group wastes less than one tile), so the grid is static for traced group sizes."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    tiles = (sizes + block_m - 1) // block_m  # [E]
    tile_end = jnp.cumsum(tiles)  # [E]
    pad_start = (tile_end - tiles) * block_m  # [E] first padded row of each group
    start = jnp.cumsum(sizes) - sizes  # [E] first input row of each group
    row = jnp.arange(m, dtype=jnp.int32)
    g_of_row = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), 0, n_groups - 1)
    dest = pad_start[g_of_row] + row - start[g_of_row]  # [M]
    n_tiles = -(-m // block_m) + n_groups
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_group = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    tile_group = jnp.where(t < tile_end[-1], tile_group, -1)
    return dest, tile_group, n_tiles * block_m


def fp8_gemm_grouped(
    x_q: Any, x_scale: Any, w: Fp8Tensor, group_sizes: Any, *, block_m: int = 64, interpret: bool = False
) -> jax.Array:
    """Rows sorted by expert: rows [start_e, start_e + group_sizes[e]) use expert e's weight
    w.w[e] [N, K]. y [M, N] bf16. sum(group_sizes) must equal M (checked when concrete;
    traced sizes that sum to less leave the last rows as zeros).
    One launch over (row tile, 128-column tile); every row tile belongs to one expert, so
    each expert's weight is read once per row tile of its own rows and never densely
    expanded (no ragged_dot). Empty groups take no tiles."""
    m, k = _check_act("fp8_gemm_grouped", x_q, x_scale)
    _check_weight("fp8_gemm_grouped", w, 3, k)
    _check_block_m("fp8_gemm_grouped", block_m)
    n_groups = w.w.shape[0]
    if tuple(jnp.shape(group_sizes)) != (n_groups,):
        raise ValueError(
            f"fp8_gemm_grouped: group_sizes must be [{n_groups}], got shape {jnp.shape(group_sizes)}"
        )
    if not isinstance(group_sizes, jax.core.Tracer):
        total = int(np.sum(np.asarray(group_sizes)))
        if total != m or np.any(np.asarray(group_sizes) < 0):
            raise ValueError(
                f"fp8_gemm_grouped: group_sizes must be >= 0 and sum to M={m}, got {np.asarray(group_sizes)}"
            )
    return _fp8_gemm_grouped(x_q, x_scale, w, group_sizes, block_m=block_m, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def _fp8_gemm_grouped(
    x_q: Any, x_scale: Any, w: Fp8Tensor, group_sizes: Any, *, block_m: int, interpret: bool
) -> jax.Array:
    m, k = x_q.shape
    n_groups, n = w.w.shape[0], w.w.shape[1]
    dest, tile_group, m_pad = _group_layout(group_sizes, m, n_groups, block_m)
    xq = jnp.zeros((m_pad, k), x_q.dtype).at[dest].set(x_q)
    xs_t = jnp.ones((m_pad, k // QBLOCK), jnp.float32).at[dest].set(x_scale).T  # [K/128, M_pad]
    n_kb = k // QBLOCK
    in_specs = [
        _full(tuple(tile_group.shape)),
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((n_kb, block_m), lambda i, j: (0, i)),
        _full(tuple(w.w.shape)),
        _full(tuple(w.scale_inv.shape)),
    ]
    kernel = functools.partial(_grouped_kernel, n_kb=n_kb, block_m=block_m)
    y = _call(kernel, [tile_group, xq, xs_t, w.w, w.scale_inv], in_specs, m_pad, n, block_m, interpret)
    # rows past sum(group_sizes) (traced sizes that fall short of M) belong to no group: zeros
    covered = jnp.arange(m) < jnp.sum(jnp.asarray(group_sizes, jnp.int32))
    return jnp.where(covered[:, None], y[dest], jnp.zeros((), y.dtype))


def fp8_gemm_grouped_ref(x_q: Any, x_scale: Any, w: Fp8Tensor, group_sizes: Any) -> jax.Array:
    """A Python loop over groups, each through fp8_gemm_ref with its expert's weight."""
    sizes = [int(s) for s in np.asarray(group_sizes)]
    out, start = [], 0
    for e, size in enumerate(sizes):
        we = Fp8Tensor(w=w.w[e], scale_inv=w.scale_inv[e], block_n=w.block_n, block_k=w.block_k)
        out.append(fp8_gemm_ref(x_q[start : start + size], x_scale[start : start + size], we))
        start += size
    return jnp.concatenate(out, axis=0)


# --- the precision policy's grouped and per-head hooks -------------------------------------


def _tiled(n: int, k: int, w: Fp8Tensor) -> bool:
    """The kernels' tiling covers this weight: N, K multiples of 128 and 128x128 blocks."""
    return not (n % QBLOCK or k % QBLOCK) and (w.block_n, w.block_k) == (QBLOCK, QBLOCK)


def _group_block_m(rows: int, groups: int) -> int:
    """Row tile of a grouped call: 16 (the smallest Triton dot tile) when the groups average
    <= 16 rows (decode heads, small expert groups: padding each group to 64 rows would
    quadruple the work), else 64."""
    return DECODE_ROWS if rows <= DECODE_ROWS * groups else 64


def fp8_grouped_linear(x: Any, w: Fp8Tensor, group_sizes: Any, *, interpret: bool = False) -> jax.Array:
    """The bf16 policy's grouped FP8 hook (model/precision.py GroupedMatmulFn): x [M, K]
    with rows sorted by group, w Fp8Tensor [G, N, K], group_sizes [G] (traced is fine; rows
    past their sum come out 0) -> [M, N] f32, through quantize_act_fp8 + fp8_gemm_grouped:
    each group's rows meet only their own weight (no dense expansion, no bf16 weight copy).
    Weights the tiling does not cover fall back to a bf16 dequantisation and ragged_dot."""
    if x.ndim != 2 or len(w.w.shape) != 3 or x.shape[-1] != w.w.shape[-1]:
        raise ValueError(
            f"fp8_grouped_linear: x must be [M, K] and w [G, N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(w.w.shape)}"
        )
    g, n, k = w.w.shape
    if not _tiled(n, k, w):
        wd = dequantize(w, jnp.bfloat16).transpose(0, 2, 1)  # [G, K, N]
        sizes = jnp.asarray(group_sizes, jnp.int32)
        return jax.lax.ragged_dot(x.astype(jnp.bfloat16), wd, sizes, preferred_element_type=jnp.float32)
    x_q, x_s = quantize_act_fp8(x)
    block_m = _group_block_m(x.shape[0], g)
    y = fp8_gemm_grouped(x_q, x_s, w, group_sizes, block_m=block_m, interpret=interpret)
    return y.astype(jnp.float32)


def fp8_grouped_linear_ref(x: Any, w: Fp8Tensor, group_sizes: Any) -> jax.Array:
    """Jittable twin of fp8_grouped_linear (traced sizes): the same activation quantisation,
    then for every group an f32 (HIGHEST) dot of all rows with that group's dequantised
    weight, rounded to bf16 and kept on the group's rows (G dense dots: a reference)."""
    g, n, k = w.w.shape
    if not _tiled(n, k, w):
        wd = dequantize(w, jnp.bfloat16).transpose(0, 2, 1)
        sizes = jnp.asarray(group_sizes, jnp.int32)
        return jax.lax.ragged_dot(x.astype(jnp.bfloat16), wd, sizes, preferred_element_type=jnp.float32)
    x_q, x_s = quantize_act_fp8(x)
    xd = x_q.astype(jnp.float32) * jnp.repeat(x_s, QBLOCK, axis=1)
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    row = jnp.arange(x.shape[0])
    y = jnp.zeros((x.shape[0], n), jnp.float32)
    for e in range(g):
        we = Fp8Tensor(w=w.w[e], scale_inv=w.scale_inv[e], block_n=w.block_n, block_k=w.block_k)
        ye = jnp.dot(xd, dequantize(we, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
        mine = (row < ends[e]) & (row >= ends[e] - jnp.asarray(group_sizes, jnp.int32)[e])
        y = jnp.where(mine[:, None], ye.astype(jnp.bfloat16).astype(jnp.float32), y)
    return y


def _head_rows(x: Any, w: Fp8Tensor) -> tuple[Any, int, int]:
    """x [..., H, K] -> ([H * M, K] rows sorted by head, M, H)."""
    h, _, k = w.w.shape
    if x.ndim < 2 or x.shape[-2:] != (h, k):
        raise ValueError(
            f"fp8_head_linear: x must be [..., {h}, {k}] for w {tuple(w.w.shape)}, got {tuple(x.shape)}"
        )
    x3 = x.reshape(-1, h, k)
    return jnp.swapaxes(x3, 0, 1).reshape(-1, k), x3.shape[0], h


def fp8_head_linear(x: Any, w: Fp8Tensor, *, interpret: bool = False) -> jax.Array:
    """The bf16 policy's per-head FP8 hook (Precision.fp8_head_matmul; the absorbed MLA's
    W_uk / W_uv): x [..., H, K], w Fp8Tensor [H, N, K] -> [..., H, N] f32: the heads are the
    groups of one fp8_grouped_linear call (M rows each)."""
    rows, m, h = _head_rows(x, w)
    y = fp8_grouped_linear(rows, w, np.full((h,), m, np.int32), interpret=interpret)
    return jnp.swapaxes(y.reshape(h, m, -1), 0, 1).reshape(*x.shape[:-1], -1)


def fp8_head_linear_ref(x: Any, w: Fp8Tensor) -> jax.Array:
    rows, m, h = _head_rows(x, w)
    y = fp8_grouped_linear_ref(rows, w, np.full((h,), m, np.int32))
    return jnp.swapaxes(y.reshape(h, m, -1), 0, 1).reshape(*x.shape[:-1], -1)
