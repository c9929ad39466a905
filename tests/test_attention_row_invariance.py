"""A decode row's attention output must not depend on how many rows share the step: batched
decode is bit-identical to decoding each sequence alone (docs/engine.md), which `hmoe serve`
relies on (tests/test_serve_http.py: concurrent requests get their solo tokens).

On XLA:CPU a dot's result for one row depends on the row count (M=1 takes another path that
sums in another order: measured on an AVX2 host, 1e-7 relative at the absorbed MLA's
per-head products), so the CPU stand-in computes the per-head products of the absorbed form
(q_absorb, o_unabsorb: f32 weights when kv_b's FP8 blocks do not fit the heads) one row at
a time in decode (attention._head_matmul, rowwise=True). Checked here: those products at the model's shapes for
M = 1..8 (bit-identical rows; values against a float64 numpy reference), and a whole decode
step of the trained default model under the engine's bf16 CPU policy (our FFI kernels as
the matmul hooks) for B = 1..8 rows against each row decoded alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model import attention as A
from hmoe_jax.model.params import MLAParams
from hmoe_jax.model.precision import F32, policy

BF16_CPU = policy("bf16", cpu=True)
STDLIB = Path(__file__).resolve().parents[1] / "hmoe_jax" / "assets" / "deepseek_v3_stdlib"
M_MAX = 8


def _cfg(h: int, dn: int, dv: int, r: int):
    base = named_model_config("deepseek_v3_tiny")
    return dataclasses.replace(
        base, num_attention_heads=h, qk_nope_head_dim=dn, v_head_dim=dv, kv_lora_rank=r
    )


# (H, dn, dv, R): the default model's and deepseek_v3_tiny's, and a wider one
HEAD_SHAPES = [(4, 32, 32, 128), (16, 128, 128, 512)]


@pytest.mark.parametrize("prec", [F32, BF16_CPU], ids=["f32", "bf16"])
@pytest.mark.parametrize("absorbed", [True, False], ids=["placed", "from_kv_b"])
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_head_products_rows_do_not_depend_on_row_count(shape, absorbed, prec):
    h, dn, dv, r = shape
    cfg = _cfg(h, dn, dv, r)
    rng = np.random.default_rng(3)
    kv_b = rng.standard_normal((h * (dn + dv), r)).astype(np.float32)
    full = kv_b.reshape(h, dn + dv, r)
    w_uk, w_uv = (jnp.asarray(full[:, :dn]), jnp.asarray(full[:, dn:])) if absorbed else (None, None)
    p = MLAParams(kv_a=None, kv_a_norm=None, kv_b=jnp.asarray(kv_b), o=None, w_uk=w_uk, w_uv=w_uv)
    q_nope = jnp.asarray(rng.standard_normal((M_MAX, h, dn)), jnp.float32)
    o_lat = jnp.asarray(rng.standard_normal((M_MAX, h, r)), jnp.float32)
    f64 = np.float64
    cases = [
        ("q_absorb", A.q_absorb, q_nope, np.einsum("mhd,hdr->mhr", np.asarray(q_nope, f64), full[:, :dn])),
        ("o_unabsorb", A.o_unabsorb, o_lat, np.einsum("mhr,hdr->mhd", np.asarray(o_lat, f64), full[:, dn:])),
    ]
    for name, fn, x, ref in cases:
        f = jax.jit(lambda x, p, fn=fn: fn(p, cfg, prec, x, rowwise=True))
        all_rows = np.asarray(f(x, p))
        err = np.abs(all_rows - ref).max()
        assert err <= 1e-5 * np.abs(ref).max(), f"{name}: max err {err:.3g} vs float64 reference"
        for m in range(1, M_MAX):
            got = np.asarray(f(x[:m], p))
            diff = np.abs(got - all_rows[:m]).max()
            assert np.array_equal(got, all_rows[:m]), (
                f"{name} {shape} ({prec.name}): rows computed {m} at a time differ from the same "
                f"rows computed {M_MAX} at a time by up to {diff:.3g}"
            )


@pytest.fixture(scope="module")
def stdlib_layer():
    pytest.importorskip("_hmoe_ffi", reason="the engine's bf16 CPU policy runs our FFI kernels")
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.kernels import gemm
    from hmoe_jax.runtime.state import absorbed_weights

    cfg, params = load_checkpoint(STDLIB, progress=False)
    prec = policy(
        "bf16",
        cpu=True,
        fp8_matmul=gemm.fp8_matmul,
        bf16_matmul=gemm.bf16_matmul,
        fp8_head_matmul=gemm.fp8_head_matmul,
    )
    attn = params.layers[1].attn
    w_uk, w_uv = absorbed_weights(attn, cfg, prec)  # as the engine places them
    attn = dataclasses.replace(attn, w_uk=jnp.asarray(w_uk), w_uv=jnp.asarray(w_uv))
    return cfg, prec, attn


def test_decode_step_rows_equal_solo_rows(stdlib_layer):
    """decode_attention of the default model for B rows (each at its own position in its own
    cache row) gives, bit for bit, each row's output and cache write when that row is decoded
    alone. Many draws: a per-head product's last-bit difference only sometimes survives the
    bf16 rounding of the attention output."""
    cfg, prec, attn = stdlib_layer
    n_rows, s_len, draws = M_MAX, 64, 24
    dec = jax.jit(A.decode_attention, static_argnames=("cfg", "kv_len", "prec"))
    rng = np.random.default_rng(7)
    for d in range(draws):
        lat = jnp.asarray(rng.standard_normal((n_rows, s_len, cfg.kv_lora_rank)), prec.cache_dtype)
        rope = jnp.asarray(rng.standard_normal((n_rows, s_len, cfg.qk_rope_head_dim)), prec.cache_dtype)
        x = jnp.asarray(rng.standard_normal((M_MAX, cfg.hidden_size)), prec.act_dtype)
        rows = rng.permutation(n_rows).astype(np.int32)
        pos = rng.integers(1, s_len, M_MAX).astype(np.int32)

        def run(sel, x=x, lat=lat, rope=rope, rows=rows, pos=pos):
            out, lat_new, _ = dec(attn, cfg, x[sel], lat, rope, rows[sel], pos[sel], s_len, prec=prec)
            return np.asarray(out.astype(jnp.float32)), np.asarray(lat_new.astype(jnp.float32))

        n = (M_MAX, 2, 5)[d % 3]  # a few batch sizes, each compiled once
        out, lat_new = run(slice(0, n))
        for b in range(n):
            solo_out, solo_lat = run(slice(b, b + 1))
            assert np.array_equal(out[b], solo_out[0]), (
                f"draw {d}: decode with {n} rows: row {b} (cache row {rows[b]}, position {pos[b]}) "
                f"differs from its solo decode by up to {np.abs(out[b] - solo_out[0]).max():.3g}"
            )
            assert np.array_equal(lat_new[rows[b], pos[b]], solo_lat[rows[b], pos[b]])
