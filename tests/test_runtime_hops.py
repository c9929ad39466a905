"""Decode hops (runtime/hops.py, runtime/pieces.py pack_hop): what crosses between the
accelerator and the host per MoE layer.

- pack_hop / unpack_hop are bit-exact for every value (ids up to 2^31 - 1, past f32's 2^24,
  NaN payloads and -0.0 in the floats), against the arrays themselves;
- the bytes each d2h / h2d op of a decode step or a cpu-prefill chunk actually hands to the
  transfer (nbytes of the arrays, noted on its trace slice) equal the bytes the plan priced
  (plan.costs.hidden_bytes + route_bytes), under the bf16 policy (x and the routed output
  cross as bf16) and the f32 policy (f32, the HF-parity path);
- a CPU stand-in keeps plain device_put hops; a bad HMOE_HOP_MEMORY is a clear error.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine
from hmoe_jax.plan import costs
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime import hops, pieces
from hmoe_jax.runtime.synthetic import random_params


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pack_hop_round_trips_every_bit(dtype):
    rng = np.random.default_rng(0)
    m, d, k = 5, 24, 8
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[0, :3] = [np.nan, -0.0, np.inf]
    x = jnp.asarray(x).astype(dtype)
    ids = rng.integers(0, 2**31 - 1, (m, k)).astype(np.int32)
    ids[1, 0] = 2**24 + 1  # not representable in f32: the old f32 packing could not carry it
    w = rng.standard_normal((m, k)).astype(np.float32)
    packed = pieces.pack_hop(x, jnp.asarray(ids), jnp.asarray(w))
    assert packed.dtype == (np.uint16 if dtype == "bfloat16" else np.uint32)
    assert packed.nbytes == x.nbytes + ids.nbytes + w.nbytes  # no widening
    x2, ids2, w2 = pieces.unpack_hop(packed, d, k)
    assert x2.dtype == x.dtype and ids2.dtype == np.int32 and w2.dtype == np.float32
    bits = np.uint16 if dtype == "bfloat16" else np.uint32
    np.testing.assert_array_equal(np.asarray(x2).view(bits), np.asarray(x).view(bits))
    np.testing.assert_array_equal(np.asarray(ids2), ids)
    np.testing.assert_array_equal(np.asarray(w2).view(np.uint32), w.view(np.uint32))
    with pytest.raises(ValueError, match="words per row"):
        pieces.unpack_hop(packed, d + 1, k)


@functools.cache
def engine(precision: str) -> Engine:
    cfg = named_model_config("deepseek_v3_tiny")
    # experts_ref on the host: the FFI MoE op (which takes bf16 x as well) dies with SIGILL on
    # its second jitted row count in one process on this machine, on main too (reported)
    return Engine(
        random_params(cfg, seed=5), cfg, precision=precision, expert_fn="ref", max_batch=3, max_len=64
    )


def hop_slices(trace: TraceRecorder) -> list[dict]:
    return [s for s in trace.slices if s["name"].split(" ")[0] in ("d2h", "h2d")]


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_decode_hop_bytes_moved_equal_the_plan(precision):
    eng = engine(precision)
    cfg = eng.cfg
    act = costs.hop_act_bytes(precision)
    cache = eng.new_cache(64, rows=3)
    for batch in (1, 3):
        tr = TraceRecorder()
        eng.decode_rows(np.arange(2, 2 + batch), np.arange(batch), np.full(batch, 4), cache, tr)
        sl = hop_slices(tr)
        moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
        assert len(sl) == 2 * moe_layers
        for s in sl:
            a = s["args"]
            assert a["moved_bytes"] == a["bytes"], (
                f"{s['name']}: moved {a['moved_bytes']} != planned {a['bytes']}"
            )
            assert a["hop_memory"] == "direct"  # a CPU stand-in
        d2h = [s["args"] for s in sl if s["name"].startswith("d2h")]
        h2d = [s["args"] for s in sl if s["name"].startswith("h2d")]
        # independent of the cost model: D values at the policy's width, k int32 ids + f32 weights
        d, k = cfg.hidden_size, cfg.num_experts_per_tok
        assert all(a["moved_bytes"] == batch * (act * d + 8 * k) and a["transfers"] == 1 for a in d2h)
        assert all(a["moved_bytes"] == batch * act * d for a in h2d)


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_unfused_prefill_chunk_hops_move_the_planned_bytes(precision):
    eng = engine(precision)
    tr = TraceRecorder()
    ids = np.arange(2, 14)
    eng.prefill(ids, eng.new_cache(64), "cpu", trace=tr, fused=False, chunk_tokens=5)
    sl = hop_slices(tr)
    assert sl and all(s["args"]["moved_bytes"] == s["args"]["bytes"] for s in sl)
    assert {s["args"]["transfers"] for s in sl if s["name"].startswith("d2h")} == {3}  # x, ids, weights


def test_bf16_return_hop_stays_within_the_policy_tolerance(monkeypatch):
    """The routed output crosses back as bf16: one more rounding (<= 2^-9 relative) before
    combine's f32 sum. Against the same bf16 engine with an f32 return hop, prefill (cpu
    chunks, same hop) and decode logits stay within the bf16 policy's tolerance
    (tests/test_model_parity.py: 3% of max|logit|; measured 0.5-0.9%) and the argmax is the
    same at every position."""
    from hmoe_jax.runtime import ops

    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=5)

    def logits() -> np.ndarray:
        eng = Engine(params, cfg, precision="bf16", expert_fn="ref", max_batch=1, max_len=64)
        cache = eng.new_cache(64)
        pre, *_ = eng.prefill(np.arange(2, 10), cache, "cpu", all_logits=True)
        dec = [eng.decode_step(11 + i, 8 + i, cache) for i in range(3)]
        return np.concatenate([np.asarray(pre, np.float32), np.stack(dec).astype(np.float32)])

    bf16_hop = logits()
    real = ops._host_expert_fn.__wrapped__
    monkeypatch.setattr(
        ops, "_host_expert_fn", lambda fn, d, k, packed, _: real(fn, d, k, packed, np.float32)
    )
    f32_hop = logits()
    rel = np.abs(bf16_hop - f32_hop).max(-1) / np.abs(f32_hop).max()
    assert rel.max() <= 3e-2, f"per-position rel err {np.round(rel, 4)}"
    assert rel.max() > 0  # the hop really changed dtype
    np.testing.assert_array_equal(bf16_hop.argmax(-1), f32_hop.argmax(-1))


def test_hop_memory_mode_on_a_stand_in_and_bad_values(monkeypatch):
    import jax

    dev = jax.devices()[0]
    assert hops.hop_memory(dev, dev)[0] == "direct"
    monkeypatch.setenv(hops.HOP_MEMORY_ENV, "pinned")  # a stand-in stays direct whatever is asked
    assert hops.hop_memory(dev, dev)[0] == "direct"
    monkeypatch.setenv(hops.HOP_MEMORY_ENV, "fast")
    with pytest.raises(ValueError, match="HMOE_HOP_MEMORY='fast'"):
        hops.hop_memory(dev, dev)


def test_pinned_hop_path_moves_values_intact():
    """The pinned path's two device_puts each way (XLA:CPU has a pinned_host memory kind too,
    so the code path runs here; its speed is a GPU question): values intact, landing on the
    host device and back in the accelerator's device memory."""
    import jax

    acc, host = jax.devices()[1], jax.devices()[0]
    assert hops._pinned_probe(acc, host) is None
    x = jax.device_put(np.arange(40, dtype=np.uint16).reshape(2, 20), acc)
    h = hops.to_host(x, acc, host, "pinned")
    assert h.devices() == {host}
    back = hops.to_acc(h, acc, "pinned")
    assert back.devices() == {acc} and back.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(back), np.arange(40).reshape(2, 20))


