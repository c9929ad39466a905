"""The stand-in accelerator's measured rates for `hmoe calibrate` (measure/calibrate.py): what
an XLA CPU device standing in for a GPU runs its pieces at on this machine.

- standin_gemm: our FP8 GEMM kernel (the bf16 policy's matmul hook) at M = 512 and, over
  rotated matrices, at M = 1 (its weight-read rate); an XLA f32 dot;
- convert_gbps: the experts_acc piece's in-XLA FP8 dequantisation (slp's ring slots);
- standin_attention: the engine's blocked MLA prefill attention (model.attention, the
  projections through the hooks, the per-head absorbed kernels) on one real DeepSeek-V3
  attention layer, in each of its two forms (absorbed below 256 new tokens, expanded from
  256), as flops (plan.costs.attn_flops, what the plans charge) per second. An attention
  piece is not one GEMM: its rate at prefill sizes differs from bf16_tflops (measured here:
  the absorbed form's per-head matmuls and the key-block walks run slower per flop), and the
  simulator prices prefill attention pieces at these rates when the profile has them.
"""

from __future__ import annotations

import functools

import numpy as np

from hmoe_jax.measure.probes import ReadProbe
from hmoe_jax.measure.stacks import fp8_stack
from hmoe_jax.measure.timing import median_s, side_by_side


def convert_gbps(rng, probe: ReadProbe, repeats: int) -> float:
    """Weight bytes/s of the stand-in's experts_acc piece (runtime/pieces.experts_group: FP8
    expert weights dequantised inside XLA, then ragged dots) on one real-shape expert with
    16 rows: what a ring slot costs the stand-in beyond its GEMM flops."""
    import jax.numpy as jnp

    from hmoe_jax.engine.engine import precision_for
    from hmoe_jax.model.params import ExpertsParams
    from hmoe_jax.runtime import pieces
    from hmoe_jax.runtime.placement import make_placement

    d, i, rows = 7168, 2048, 16
    prec = precision_for("bf16", make_placement(1))
    groups = [
        ExpertsParams(gate=fp8_stack(rng, 1, i, d), up=fp8_stack(rng, 1, i, d), down=fp8_stack(rng, 1, d, i))
        for _ in range(4)
    ]
    one = 3 * (d * i + 4 * (d // 128) * (i // 128))
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    token = jnp.arange(rows, dtype=jnp.int32)
    wts = jnp.full((rows,), 0.5, jnp.float32)
    sizes = np.array([rows], np.int32)
    state = {"acc": jnp.zeros((rows, d), jnp.float32), "j": 0}

    def call():
        state["j"] += 1
        g = groups[state["j"] % len(groups)]
        state["acc"] = pieces.experts_group(
            x, state["acc"], token, wts, np.int32(0), sizes, g, rows=rows, prec=prec
        )
        return state["acc"]

    return one / median_s(call, max(3, repeats // 2), warmup=len(groups), probe=probe) / 1e9


def standin_gemm(rng, probe: ReadProbe, repeats: int) -> dict[str, float]:
    """The stand-in accelerator's GEMM rates: our FP8 GEMM kernel (what its pieces call for
    FP8 weights under the bf16 policy) at M = 512 and at M = 1 over rotated matrices, and an
    XLA f32 dot (the f32 policy)."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.kernels.gemm import fp8_matmul

    n, kk = 2048, 7168
    mats = fp8_stack(rng, 24, n, kk)  # 24 x 14.7 MB = 352 MB... rotated with the next stack
    mats2 = fp8_stack(rng, 24, n, kk)
    from hmoe_jax.quant.fp8 import Fp8Tensor

    ws = [Fp8Tensor(w=st.w[j], scale_inv=st.scale_inv[j]) for st in (mats, mats2) for j in range(24)]
    f = jax.jit(fp8_matmul)
    x1 = jnp.asarray(rng.standard_normal((1, kk)), jnp.bfloat16)
    it = iter(range(10**9))
    t1, bw = side_by_side(probe, lambda: f(x1, ws[next(it) % len(ws)]), len(ws), repeats)
    wb = n * kk + 4 * (n // 128) * (kk // 128)
    m = 512
    xm = jnp.asarray(rng.standard_normal((m, kk)), jnp.bfloat16)
    tm = median_s(lambda: f(xm, ws[0]), max(3, repeats // 2), probe=probe)
    a = jnp.asarray(rng.standard_normal((m, kk)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((kk, n)), jnp.float32)
    dot = jax.jit(jnp.dot)
    t32 = median_s(lambda: dot(a, b), max(3, repeats // 2), probe=probe)
    return {
        "gemv_gbps": wb / t1 / 1e9,
        "gemv_probe_gbps": bw,
        "bf16_tflops": 2 * m * n * kk / tm / 1e12,
        "fp32_tflops": 2 * m * n * kk / t32 / 1e12,
    }


ATTN_TOKENS = {"absorbed": 128, "expanded": 512}  # new tokens per timed call, one per form


def standin_attention(rng, probe: ReadProbe, repeats: int, model: str = "deepseek_v3") -> dict[str, dict]:
    """The engine's prefill attention on one `model` attention layer (FP8 weights, the bf16
    policy with the stand-in's hooks, absorbed weights derived as placement does) at
    ATTN_TOKENS new tokens from position 0: seconds and flops/s per form."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.config import named_model_config
    from hmoe_jax.engine.engine import precision_for
    from hmoe_jax.model import attention as A
    from hmoe_jax.model.params import MLAParams
    from hmoe_jax.plan import costs
    from hmoe_jax.quant.fp8 import Fp8Tensor
    from hmoe_jax.runtime.placement import make_placement
    from hmoe_jax.runtime.state import absorbed_weights

    cfg = named_model_config(model)
    prec = precision_for("bf16", make_placement(1))
    h, d, r = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank

    def w(n: int, k: int) -> Fp8Tensor:
        st = fp8_stack(rng, 1, n, k)
        return Fp8Tensor(w=st.w[0], scale_inv=st.scale_inv[0])

    ones = jnp.ones
    p = MLAParams(
        kv_a=w(cfg.cache_dim, d),
        kv_a_norm=ones((r,), jnp.float32),
        kv_b=w(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        o=w(d, h * cfg.v_head_dim),
        q_a=w(cfg.q_lora_rank, d),
        q_a_norm=ones((cfg.q_lora_rank,), jnp.float32),
        q_b=w(h * cfg.qk_head_dim, cfg.q_lora_rank),
    )
    uk, uv = jax.device_put(absorbed_weights(p, cfg, prec))
    p = p.replace(w_uk=uk, w_uv=uv)
    out: dict[str, dict] = {}
    for form, t in ATTN_TOKENS.items():
        x = jnp.asarray(rng.standard_normal((t, d)) * 0.1, jnp.bfloat16)
        lat = jnp.zeros((1, t, r), jnp.bfloat16)
        rope = jnp.zeros((1, t, cfg.qk_rope_head_dim), jnp.bfloat16)
        f = jax.jit(functools.partial(A.prefill_attention, cfg=cfg, row=0, start=0, prec=prec, form=form))
        args = {"p": p, "x": x, "cache_lat": lat, "cache_rope": rope}
        s = median_s(lambda f=f, args=args: f(**args), max(3, repeats // 3), probe=probe)
        flops = costs.attn_flops(cfg, t, 0, form=form, cache_len=t)
        out[form] = {"tokens": t, "model": model, "seconds": s, "tflops": flops / s / 1e12}
    return out
