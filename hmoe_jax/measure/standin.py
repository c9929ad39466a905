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
  simulator prices prefill attention pieces at these rates when the profile has them;
- decode_attention: the engine's decode attention on that layer at 1 and 4 rows: its own
  read efficiency and how much of its rows' flops its read pass hides (read_slack).
"""

from __future__ import annotations

import functools
import statistics

import numpy as np

from hmoe_jax.measure.probes import ReadProbe
from hmoe_jax.measure.stacks import fp8_stack
from hmoe_jax.measure.timing import median_time, side_by_side, side_by_side_points


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

    return (
        one / median_time(call, max(3, repeats // 2), warmup=len(groups), between=probe.tflops).median_s / 1e9
    )


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
    # the same GEMV on one matrix over and over (14.7 MB: it stays in L3): the rate of its
    # decode-and-multiply work when DRAM is not what it waits on (cpu.read_fixed_share)
    hot_calls = 32

    def hot():
        for _ in range(hot_calls):
            y = f(x1, ws[0])
        return y

    t_hot = median_time(hot, max(3, repeats // 2), warmup=1, between=probe.tflops).median_s / hot_calls
    m = 512
    xm = jnp.asarray(rng.standard_normal((m, kk)), jnp.bfloat16)
    tm = median_time(lambda: f(xm, ws[0]), max(3, repeats // 2), between=probe.tflops).median_s
    a = jnp.asarray(rng.standard_normal((m, kk)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((kk, n)), jnp.float32)
    dot = jax.jit(jnp.dot)
    t32 = median_time(lambda: dot(a, b), max(3, repeats // 2), between=probe.tflops).median_s
    return {
        "gemv_gbps": wb / t1 / 1e9,
        "gemv_probe_gbps": bw,
        "gemv_l3_gbps": wb / t_hot / 1e9,
        "bf16_tflops": 2 * m * n * kk / tm / 1e12,
        "fp32_tflops": 2 * m * n * kk / t32 / 1e12,
    }


# new tokens per timed call, (small, large) per form: the chunk sizes its rate is priced
# between (sim/pricing.Rates.attn_rate). Absorbed: the 64- and 128-token chunks e04 and e06
# time; expanded: from its first chunk size (256) to the paper policy's serving chunk (512).
# Not 1,024: a call there takes seconds here and its rate falls off a cliff (the scores of a
# 1,024 x 512 key block leave the caches); beyond 512 the rate is held.
ATTN_TOKENS = {"absorbed": (64, 128), "expanded": (256, 512)}


def standin_attention(rng, probe: ReadProbe, repeats: int, model: str = "deepseek_v3") -> dict[str, dict]:
    """The engine's prefill attention on one `model` attention layer (FP8 weights, the bf16
    policy with the stand-in's hooks, absorbed weights derived as placement does) at each of
    ATTN_TOKENS' chunk sizes from position 0: per form, seconds and flops/s at the large
    size, and the same at the small one under "small"."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.model import attention as A
    from hmoe_jax.plan import costs

    cfg, prec, p = _mla_layer(rng, model)
    d, r = cfg.hidden_size, cfg.kv_lora_rank

    def timed(form: str, t: int) -> dict:
        x = jnp.asarray(rng.standard_normal((t, d)) * 0.1, jnp.bfloat16)
        lat = jnp.zeros((1, t, r), jnp.bfloat16)
        rope = jnp.zeros((1, t, cfg.qk_rope_head_dim), jnp.bfloat16)
        f = jax.jit(functools.partial(A.prefill_attention, cfg=cfg, row=0, start=0, prec=prec, form=form))
        args = {"p": p, "x": x, "cache_lat": lat, "cache_rope": rope}
        s = median_time(lambda: f(**args), max(3, repeats // 3), between=probe.tflops).median_s
        flops = costs.attn_flops(cfg, t, 0, form=form, cache_len=t)
        return {"tokens": t, "model": model, "seconds": s, "tflops": flops / s / 1e12}

    out: dict[str, dict] = {}
    for form, (small, large) in ATTN_TOKENS.items():
        out[form] = {**timed(form, large), "small": timed(form, small)}
    return out


def combine_attention(blocks: list[dict[str, dict]]) -> dict[str, dict]:
    """standin_attention's blocks as one: per form and chunk size the median seconds and
    flops/s (the rates of each block listed under "tflops_blocks")."""

    def med(xs: list[dict]) -> dict:
        return {
            **xs[0],
            "seconds": statistics.median(x["seconds"] for x in xs),
            "tflops": statistics.median(x["tflops"] for x in xs),
            "tflops_blocks": [x["tflops"] for x in xs],
        }

    return {
        form: {**med([b[form] for b in blocks]), "small": med([b[form]["small"] for b in blocks])}
        for form in blocks[0]
    }


def _mla_layer(rng, model: str):
    """(cfg, the bf16 policy with the stand-in's hooks, one `model` attention layer with random
    FP8 weights and the absorbed per-head weights placement derives)."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.config import named_model_config
    from hmoe_jax.engine.engine import precision_for
    from hmoe_jax.model.params import MLAParams
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
    return cfg, prec, p.replace(w_uk=uk, w_uv=uv)


SLACK_ROWS = 4  # the decode rows of read_slack's second point (the e03 / e09 batch)


def decode_attention(
    rng, probe: ReadProbe, repeats: int, flops_per_s: float, model: str = "deepseek_v3"
) -> dict:
    """The engine's decode attention (model.attention.decode_attention_unwritten, projections
    and per-head kernels through the stand-in's hooks) on one `model` attention layer at 1
    and SLACK_ROWS rows, each side by side with a read probe: the two stand-in inputs the
    simulator prices a decode piece with (sim/pricing._compute).

    mem_efficiency: its read bytes (as sim/reads counts them) / seconds at one row / the
    probe: the piece's own read rate, below the FP8 GEMV's (its norms, rope, softmax and
    hops between kernels are small XLA ops that ride along).
    read_slack: the share of a piece's read time in which its cores do its flops for free
    (busy = max(read, flops + (1 - slack) x read)): at SLACK_ROWS rows, read = the bytes at
    that efficiency on that round's probe, flops = plan.costs.attn_flops at flops_per_s
    (the stand-in's bf16 GEMM rate), slack = (read + flops - t) / read in [0, 1]. 0: they
    add up (the AVX2 Zen 3 VM: the e03 twin's attn_route grew by its extra rows' full flop
    time); 1: a pass hides them all (a roofline). The layer's decode weights (~190 MB) are
    well over any L3, so every call reads DRAM."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.model import attention as A
    from hmoe_jax.plan import costs

    cfg, prec, p = _mla_layer(rng, model)

    def size(tree) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))

    slots, pos = 256, 63  # a short context: the weights, not the cache, are what it reads
    kv_len = costs.decode_kv_len(pos + 1, slots)
    # what a decode step reads, as sim/reads counts it: the layer's tensors but kv_b (the
    # absorbed per-head copies stand in for it) and each row's kv_len cache slots
    nbytes = size(p) - size(p.kv_b) + SLACK_ROWS * kv_len * cfg.cache_dim * 2
    f = jax.jit(A.decode_attention_unwritten, static_argnames=("cfg", "kv_len", "prec"))
    lat = jnp.zeros((SLACK_ROWS, slots, cfg.kv_lora_rank), jnp.bfloat16)
    rope = jnp.zeros((SLACK_ROWS, slots, cfg.qk_rope_head_dim), jnp.bfloat16)
    calls = {}
    for b in (1, SLACK_ROWS):
        x = jnp.asarray(rng.standard_normal((b, cfg.hidden_size)) * 0.1, jnp.bfloat16)
        rows, at = jnp.arange(b, dtype=jnp.int32), jnp.full((b,), pos, jnp.int32)
        calls[b] = lambda x=x, rows=rows, at=at: f(p, cfg, x, lat, rope, rows, at, kv_len, prec=prec)  # noqa: E731
    # both row counts in every round, in alternating order, beside one probe: the slack
    # hangs on t(SLACK_ROWS) - t(1), ~1-2 ms of ~6-9, and timing the two points one after
    # the other, each beside its own probes, let the VM's drift between them through (the
    # 3 blocks of one calibration read slack 0.01-0.13; interleaved, 3 runs read 0.26-0.39)
    ts, bws = side_by_side_points(probe, calls, 3, max(3, repeats // 2))
    pts = {
        b: {
            "seconds": ts[b],
            "probe_gbps": bws,
            "flops": costs.attn_flops(cfg, 1, pos, rows=b, cache_len=slots),
        }
        for b in calls
    }
    one, hi = pts[1], pts[SLACK_ROWS]
    # the piece's own read rate at one row (its small XLA ops ride along: it runs below the
    # GEMV's mem_efficiency), then its read time re-based on the second point's probe
    eff = nbytes / one["seconds"] / (one["probe_gbps"] * 1e9)
    read_s = nbytes / (hi["probe_gbps"] * 1e9 * eff)
    flops_s = hi["flops"] / flops_per_s
    slack = min(1.0, max(0.0, (read_s + flops_s - hi["seconds"]) / read_s))
    return {
        "read_slack": slack,
        "mem_efficiency": eff,
        "model": model,
        "weight_bytes": nbytes,
        "rows": SLACK_ROWS,
        "read_s": read_s,
        "flops_s": flops_s,
        "points": {str(b): v for b, v in pts.items()},
    }
