"""Simulator validation on this machine (e03, e04): the same workload through the engine and
through hmoe_jax/sim/, side by side.

The profile is configs/systems/local.toml (written by `hmoe calibrate`); the one input
re-measured in the run is the host read rate (this VM's moves 2x within minutes): a read
probe (hmoe_jax/measure/probes.ReadProbe) right before each timed engine call, and the profile re-based on the median of the
probes of the rows it predicts (Profile.with_read_gbps). The kernels' efficiencies, rates
and overheads stay as calibrated. No input is fitted to an engine time.

One plan, one spec: the engine of a validation row plans on validation_system(), the
SystemSpec of the same local profile (and emulated link) the simulator times it on, with
the same plan options (sim.run.plan_options, through engine_prefill_options and
engine_decode_plan), so the engine runs the plan the simulator times, op for op
(tests/test_sim_oneplan.py checks it through Engine.plan on the rows' shapes). Before this,
make_engine used SystemSpec() (the paper box's defaults; issue 27 read a 2-slot ring in the
e04 slp rows of its records against local.toml's 32), prefills were planned for a cache of
the prompt's length and decode steps at position 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from hmoe_jax.measure.probes import ReadProbe


def local_profile(
    read_gbps: float | None = None,
    link_gbps: float | None = None,
    peak_tflops: float | None = None,
    stream_gbps: float | None = None,
):
    """configs/systems/local.toml re-based on the side-by-side probes of the run it predicts
    (Profile.with_host_state: the read rate always, by the stream probe when the row has one
    and the profile holds that probe's reading at calibration, else by the read probe; the
    host-core rates by the compute probe when the profile holds its reading). Records
    from before the stream probe (no probe_stream_gbps) re-simulate as they were."""
    from hmoe_jax.plan.profile import load_profile

    prof = load_profile("local")
    if read_gbps is not None:
        why = f"measured: side-by-side probes in this run, read {read_gbps:.1f} GB/s"
        if stream_gbps is not None and "stream_probe_gbps" in prof.values["cpu"]:
            why += f", stream probe {stream_gbps:.1f} GB/s"
        if peak_tflops is not None and "compute_probe_tflops" in prof.values["cpu"]:
            why += f", compute probe {peak_tflops:.3f} TFLOPS"
        prof = prof.with_host_state(read_gbps, peak_tflops, why, stream_gbps=stream_gbps)
    if link_gbps is not None:
        prof = prof.with_link(link_gbps)
    return prof


def validation_system(link_gbps: float | None = None, devices: int = 1):
    """The SystemSpec the engine of a validation row plans with: local.toml's (with the
    emulated link's cap when there is one), exactly what the simulator's build_plan derives
    from the profile it times the row on (the read-probe re-basing changes no SystemSpec
    field)."""
    from hmoe_jax.plan.system import SystemSpec

    return SystemSpec.from_profile(local_profile(link_gbps=link_gbps).with_accelerators(devices))


def engine_prefill_options(eng) -> dict[str, Any]:
    """The pool options of the engine's validation prefill plan: one row of the engine's
    cache length (measure_prefill prefills into eng.new_cache(eng.max_len)), the options the
    simulator's simulate_request(..., max_len=eng.max_len) plans with (sim.run.plan_options)."""
    from hmoe_jax.sim.run import plan_options

    return plan_options(1, eng.max_len)


def engine_decode_plan(eng, batch: int, context: int):
    """The decode plan the engine runs for a validation row of `batch` rows at `context`:
    the cpu schedule's decode plan with the options the simulator's decode_step_plan(...,
    max_len=eng.max_len) plans with (sim.run.plan_options)."""
    from hmoe_jax.sim.run import plan_options

    return eng.plan("cpu", 1, context, **plan_options(batch, eng.max_len, decode=True))


def bench_params(quick: bool):
    """The real-shape bench twin of e22 (DeepSeek-V3 layer dims, 2 MoE layers) and its
    random FP8 params (16 experts and vocab 2,048 with --quick)."""
    from hmoe_jax.io.bench_twin import bench_twin_config, fp8_twin_params

    cfg = bench_twin_config(quick=quick)
    t0 = time.perf_counter()
    params = fp8_twin_params(cfg)
    print(
        f"[setup] bench twin ({cfg.n_routed_experts} experts) in {time.perf_counter() - t0:.1f} s", flush=True
    )
    return cfg, params


def make_engine(cfg, params, max_len: int, max_batch: int, link_gbps: float | None = None):
    from hmoe_jax.engine.engine import Engine

    return Engine(
        params,
        cfg,
        system=validation_system(link_gbps),
        precision="bf16",
        expert_fn="auto",
        max_batch=max_batch,
        max_len=max_len,
        link_gbps=link_gbps,
    )


def bench_engine(quick: bool, max_len: int, max_batch: int, link_gbps: float | None = None):
    cfg, params = bench_params(quick)
    return cfg, make_engine(cfg, params, max_len, max_batch, link_gbps)