def test_hop_bytes_of_the_cost_model():
    cfg = dataclasses.replace(named_model_config("deepseek_v3"))
    assert costs.hidden_bytes(cfg, 8, "bf16") == 8 * 7168 * 2
    assert costs.hidden_bytes(cfg, 8, "f32") == 8 * 7168 * 4
    assert costs.route_bytes(cfg, 8) == 8 * 8 * (4 + 4)
    with pytest.raises(ValueError, match="precision"):
        costs.hidden_bytes(cfg, 1, "fp8")


def test_docs_hop_table_is_the_snippets_output():
    """docs/engine.md's bytes-per-layer table is what its snippet prints from the plan."""
    import contextlib
    import io
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    section = doc[doc.index("### Decode hops") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet, {})
    printed = [line for line in out.getvalue().splitlines() if line.startswith("|")]
    assert len(printed) == 4 and all(line in section for line in printed), printed


def test_decode_through_the_pinned_path_gives_the_same_logits(monkeypatch):
    """The executor's hops in pinned mode (forced on the stand-in) give the direct mode's
    logits bit for bit, and note the mode on the hop slices."""
    from hmoe_jax.runtime.run import Run

    eng = engine("bf16")
    out = {}
    for mode in ("direct", "pinned"):
        monkeypatch.setattr(Run, "hop_mode", property(lambda self, mode=mode: mode))
        cache = eng.new_cache(64)
        eng.prefill(np.arange(2, 10), cache, "cpu")
        tr = TraceRecorder()
        out[mode] = np.asarray(eng.decode_step(11, 8, cache, tr))
        assert {s["args"]["hop_memory"] for s in hop_slices(tr)} == {mode}
    np.testing.assert_array_equal(out["pinned"], out["direct"])
