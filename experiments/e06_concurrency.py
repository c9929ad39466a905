"""e06: concurrency (the paper's technique 3) through the request API, on stand-in devices.

Claims (paper section on concurrency): aggregate decode throughput at batch 2 / 4 / 6 is
1.56x / 1.58x / 1.61x of batch 1; under mixed prefill/decode, intra-node P/D disaggregation
keeps the latency increase under 15% (TTFT of the prefill, TPOT of the decodes, each vs the
request alone) with one shared host copy of the weights; dual-batch attention/MoE overlap
gains up to (A + M) / max(A, M) over running the two micro-batches one after the other.

Parts, all measured in this run:
1. Batch 1/2/4/6: B requests submitted together to the Scheduler (paper policy, dual
   batching off); aggregate tokens/s while all B decode, per-request TPOT. Rounds
   interleave the batch sizes (side by side on this noisy VM), medians.
2. Dual vs plain at B = 2/4/6: one decode step of the B sequences as (plain) one batch,
   (sequential) its two halves one after the other, (dual) the two halves overlapped
   (engine/dual.py). A and M per MoE layer from a traced half-batch step give the bound;
   the trace of one dual step is kept in the record (the figure draws it).
3. Mixes 1P / 1P+1D / 1P+2D: k decoding requests run, then a long prompt arrives; TTFT of
   the prompt and TPOT of the decodes while it prefills, each against the same request
   alone on the same backend. Backends: fcfs (no technique 3: the prefill blocks decoding),
   the in-process paper policy (SLP on accelerator 1 in a background lane while
   accelerator 0 decodes), and P/D disaggregation (serve/pd.py: a prefill and a decode OS
   process, one shared weight arena, KV handed over through shared memory).

4. Simulator validation: every mix round above replayed through the simulator
   (hmoe_jax/sim/serve.py: the same policy objects on a simulated clock, this machine's
   calibrated profile with the read rate of the probes taken beside the mixes): TTFT, TPOT
   and end-to-end errors, per request and of the p90s.
5. Projection (simulator, labelled): DeepSeek-V3 FP8 on the paper's machine (2x RTX 5090,
   2x EPYC 9355): batch 2/4/6 gains, dual vs plain with its bound, and the three backends'
   mixes with a 16K-token prompt (4K with --quick).

Everything here shares 2 CPU cores: the stand-in accelerators ARE those cores, so a
prefill and a decode contend for the same compute and DRAM that two GPUs plus a CPU would
not; the inflations are this machine's, not a projection (the simulator issue owns those).

Model: --quick: the embedded tiny default (about a minute). Full: the real-shape DeepSeek-V3
bench twin of e22 (2 MoE layers of real dims, 32 experts top-8 + shared, vocab 8,192),
written once as a weight arena under the cache (both P/D workers map it).

    python -m experiments.e06_concurrency [--quick]
    python -m experiments.e06_concurrency --resim results/e06_concurrency_<stamp>.json
      (parts 4-5 again on that record's measured rows, with today's simulator: a new record
      under results/resim/ that names the one it re-simulates)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.record import emit_record, parse_args, print_ceiling
from hmoe_jax.sim.replay import replay_log, window_tpot

PAPER = {
    "batch2_throughput_gain": 1.56,
    "batch4_throughput_gain": 1.58,
    "batch6_throughput_gain": 1.61,
    "worst_ttft_inflation": "< 1.15 (under 15% latency increase)",
    "worst_tpot_inflation": "< 1.15 (under 15% latency increase)",
    "mixed_throughput_gain": "1.5 (50% more throughput)",
    "pd_weight_pss_ratio": "1.0 (zero-copy shared weights)",
}


def greedy(n: int):
    from hmoe_jax.model.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, stop_ids=())


def prompts_of(cfg, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(2, cfg.vocab_size, length)] for _ in range(n)]


# ---------------------------------------------------------------- model


def build_model(quick: bool):
    """(cfg, params, checkpoint dir for the P/D workers, description)."""
    from hmoe_jax.io.arena import arena_config, is_arena, load_arena, write_arena
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.synthetic import cache_root, ensure_default_checkpoint

    if quick:
        ckpt = ensure_default_checkpoint(progress=False)
        cfg, params = load_checkpoint(ckpt, progress=False)
        return cfg, params, ckpt, "embedded tiny default (synthetic FP8)"
    from hmoe_jax.io.bench_twin import bench_twin_config, fp8_twin_params

    cfg = bench_twin_config()
    root = Path(cache_root()) / "e06_bench_twin_arena"
    if not (is_arena(root) and arena_config(root) == cfg):
        t0 = time.perf_counter()
        params = fp8_twin_params(cfg)
        write_arena(params, root, cfg=cfg, progress=True)
        del params
        print(f"[setup] bench twin arena written to {root} in {time.perf_counter() - t0:.1f} s", flush=True)
    cfg, params = load_arena(root, cfg=cfg, progress=False)
    return cfg, params, root, "deepseek_v3 bench twin (2 MoE layers of real dims, 32 experts, vocab 8192)"


# ---------------------------------------------------------------- part 1: batch sizes


def run_batch(eng, prompts, n_new: int) -> dict:
    """All prompts submitted at once to a fresh Scheduler; throughput over the window where
    every request decodes (after the last first token), per-request TPOT in it."""
    from hmoe_jax.serve.scheduler import Scheduler

    b = len(prompts)
    sched = Scheduler(
        eng, "paper", decode_cap=b, chunk_tokens=4096, long_prompt_tokens=1 << 30, dual_batch="off"
    )
    hs = [sched.submit(p, greedy(n_new)) for p in prompts]
    sched.drain(1800)
    rs = [h.result(1) for h in hs]
    start = max(r.first_token_s for r in rs)
    end = min(r.token_s[-1] for r in rs)  # all B are decoding in [start, end]
    in_window = sum(sum(1 for t in r.token_s if start < t <= end) for r in rs)
    tpots = []
    for r in rs:
        t = [x for x in r.token_s if x >= start]
        gaps = np.diff(t)
        if gaps.size:
            tpots.append(float(np.median(gaps)))
    return {"tok_per_s": in_window / max(end - start, 1e-9), "tpot_s": float(np.median(tpots))}


def batch_scaling(eng, cfg, batches, rounds: int, n_new: int, prompt_len: int) -> list[dict]:
    prompts = prompts_of(cfg, max(batches), prompt_len, seed=1)
    for b in batches:  # compile each batch size's decode and the prefill (all b join first)
        run_batch(eng, prompts[:b], b + 3)
    got: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(rounds):
        for b in batches:
            got[b].append(run_batch(eng, prompts[:b], n_new))
        print(
            f"[batch round {r + 1}/{rounds}] "
            + ", ".join(f"B={b}: {got[b][-1]['tok_per_s']:.1f} tok/s" for b in batches),
            flush=True,
        )
    rows = []
    for b in batches:
        rows.append(
            {
                "part": "batch",
                "batch": b,
                "tok_per_s_median": statistics.median(x["tok_per_s"] for x in got[b]),
                "tpot_s_median": statistics.median(x["tpot_s"] for x in got[b]),
                "rounds": rounds,
                "new_tokens": n_new,
            }
        )
    return rows


# ---------------------------------------------------------------- part 2: dual vs plain


def compact_trace(tr) -> list[dict]:
    t0 = min(s["start_ns"] for s in tr.slices)
    return [
        {
            "resource": s["resource"],
            "name": s["name"],
            "batch": s["args"].get("batch"),
            "layer": s["args"].get("layer"),
            "start_us": (s["start_ns"] - t0) / 1e3,
            "dur_us": (s["end_ns"] - s["start_ns"]) / 1e3,
        }
        for s in sorted(tr.slices, key=lambda s: s["start_ns"])
    ]


def time_arms(eng, seqs, g0, g1, rounds: int) -> dict[str, list[float]]:
    """Step times of the three arms, round-robin (side by side): plain = one batch of all,
    sequential = the two halves one after the other, dual = the halves overlapped."""
    from hmoe_jax.engine.dual import dual_step

    arms = {
        "plain": lambda: dual_step(eng, [seqs]),
        "sequential": lambda: (dual_step(eng, [g0]), dual_step(eng, [g1])),
        "dual": lambda: dual_step(eng, [g0, g1]),
    }
    for fn in arms.values():
        fn()  # compile
    got: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for k, fn in arms.items():
            t = time.perf_counter()
            fn()
            got[k].append(time.perf_counter() - t)
    return got


def auto_pick(eng, cfg, b: int, prompt_len: int) -> bool:
    """What the paper policy's dual_batch="auto" runs for b decoding requests once it has
    measured one step of each arm: True for dual."""
    from hmoe_jax.serve.scheduler import Scheduler

    sched = Scheduler(eng, "paper", decode_cap=b, chunk_tokens=4096, long_prompt_tokens=1 << 30)
    hs = [sched.submit(p, greedy(6)) for p in prompts_of(cfg, b, prompt_len, 5)]
    sched.drain(600)
    for h in hs:
        h.result(1)
    decodes = [a for it in sched.log for a in it["actions"] if a["kind"] == "decode" and not a["measure"]]
    if not decodes:
        raise RuntimeError(f"auto_pick: the policy never decided for batch {b}: {sched.log}")
    return decodes[-1]["micro_batches"] >= 2


def dual_vs_plain(eng, cfg, batches, rounds: int, prompt_len: int) -> tuple[list[dict], list[dict]]:
    from hmoe_jax.engine.dual import dual_step, layer_times, split_micro_batches
    from hmoe_jax.plan.trace import TraceRecorder
    from hmoe_jax.policies.base import dual_gain_estimate, overlap_bound

    rows, trace = [], []
    steps = 3 * rounds + 6
    for b in batches:
        seqs = [eng.start(p, greedy(steps + 4), schedule="cpu") for p in prompts_of(cfg, b, prompt_len, 2)]
        g0, g1 = split_micro_batches(seqs)

        got = time_arms(eng, seqs, g0, g1, rounds)

        def traced(grp, tr):
            toks, rws, pos = eng.step_inputs(grp)
            lg = eng.decode_rows(toks, rws, pos, eng.pool, tr, mode="pipelined")
            eng.take_step(grp, lg, 0.0)

        times = {}
        tr = TraceRecorder()
        traced(g0, tr)
        traced(g1, None)  # keep the halves at the same length
        times["half"] = layer_times(tr, 0)
        tr = TraceRecorder()
        traced(seqs, tr)
        times["full"] = layer_times(tr, 0)
        tr = TraceRecorder()
        dual_step(eng, [g0, g1], tr)
        if b == max(batches):
            trace = compact_trace(tr)
        med = {k: statistics.median(v) for k, v in got.items()}
        picked = auto_pick(eng, cfg, b, prompt_len)
        a_s, m_s = times["half"]
        rows.append(
            {
                "part": "dual",
                "batch": b,
                "plain_step_s": med["plain"],
                "sequential_step_s": med["sequential"],
                "dual_step_s": med["dual"],
                "dual_gain_vs_sequential": med["sequential"] / med["dual"],
                "dual_gain_vs_plain": med["plain"] / med["dual"],
                "attn_layer_s": a_s,
                "moe_layer_s": m_s,
                "full_attn_layer_s": times["full"][0],
                "full_moe_layer_s": times["full"][1],
                "bound": overlap_bound(a_s, m_s),
                "policy_estimate_plain_over_dual": dual_gain_estimate(times["half"], times["full"]),
                "auto_policy_picked_dual": picked,
                "rounds": rounds,
            }
        )
        r = rows[-1]
        print(
            f"[dual B={b}] plain {med['plain'] * 1e3:.1f} ms, two halves {med['sequential'] * 1e3:.1f} ms, "
            f"dual {med['dual'] * 1e3:.1f} ms: gain {r['dual_gain_vs_sequential']:.2f}x (bound "
            f"{r['bound']:.2f}x from A={a_s * 1e3:.2f} ms, M={m_s * 1e3:.2f} ms), vs plain "
            f"{r['dual_gain_vs_plain']:.2f}x",
            flush=True,
        )
        for s in seqs:
            eng.cancel(s)
    return rows, trace


# ---------------------------------------------------------------- part 3: mixes


def _wait_tokens(hs, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(h.request.tokens) < n for h in hs):
        if time.monotonic() > deadline:
            raise TimeoutError("decodes did not start")
        time.sleep(0.002)


def run_mix(backend, long_prompt, shorts, k: int, dec_tokens: int) -> dict:
    """k decodes run (each has a few tokens), then the long prompt arrives; TTFT of the
    prompt, TPOT of the decodes between its arrival and its first token."""
    hs = [backend.submit(p, greedy(dec_tokens)) for p in shorts[:k]]
    _wait_tokens(hs, 3)
    p = backend.submit(long_prompt, greedy(2))
    pr = p.result(1800)
    t0, t1 = pr.submitted_s, pr.first_token_s
    deadline = time.monotonic() + 600  # each decode's first token after the prefill's first
    while not all(h.request.done or (h.request.token_s and h.request.token_s[-1] >= t1) for h in hs):
        if time.monotonic() > deadline:
            raise TimeoutError("decodes stopped after the prefill")
        time.sleep(0.002)
    for h in hs:
        h.cancel()
    decs = [h.result(600) for h in hs]
    short = [r for r in decs if r.token_s and r.token_s[-1] < t1]
    out = {"ttft_s": pr.timings()["ttft_s"], "tpot_s": window_tpot(decs, t0, t1) if k else None}
    out["decodes_ended_early"] = len(short)
    everyone = [*decs, pr]
    out["requests"] = replay_log(everyone, min(r.submitted_s for r in everyone))
    out.update({k_: v for k_, v in pr.meta.items() if k_.endswith("_s") or k_ == "kv_bytes"})
    return out


def alone(backend, long_prompt, shorts, k: int, dec_tokens: int, max_tokens: int) -> dict:
    """The long prompt alone (TTFT); then k decodes alone: each may take max_tokens (a
    backend that prefills one request at a time, like P/D, starts them a prefill apart), and
    once all k decode, dec_tokens steps of all k are timed and the decodes cancelled."""
    pr = backend.submit(long_prompt, greedy(2)).result(1800)
    ttft, tpot, logs = pr.timings()["ttft_s"], None, [replay_log([pr], pr.submitted_s)]
    if k:
        hs = [backend.submit(p, greedy(max_tokens)) for p in shorts[:k]]
        _wait_tokens(hs, 2, 1800)  # the second token: the first may come from another process
        start = max(h.request.token_s[1] for h in hs)
        deadline = time.monotonic() + 600
        while any(sum(1 for t in h.request.token_s if t > start) < dec_tokens for h in hs):
            if time.monotonic() > deadline:
                raise TimeoutError("decodes stalled")
            time.sleep(0.002)
        for h in hs:
            h.cancel()
        rs = [h.result(600) for h in hs]
        tpot = window_tpot(rs, start, min(r.token_s[-1] for r in rs))
        logs.append(replay_log(rs, min(r.submitted_s for r in rs)))
    return {"ttft_s": ttft, "tpot_s": tpot, "requests": logs}


def _brief(runs: list[dict]) -> list[dict]:
    return [{k: v for k, v in x.items() if k != "requests"} for x in runs]


def mixes(
    name: str, backend, long_prompt, shorts, dec_tokens: int, rounds: int, max_len: int, probe
) -> list[dict]:
    rows = []
    mix_tokens = max_len - max(len(p) for p in shorts) - 1  # decodes outlast the prefill (cancelled)
    # warm: compile every prefill path (idle node, decode recent) and decode shape
    alone(backend, long_prompt, shorts, 2, dec_tokens, mix_tokens)
    run_mix(backend, long_prompt, shorts, 2, mix_tokens)
    run_mix(backend, long_prompt, shorts, 1, mix_tokens)

    def settled_probes() -> tuple[float, float | None, float]:
        # the host read rate, compute probe and stream probe beside the runs (the simulator's
        # replay inputs), not our own backend's tail: a probe right after a P/D round read
        # 15-17 GB/s against 28-31 GB/s half a second later (its workers finish the cancelled
        # decodes' last steps)
        time.sleep(0.5)
        gbps = statistics.median(probe.gbps() for _ in range(3))
        tflops = [probe.tflops() for _ in range(3)]
        stream = statistics.median(probe.stream_gbps() for _ in range(3))
        return gbps, None if None in tflops else statistics.median(tflops), stream

    for k in (0, 1, 2):
        probes = [settled_probes()]
        ref = [alone(backend, long_prompt, shorts, k, dec_tokens, mix_tokens) for _ in range(rounds)]
        probes.append(settled_probes())
        mix = [run_mix(backend, long_prompt, shorts, k, mix_tokens) for _ in range(rounds)]
        probes.append(settled_probes())
        gbps = [g for g, _, _ in probes]
        tflops = [t for _, t, _ in probes]
        print(f"  [{name} k={k}] alone {_brief(ref)}, mix {_brief(mix)}", flush=True)
        ttft_a = statistics.median(x["ttft_s"] for x in ref)
        ttft_m = statistics.median(x["ttft_s"] for x in mix)
        row = {
            "part": "mix",
            "backend": name,
            "mix": f"1P+{k}D" if k else "1P",
            "ttft_alone_s": ttft_a,
            "ttft_mix_s": ttft_m,
            "ttft_inflation": ttft_m / ttft_a,
            "rounds": rounds,
            "probe_gbps": statistics.median(gbps),
            "probe_tflops": None if None in tflops else statistics.median(tflops),
            "probe_stream_gbps": statistics.median(st for _, _, st in probes),
            # each round's requests as measured (arrivals, token times): the simulator replays them
            "replay_alone": [x["requests"] for x in ref],
            "replay_mix": [x["requests"] for x in mix],
        }
        if k:
            tpa = statistics.median(x["tpot_s"] for x in ref)
            tpm = statistics.median(x["tpot_s"] for x in mix if x["tpot_s"] is not None)
            row.update({"tpot_alone_s": tpa, "tpot_mix_s": tpm, "tpot_inflation": tpm / tpa})
            # the same work one after the other (prefill alone, then the decode tokens the mix
            # produced during the prefill at the alone rate) over the mix's time for it
            dec_per_seq = ttft_m / tpm
            row["mixed_throughput_gain"] = (ttft_a + dec_per_seq * tpa) / ttft_m
        for key in ("handover_s", "export_s", "import_s", "kv_bytes"):
            vals = [x[key] for x in mix if key in x]
            if vals:
                row[key] = statistics.median(vals)
        rows.append(row)
        print(
            f"[mix {name} {row['mix']}] TTFT {ttft_m:.3f} s vs {ttft_a:.3f} s alone ({row['ttft_inflation']:.2f}x)"
            + (
                f", TPOT {row['tpot_mix_s'] * 1e3:.1f} ms vs {row['tpot_alone_s'] * 1e3:.1f} ms alone "
                f"({row['tpot_inflation']:.2f}x)"
                if k
                else ""
            ),
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- main

CLAIM = (
    "batched decode 1.56/1.58/1.61x at B=2/4/6; under 15% TTFT/TPOT increase under mixed "
    "prefill/decode with P/D disaggregation on one shared weight copy; dual-batch gain vs its bound"
)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--resim" in argv:  # parts 4-5 of a measured record again, with today's simulator
        i = argv.index("--resim")
        path = argv[i + 1]
        args = parse_args("e06_concurrency", __doc__, argv[:i] + argv[i + 2 :])
        if "--out-dir" not in argv:  # beside the records, not among them: the claims table reads runs
            args.out_dir = str(Path(args.out_dir) / "resim")
        from experiments.common.simserve import resimulate

        config, rows, summary = resimulate(path)
        args.quick = config.pop("quick")
        return emit_record(args, claim=CLAIM, paper_value=PAPER, config=config, rows=rows, summary=summary)
    args = parse_args("e06_concurrency", __doc__, argv)
    from hmoe_jax.runtime.placement import configure_stand_ins

    configure_stand_ins(2)
    from experiments.common.simserve import project, validate_mixes
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.measure.probes import ReadProbe
    from hmoe_jax.plan.system import SystemSpec
    from hmoe_jax.serve.pd import PDCoordinator
    from hmoe_jax.serve.scheduler import Scheduler

    quick = args.quick
    t_start = time.perf_counter()
    cfg, params, ckpt, model_desc = build_model(quick)
    probe = ReadProbe()
    batches = [1, 2, 4] if quick else [1, 2, 4, 6]
    long_len = 160 if quick else 128
    max_len = 256 if quick else 512
    opts = dict(precision="bf16", max_len=max_len, max_batch=8)
    eng = Engine(params, cfg, devices=2, system=SystemSpec(num_accelerators=2), **opts)
    print(f"[setup] {model_desc}; engine on 2 stand-in accelerators, bf16 policy", flush=True)
    print_ceiling("dual-batch gain", bound="(A + M) / max(A, M) from measured per-layer A, M")

    rows = batch_scaling(eng, cfg, batches, rounds=3 if quick else 3, n_new=8 if quick else 12, prompt_len=16)
    dual_rows, trace = dual_vs_plain(eng, cfg, [b for b in batches if b >= 2], 3 if quick else 5, 16)
    rows += dual_rows

    long_prompt = prompts_of(cfg, 1, long_len, 3)[0]
    shorts = prompts_of(cfg, 2, 16, 4)
    dec_tokens = 24
    mix_rounds = 1 if quick else 2
    fcfs = Scheduler(eng, "fcfs", decode_cap=6).start()
    rows += mixes("fcfs (no technique 3)", fcfs, long_prompt, shorts, dec_tokens, mix_rounds, max_len, probe)
    fcfs.close()
    paper = Scheduler(
        eng, "paper", decode_cap=6, chunk_tokens=64, long_prompt_tokens=long_len // 2, dual_batch="off"
    ).start()
    rows += mixes(
        "in-process paper policy", paper, long_prompt, shorts, dec_tokens, mix_rounds, max_len, probe
    )
    paper.close()
    eng.close()
    del eng, params

    t0 = time.perf_counter()
    pd = PDCoordinator(
        ckpt,
        engine={"precision": "bf16", "max_len": max_len},
        schedule="slp",
        decode_cap=6,
        touch_weights=True,
    ).wait_ready(900)
    pd_start_s = time.perf_counter() - t0
    try:
        rows += mixes("P/D disaggregation", pd, long_prompt, shorts, dec_tokens, mix_rounds, max_len, probe)
        pss = pd.weight_pss()
    finally:
        pd.close()
    print(
        f"[P/D] workers ready in {pd_start_s:.1f} s; arena {pss['arena_kb'] / 1024:.0f} MiB, pair PSS "
        f"{pss['pss_ratio']:.2f}x one copy (RSS {pss['rss_ratio']:.2f}x)",
        flush=True,
    )

    # 4: the measured mixes replayed on the simulator (this machine's profile, 2 stand-ins,
    # each mix row's read probe); 5: the projection on the paper's machine
    t0 = time.perf_counter()
    val_rows, val_summary = validate_mixes(cfg, rows, 2, long_len, max_len)
    proj_rows, proj_summary, proj_inputs = project(quick)
    print(
        f"[sim] validation: p90 error TTFT {val_summary.get('sim_error_ttft_p90', float('nan')):.1f}%, TPOT "
        f"{val_summary.get('sim_error_tpot_p90', float('nan')):.1f}%; projection (paper machine): worst P/D "
        f"TTFT x{proj_summary['projected_worst_ttft_inflation']:.3f}, TPOT "
        f"x{proj_summary['projected_worst_tpot_inflation']:.3f}; {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    rows += val_rows + proj_rows

    by_b = {r["batch"]: r for r in rows if r["part"] == "batch"}
    duals = [r for r in rows if r["part"] == "dual"]
    best = max(duals, key=lambda r: r["dual_gain_vs_sequential"])
    mixes_pd = [r for r in rows if r["part"] == "mix" and r["backend"] == "P/D disaggregation"]
    mixes_in = [r for r in rows if r["part"] == "mix" and r["backend"] == "in-process paper policy"]
    mixes_fc = [r for r in rows if r["part"] == "mix" and r["backend"].startswith("fcfs")]

    def worst(rs, key):
        vals = [r[key] for r in rs if key in r]
        return max(vals) if vals else None

    from hmoe_jax.policies.paper import PaperPolicy

    min_gain = float(PaperPolicy.defaults["dual_min_gain"])
    summary = {
        **{
            f"batch{b}_throughput_gain": by_b[b]["tok_per_s_median"] / by_b[1]["tok_per_s_median"]
            for b in batches
            if b > 1
        },
        "decode_tok_per_s_b1": by_b[1]["tok_per_s_median"],
        "tpot_s_b1": by_b[1]["tpot_s_median"],
        "dual_batch_gain": best["dual_gain_vs_sequential"],
        "dual_batch_bound": best["bound"],
        "dual_batch_gain_batch": best["batch"],
        "dual_vs_plain": best["dual_gain_vs_plain"],
        # what the paper policy's dual_batch="auto" ran (after measuring one step of each
        # arm), against the arms' medians: dual only where it won, plain where it did not win
        # by dual_min_gain
        "auto_policy_picks_dual": {r["batch"]: r["auto_policy_picked_dual"] for r in duals},
        "auto_policy_right": all(
            (r["dual_gain_vs_plain"] > 1.0)
            if r["auto_policy_picked_dual"]
            else (r["dual_gain_vs_plain"] < min_gain)
            for r in duals
        ),
        "worst_ttft_inflation": worst([r for r in mixes_pd if r["mix"] != "1P"], "ttft_inflation"),
        "worst_tpot_inflation": worst(mixes_pd, "tpot_inflation"),
        "worst_ttft_inflation_inprocess": worst([r for r in mixes_in if r["mix"] != "1P"], "ttft_inflation"),
        "worst_tpot_inflation_inprocess": worst(mixes_in, "tpot_inflation"),
        "worst_tpot_inflation_fcfs": worst(mixes_fc, "tpot_inflation"),
        "mixed_throughput_gain": worst(mixes_pd, "mixed_throughput_gain"),
        "pd_weight_pss_ratio": pss["pss_ratio"],
        "pd_weight_rss_ratio": pss["rss_ratio"],
        "pd_handover_s": worst(mixes_pd, "handover_s"),
        "pd_handover_kv_bytes": worst(mixes_pd, "kv_bytes"),
        "pd_workers_ready_s": pd_start_s,
        **val_summary,
        **proj_summary,
        "wall_s": time.perf_counter() - t_start,
    }
    return emit_record(
        args,
        claim=CLAIM,
        paper_value=PAPER,
        config={
            "model": model_desc,
            "layers": cfg.num_hidden_layers,
            "routed_experts": cfg.n_routed_experts,
            "vocab": cfg.vocab_size,
            "batches": batches,
            "long_prompt_tokens": long_len,
            "short_prompt_tokens": 16,
            "max_len": max_len,
            "precision": "bf16",
            "stand_in_accelerators": 2,
            "cores": os.cpu_count(),
            "pd_weight_pss": pss,
            "sim_validation_profile": "configs/systems/local.toml (hmoe calibrate), read rate per mix row",
            "projection": proj_inputs,
        },
        rows=rows + [{"part": "dual_trace", "batch": max(batches), "slices": trace}],
        summary=summary,
    )


if __name__ == "__main__":
    main()
