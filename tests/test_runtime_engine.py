"""The engine's decode placement with the fused CPU MoE op, its error paths, and the CLI
flags that run it (`hmoe generate --schedule ... --trace ...`)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine, ffi_moe_available
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.plan.trace import load_slices
from hmoe_jax.runtime.placement import PlacementError, make_placement
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.schedules.base import ScheduleError


@functools.cache
def fp8_model():
    cfg = named_model_config("deepseek_v3_tiny")
    return cfg, random_params(cfg, seed=11)


@pytest.mark.skipif(not ffi_moe_available(), reason="fused MoE FFI op not built (tools/build_ffi.sh)")
def test_hybrid_decode_with_ffi_experts_matches_greedy_rollout_with_the_same_expert_fn():
    from hmoe_jax.kernels.moe import moe_experts

    cfg, params = fp8_model()
    prompt = list(range(3, 13))
    ref = greedy_rollout(params, cfg, prompt, 5, expert_fn=moe_experts)
    eng = Engine(params, cfg, expert_fn="auto", precision="f32")
    assert eng.expert_fn_name == "auto"
    res = eng.generate(prompt, 5, schedule="cpu", stop_ids=())
    assert res.tokens == ref


def test_placement_errors_are_one_line_and_name_the_numbers():
    with pytest.raises(PlacementError, match="asked for 9 stand-in accelerators"):
        make_placement(9)
    with pytest.raises(PlacementError, match=">= 1"):
        make_placement(0)
    cfg, params = fp8_model()
    eng = Engine(params, cfg, expert_fn="ref", precision="f32")
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        eng.generate([1, 2, 3], 2, schedule="nope")
    with pytest.raises(ValueError, match="out of range"):
        eng.generate([1, cfg.vocab_size], 2, schedule="cpu")


def test_cli_generate_with_schedule_writes_trace_and_json(tmp_path, capsys):
    from hmoe_jax import cli

    trace = tmp_path / "t.json"
    rc = cli.main(
        [
            "generate",
            "--tokens",
            "5,6,7,8,9,10",
            "--max-new-tokens",
            "3",
            "--schedule",
            "slp",
            "--devices",
            "1",
            "--trace",
            str(trace),
            "--json",
            "--quiet",
            "--no-warmup",
            "--ignore-eos",
        ]
    )
    assert rc == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["schedule"] == rec["schedule_requested"] == "slp" and len(rec["tokens"]) == 3
    assert rec["streamed_bytes"] > 0
    tracks = {s["resource"] for s in load_slices(trace)}
    assert {"h2d:0", "acc:0", "cpu_experts"} <= tracks


def test_cli_engine_flag_errors(tmp_path, capsys):
    from hmoe_jax import cli

    base = ["generate", "--tokens", "5,6", "--quiet", "--no-warmup"]
    assert cli.main([*base, "--schedule", "slp", "--top-k", "-2"]) == 1
    assert "top_k must be >= 0" in capsys.readouterr().err
    assert cli.main([*base, "--top-k", "-1"]) == 1  # the plain path (reference) validates the same way
    assert "top_k must be >= 0" in capsys.readouterr().err
    assert cli.main([*base, "--seed", "-1"]) == 1
    assert "seed must be in [0, 2^32)" in capsys.readouterr().err
    assert cli.main([*base, "--schedule", "slp", "--link-gbps", "0"]) == 1
    assert "--link-gbps must be > 0" in capsys.readouterr().err
    assert cli.main([*base, "--schedule", "slp", "--acc-tflops-cap", "-1"]) == 1
    assert "--acc-tflops-cap must be > 0" in capsys.readouterr().err
    assert cli.main([*base, "--schedule", "cpu", "--trace", str(tmp_path / "no" / "t.json")]) == 1
    assert "--trace: directory" in capsys.readouterr().err
    assert cli.main([*base, "--schedule", "cpu", "--devices", "9"]) == 1
    assert "stand-in" in capsys.readouterr().err


def test_decode_placement_routed_experts_on_host_rest_on_accelerator(monkeypatch):
    from hmoe_jax.runtime import executor as X

    cfg, params = fp8_model()
    eng = Engine(params, cfg, devices=2, expert_fn="ref", precision="f32")
    host, acc = eng.placement.host, eng.placement.acc
    assert host != acc and acc == eng.placement.accelerators[0]
    where: dict[str, set] = {}
    kinds = (
        "embed",
        "attn",
        "dense_ffn",
        "route",
        "attn_route",
        "shared",
        "d2h",
        "experts_cpu",
        "h2d",
        "combine",
    )
    for kind in (*kinds, "final"):
        fn = X.HANDLERS[kind]

        def spy(run, op, fn=fn):
            outs = fn(run, op)
            where.setdefault(op.kind, set()).update(d for a in outs for d in a.devices())
            return outs

        monkeypatch.setitem(X.HANDLERS, kind, spy)
    cache = eng.new_cache(64)
    unfused, *_ = eng.prefill(
        list(range(3, 9)), cache, "cpu", fused=False, all_logits=True
    )  # attn, route ops
    eng.decode_step(5, 6, cache)  # fused attn_route
    fused, *_ = eng.prefill(list(range(3, 9)), eng.new_cache(64), "cpu", all_logits=True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused), atol=1e-5, rtol=1e-5)
    on_host = {"d2h", "experts_cpu"}
    for kind, devs in where.items():
        assert devs == ({host} if kind in on_host else {acc}), f"{kind} ran on {devs}"
    assert set(where) >= {"attn", "route", "attn_route", "shared", "experts_cpu", "combine", "final"}


@pytest.mark.parametrize("mode", ["pipelined", "serial", "async"])
def test_executor_errors_surface_without_hanging(mode, monkeypatch):
    from hmoe_jax.plan.format import Op, Plan, PlanError
    from hmoe_jax.runtime import executor as X

    cfg, params = fp8_model()
    eng = Engine(params, cfg, expert_fn="ref", precision="f32")
    run = X.Run(cfg, eng.weights, eng.new_cache(64), np.zeros((1, 4), np.int32), 0, eng.host_expert_fn)

    def boom(run, op):
        raise RuntimeError(f"boom in op {op.id}")

    monkeypatch.setitem(X.HANDLERS, "boom", boom)
    monkeypatch.setitem(X.HANDLERS, "noop", lambda run, op: [])
    plan = Plan(
        "t", 4, (Op(0, "noop", "a:0"), Op(1, "boom", "b:0", deps=(0,)), Op(2, "noop", "a:0", deps=(1,)))
    )
    with pytest.raises(RuntimeError, match="boom in op 1"):
        X.execute(plan.validate(), run, mode)
    with pytest.raises(PlanError, match="no handler for kind 'nope'"):
        X.execute(Plan("t", 4, (Op(0, "nope", "a:0"),)), run, mode)
    with pytest.raises(ValueError, match="mode 'fast'"):
        X.execute(plan, run, "fast")


@pytest.mark.parametrize("schedule", ["cpu", "slp"])
def test_a_second_prefill_into_the_same_cache_compiles_nothing(schedule):
    """The pieces return committed caches; a fresh cache must be committed too, or the second
    prefill into it (and the first Scheduler round after warm-up) compiles every piece that
    takes the cache again (it did: ~0.8 s per piece on the bench twin)."""
    import jax
    from jax import monitoring

    cfg, params = fp8_model()
    eng = Engine(params, cfg, expert_fn="ref", precision="bf16")
    ids = np.arange(3, 19, dtype=np.int32)
    cache = eng.new_cache(64)
    eng.prefill(ids, cache, schedule=schedule)
    compiled: list[float] = []

    def listen(event: str, secs: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(secs)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        eng.prefill(ids, cache, schedule=schedule)
        eng.prefill(ids, eng.new_cache(64), schedule=schedule)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiled == [], f"{len(compiled)} compiles in a repeated {schedule} prefill"
    assert all(a.committed for a in eng.new_cache(64).latent + eng.pool.rope)
    jax.block_until_ready(cache.latent)