def _median_or_none(xs: list[float | None]) -> float | None:
    """The median of the probes that ran (ReadProbe.tflops is None on a CPU without
    AVX-512-BF16: the compute probe is recorded, not used), None if none did."""
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def measure_decode(
    eng, batches: list[int], steps: int, prompt_len: int, probe: ReadProbe, seed: int = 1
) -> list[dict]:
    """Median decode step per batch size, a read probe before each step, batch sizes and the
    two executor modes interleaved: "serial" (each op dispatched, then waited for: the
    blocking executor the simulator models) and "async" (the engine's default decode mode:
    ops queued through JAX's async dispatch)."""
    from hmoe_jax.model.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    cfg = eng.cfg
    sets = {
        b: [
            eng.start(
                [int(t) for t in rng.integers(2, cfg.vocab_size, prompt_len)],
                SamplingParams(max_new_tokens=2 * steps + 4, stop_ids=()),
                schedule="cpu",
            )
            for _ in range(b)
        ]
        for b in batches
    }

    context = prompt_len + 2 + steps  # the position the simulated step is timed at
    plans = {b: engine_decode_plan(eng, b, context) for b in batches}

    def step(seqs, mode: str) -> float:
        # Engine.decode_rows with the validation plan (built above, as the engine builds its
        # decode plan once per batch size): the plan the simulator times for this row
        t0 = time.perf_counter()
        toks, rows, pos = eng.step_inputs(seqs)
        b = len(rows)
        run, _ = eng.run_plan(
            plans[b], np.asarray(toks, np.int32).reshape(b, 1), eng.pool, pos, rows=rows, mode=mode
        )
        eng.take_step(seqs, run.logits[-1][:, -1], 0.0)
        return time.perf_counter() - t0

    modes = ("serial", "async")
    for b in batches:
        for mode in modes:
            step(sets[b], mode)  # compile
    times = {(b, m): [] for b in batches for m in modes}
    bws: dict[int, list[float]] = {b: [] for b in batches}
    pks: dict[int, list[float]] = {b: [] for b in batches}
    sts: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(steps):
        for b in batches:
            for mode in modes:
                bws[b].append(probe.gbps())
                pks[b].append(probe.tflops())
                sts[b].append(probe.stream_gbps())
                times[(b, mode)].append(step(sets[b], mode))
    rows = []
    for b in batches:
        rows.append(
            {
                "batch": b,
                "context": context,
                "measured_step_s": statistics.median(times[(b, "serial")]),
                "measured_step_s_async": statistics.median(times[(b, "async")]),
                "probe_gbps": statistics.median(bws[b]),
                "probe_tflops": _median_or_none(pks[b]),
                "probe_stream_gbps": statistics.median(sts[b]),
                "steps": steps,
            }
        )
        for s in sets[b]:
            eng.cancel(s)
    return rows


def measure_prefill(
    eng, schedule: str, lengths: list[int], reps: int, probe: ReadProbe, seed: int = 2
) -> list[dict]:
    """Median prefill wall time per prompt length (the engine's pipelined executor)."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        ids = rng.integers(2, eng.cfg.vocab_size, n).astype(np.int32)
        cache = eng.new_cache(eng.max_len)
        opts = engine_prefill_options(eng)
        eng.prefill(ids, cache, schedule=schedule, **opts)  # compile
        ts, bws, pks, sts = [], [], [], []
        for _ in range(reps):
            bws.append(probe.gbps())
            pks.append(probe.tflops())
            sts.append(probe.stream_gbps())
            t = time.perf_counter()
            _, _, secs, _ = eng.prefill(ids, cache, schedule=schedule, **opts)
            ts.append(time.perf_counter() - t)
        rows.append(
            {
                "schedule": schedule,
                "prompt_len": n,
                "measured_prefill_s": statistics.median(ts),
                "probe_gbps": statistics.median(bws),
                "probe_tflops": _median_or_none(pks),
                "probe_stream_gbps": statistics.median(sts),
                "reps": reps,
            }
        )
    return rows


def errors(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Mean absolute and signed % error of (simulated, measured) pairs (+: sim too high)."""
    errs = [100.0 * (s - m) / m for s, m in pairs]
    if not errs:
        return {"mean_abs_pct": None, "mean_signed_pct": None, "n": 0}
    return {
        "mean_abs_pct": statistics.mean(abs(e) for e in errs),
        "mean_signed_pct": statistics.mean(errs),
        "max_abs_pct": max(abs(e) for e in errs),
        "n": len(errs),
    }


PROJECTION_KEYS = ("schedule", "prompt_len", "ttft_s", "prefill_tok_per_s", "fits", "memory_message")


def prefill_projection_row(r: dict[str, Any], prof: Any) -> dict[str, Any]:
    """One prefill projection of DeepSeek-V3 on `prof` (a simulate_request result) as a
    record row: its times, the resource that bound it and the op time per kind."""
    return {
        "part": "projection",
        "model": "deepseek_v3",
        "profile": prof.name,
        "accelerators": prof.accelerators,
        **{k: r[k] for k in PROJECTION_KEYS},
        "bound": r["binding"]["prefill"],
        "binding_share": r["prefill"]["binding_share"],
        "op_s_by_kind": {k: round(v["op_s"], 3) for k, v in r["prefill"]["by_kind"].items()},
    }
