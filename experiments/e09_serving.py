"""e09: serving at the engine's speed (issue #26).

Claim: `hmoe serve` (the OpenAI-compatible server over the in-process Scheduler, the paper
policy) delivers what the engine does in the same step: at 1 client its TPOT is the engine's
batch-1 decode step plus a small overhead (serve_overhead_c1 = TPOT / solo step <= 1.15), and
at 4 clients, while all four decode, the 4-row step plus a small overhead
(serve_overhead_c4 = TPOT / 4-row step <= 1.3). A 128-token prompt joining 3 decoding
clients gets its first token after one prefill chunk, and no decode row stalls longer than
that chunk (plus its own step). With llama-server given, the same load side by side:
throughput_vs_llama_server_c1 / _c4 (target >= 1.2, the engine's own lead is 1.4-2x).

Method, all in one run, rounds interleaved (a shared 2-core machine; medians):
1. The engine's own steps: an Engine like the server's (1 accelerator, bf16 policy, the
   same checkpoint), 4 sequences prefilled with 128-token prompts, then Engine.step of
   1, 2 and 4 rows, interleaved (`engine_step_ms_b{1,2,4}`).
2. `hmoe serve` (a subprocess, --trace on: scheduler phases, HTTP/SSE per token, compiles)
   driven by `hmoe bench serve` (a subprocess: the load generator as users run it):
   `decode_n` at 1, 2 and 4 clients (prompt 128 tokens, 64 output tokens, distinct prompts
   per request, ignore_eos); output tok/s, TTFT and TPOT mean and p90 (vLLM's definitions),
   and TPOT while all c clients decode (from each request's chunk times: the window from
   the last first token to the first last token). Then `join`: 3 decode streams, and once
   each has streamed a token a 128-token prompt arrives: its TTFT, the decode rows' longest
   gap, and the chunk that prefilled it (from the trace).
3. The breakdown per output token of each bench run, from the server's trace
   (serve/servetrace.py): engine decode / chunked prefill / compile / scheduler / HTTP.
4. With --llama-server PATH --gguf PATH: the same load against llama-server (2 threads, 4
   slots, no prompt cache: `cache_prompt: false` in every request, prompts distinct). The
   experiment does not build llama.cpp (docs/serve.md says how). One client runs
   --c1-repeats times a round (default 3), the servers alternating request by request;
   besides the ratio of the medians, `throughput_vs_llama_server_c1_pairs` holds each
   back-to-back pair's ratio (the VM's phase moves a batch-1 step by ~30% within minutes,
   and a pair shares one).

Model: full, the real-shape DeepSeek-V3 bench twin (configs/models/deepseek_v3_bench.json,
2 MoE layers of real dims, 32 experts top-8 + shared, vocab 8,192), the weight arena of e06
plus a word-level tokenizer.json (one word per id: every generated token is text, so each
streams as its own chunk). --quick: the embedded tiny model, 1 and 2 clients, short outputs.

    python -m experiments.e09_serving [--quick] [--rounds N] [--c1-repeats N]
        [--llama-server PATH --gguf PATH]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common.record import REPO_ROOT, emit_record, parse_args
from hmoe_jax.io.bench_twin import word_tokenizer

CLAIM = (
    "hmoe serve delivers the engine's step: TPOT at 1 client <= 1.15x the engine's batch-1 step, "
    "at 4 clients (all decoding) <= 1.3x the 4-row step; a 128-token prompt joining 3 decodes "
    "stalls them by at most one prefill chunk"
)
PAPER = {"serve_overhead_c1": 1.15, "serve_overhead_c4": 1.3, "throughput_vs_llama_server": 1.2}
TOKENIZER = "tokenizer.json"


# ---------------------------------------------------------------- model


def build_model(quick: bool) -> tuple[Any, Any, Path, str]:
    """(cfg, params, checkpoint dir the server loads, description)."""
    if quick:
        from hmoe_jax.io.loader import load_checkpoint
        from hmoe_jax.io.synthetic import ensure_default_checkpoint

        ckpt = ensure_default_checkpoint(progress=False)
        cfg, params = load_checkpoint(ckpt, progress=False)
        return cfg, params, ckpt, "embedded tiny default (synthetic FP8, byte tokenizer)"
    from experiments.e06_concurrency import build_model as twin_arena

    cfg, params, root, desc = twin_arena(False)
    tok = Path(root) / TOKENIZER
    if not tok.exists():
        tok.write_text(json.dumps(word_tokenizer(cfg.vocab_size)))
    return cfg, params, Path(root), desc + " + word-level tokenizer"


# ---------------------------------------------------------------- the engine's own steps


def engine_steps(
    params, cfg, prompt_len: int, reps: int, seed: int, expert_fn: str
) -> dict[int, list[float]]:
    """Engine.step of 1, 2 and 4 rows, interleaved, on 4 prefilled sequences (as the server
    holds them): seconds per step, `reps` of each."""
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.model.sampling import SamplingParams

    max_len = min(4096, cfg.max_position_embeddings)
    eng = Engine(params, cfg, devices=1, max_batch=4, max_len=max_len, expert_fn=expert_fn)
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_new_tokens=4 * reps + 8, temperature=0.0, stop_ids=())
    seqs = [eng.start(rng.integers(10, 250, prompt_len).tolist(), sp, schedule="cpu") for _ in range(4)]
    out: dict[int, list[float]] = {1: [], 2: [], 4: []}
    try:
        for b in out:  # compile each batch size
            eng.step(seqs[:b])
        for _ in range(reps):
            for b in out:
                t0 = time.perf_counter()
                eng.step(seqs[:b])
                out[b].append(time.perf_counter() - t0)
    finally:
        for s in seqs:
            eng.cancel(s)
        eng.close()
    return out


# ---------------------------------------------------------------- servers and the load


class Server:
    """A server subprocess; `url` once it listens. stderr is kept (tail in errors)."""

    def __init__(self, cmd: list[str], ready: re.Pattern, env: dict[str, str] | None = None, timeout_s=1800):
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.url: str | None = None
        got = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                m = ready.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError(f"{cmd[0]} did not start: {' | '.join(self.lines[-15:])}")

    def stop(self, timeout_s: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def hmoe_server(ckpt: Path, trace: Path, max_seqs: int, expert_fn: str) -> Server:
    cmd = [sys.executable, "-m", "hmoe_jax.cli", "serve", "--checkpoint", str(ckpt), "--port", "0"]
    cmd += ["--max-num-seqs", str(max_seqs), "--trace", str(trace), "--expert-fn", expert_fn]
    env = _env()
    return Server(cmd, re.compile(r"listening on (http://\S+)"), env)


def llama_server(binary: str, gguf: str, slots: int, ctx_per_slot: int, threads: int) -> Server:
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(_free_port()), "-t", str(threads)]
    cmd += ["-np", str(slots), "-c", str(slots * ctx_per_slot)]
    srv = Server(cmd, re.compile(r"listening on (http://[\d.]+:\d+)|server is listening on (http://\S+)"))
    srv.url = srv.url or next(
        (m.group(0) for ln in srv.lines if (m := re.search(r"http://[\d.]+:\d+", ln))), None
    )
    return srv


def _env() -> dict[str, str]:
    """Subprocesses import this checkout's hmoe_jax first, then whatever PYTHONPATH names
    (e.g. a private build of the extension: docs/serve.md)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, scenario: str, n: int, prompt_len: int, output_len: int, seed: int, *,
          long_len: int | None = None, extra: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One `hmoe bench serve` run (a subprocess, as users run it) -> its JSON result, with
    the perf_counter_ns window it ran in (`window_ns`; CLOCK_MONOTONIC, shared with the server)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "hmoe_jax.bench", "serve", "--url", url, "--scenario", scenario]
        cmd += ["--num-prompts", str(n), "--prompt-len", str(prompt_len), "--output-len", str(output_len)]
        cmd += ["--seed", str(seed), "--result-file", str(out), "--quiet", "--no-initial-test"]
        if long_len is not None:
            cmd += ["--long-prompt-len", str(long_len)]
        if extra:
            cmd += ["--extra-body", json.dumps(extra)]
        t0 = time.perf_counter_ns()
        p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600,
                           env=_env())  # fmt: skip
        t1 = time.perf_counter_ns()
        if p.returncode != 0:
            raise RuntimeError(f"bench {scenario} n={n} against {url} failed: {p.stderr[-2000:]}")
        res = json.loads(out.read_text())
    res["window_ns"] = (t0, t1)
    return res


def token_times(res: dict[str, Any]) -> list[np.ndarray]:
    """Each successful request's chunk arrival times (s, the bench's clock): start + TTFT,
    then each ITL."""
    out = []
    for st, ttft, itl in zip(res["start_s"], res["ttfts"], res["itls"]):
        if ttft is None or ttft <= 0:
            out.append(np.zeros(0))
            continue
        out.append(st + ttft + np.concatenate([[0.0], np.cumsum(itl)]))
    return out


def all_decoding_gaps(times: list[np.ndarray]) -> np.ndarray:
    """Token gaps of every request inside the window where all of them decode (from the
    last first token to the first last token)."""
    if any(t.size < 2 for t in times):
        return np.zeros(0)
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    return np.concatenate([np.diff(t[(t >= lo) & (t <= hi)]) for t in times])


def summarise_decode(res: dict[str, Any], clients: int) -> dict[str, Any]:
    gaps = all_decoding_gaps(token_times(res))
    return {
        "clients": clients,
        "completed": res["completed"],
        "failed": res["failed"],
        "output_tok_s": res["output_throughput"],
        "ttft_mean_ms": res["mean_ttft_ms"],
        "ttft_p90_ms": res["p90_ttft_ms"],
        "tpot_mean_ms": res["mean_tpot_ms"],
        "tpot_p90_ms": res["p90_tpot_ms"],
        "itl_p90_ms": res["p90_itl_ms"],
        "tpot_all_decoding_ms": float(gaps.mean() * 1e3) if gaps.size else None,
        "all_decoding_gaps": int(gaps.size),
    }


def summarise_join(res: dict[str, Any], n_decodes: int) -> dict[str, Any]:
    times = token_times(res)
    join_start = res["start_s"][n_decodes]
    join_first = join_start + res["ttfts"][n_decodes]
    # the decode rows' longest gap from the join's arrival until a token after its first
    stall = 0.0
    for t in times[:n_decodes]:
        sel = t[(t >= join_start)]
        prev = t[t < join_start]
        if prev.size and sel.size:
            seq = np.concatenate([prev[-1:], sel[sel <= join_first + 1.0]])
            if seq.size > 1:
                stall = max(stall, float(np.diff(seq).max()))
    return {
        "decodes": n_decodes,
        "join_ttft_ms": res["ttfts"][n_decodes] * 1e3,
        "max_decode_gap_ms": stall * 1e3,
        "failed": res["failed"],
    }


# ---------------------------------------------------------------- breakdown from the trace


def trace_slices(path: Path) -> list[dict[str, Any]]:
    """The serving trace's slices back in TraceRecorder form (ns, absolute perf_counter)."""
    d = json.loads(path.read_text())
    base_ns = int(d["otherData"].get("t0_ns", 0))
    names = {e["tid"]: e["args"]["name"] for e in d["traceEvents"] if e.get("name") == "thread_name"}
    out = []
    for e in d["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0 = base_ns + int(round(e["ts"] * 1e3))
        out.append({"resource": names[e["tid"]], "name": e["name"], "start_ns": t0,
                    "end_ns": t0 + int(round(e["dur"] * 1e3)), "args": e.get("args", {})})  # fmt: skip
    return out


def run_breakdowns(slices, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from hmoe_jax.serve.servetrace import breakdown

    rows = []
    for r in runs:
        tokens = int(r["res"]["total_output_tokens"])
        if tokens < 1:
            continue
        b = breakdown(slices, tokens, r["res"]["window_ns"])
        chunks = [
            (s["end_ns"] - s["start_ns"]) / 1e6
            for s in slices
            if s["resource"] == "sched" and s["name"] == "chunk"
            and r["res"]["window_ns"][0] <= s["start_ns"] <= r["res"]["window_ns"][1]
        ]  # fmt: skip
        lo, hi = r["res"]["window_ns"]
        own = [  # the server's own decode steps of exactly c rows in this run (its trace)
            (s["end_ns"] - s["start_ns"]) / 1e6
            for s in slices
            if s["resource"] == "sched" and s["name"] == "decode" and lo <= s["start_ns"] <= hi
            and s["args"].get("batch") == r["clients"]
        ]  # fmt: skip
        rows.append({"part": "breakdown", "kind": r["kind"], "clients": r["clients"], "round": r["round"],
                     "max_chunk_ms": max(chunks, default=None),
                     "own_step_ms": float(np.mean(own)) if own else None, **b})  # fmt: skip

    return rows


def loop_overhead(slices, batch: int) -> dict[str, Any]:
    """The serving loop's pace against its own engine steps, from the trace: over every two
    consecutive `batch`-row decode steps with no other step, prefill, chunk or idle between, the
    period from one step's start to the next one's against the step's own duration (the
    difference is the scheduler's and the emit's work between them). Load-immune: both are
    timed in the same iteration."""
    sched = sorted((s for s in slices if s["resource"] == "sched"), key=lambda s: s["start_ns"])
    per, dur = [], []
    steps = [i for i, s in enumerate(sched) if s["name"] == "decode" and s["args"].get("batch") == batch]
    for i, j in zip(steps, steps[1:]):
        if any(sched[k]["name"] in ("chunk", "prefill", "idle", "decode") for k in range(i + 1, j)):
            continue
        per.append((sched[j]["start_ns"] - sched[i]["start_ns"]) / 1e6)
        dur.append((sched[i]["end_ns"] - sched[i]["start_ns"]) / 1e6)
    if not per:
        return {"pairs": 0}
    gap = np.array(per) - np.array(dur)
    return {
        "pairs": len(per),
        "period_ms": float(np.mean(per)),
        "step_ms": float(np.mean(dur)),
        "loop_adds_ms": float(gap.mean()),
        "period_over_step": float(np.mean(per) / np.mean(dur)),
    }


# ---------------------------------------------------------------- main


def _ffi_path() -> str | None:
    try:
        import _hmoe_ffi

        return _hmoe_ffi.__file__
    except ImportError:
        return None


def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def paired_ratios(rows: list[dict[str, Any]], clients: int, peer: str = "llama-server") -> list[float]:
    """hmoe's output tok/s over the peer's for each (round, rep) at `clients`: the two runs
    of a pair ran back to back, so the VM's phase moves both alike."""
    from hmoe_jax.bench.stats import paired_ratios as ratios

    def tok_s(server: str) -> dict[tuple[int, int], float]:
        return {(r["round"], r.get("rep", 0)): r["output_tok_s"] for r in rows
                if r.get("part") == "decode" and r.get("server") == server and r.get("clients") == clients
                and r.get("output_tok_s")}  # fmt: skip

    return ratios(tok_s("hmoe"), tok_s(peer))


def load_avg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> dict:
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--llama-server", default=None, help="a llama.cpp llama-server binary (optional peer)")
    pre.add_argument("--gguf", default=None, help="the GGUF of the same weights, for --llama-server")
    pre.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 1)")
    pre.add_argument(
        "--c1-repeats",
        type=int,
        default=None,
        help="one-client requests per server per round, alternating servers (default 3; --quick 1)",
    )
    pre.add_argument(
        "--expert-fn",
        choices=["auto", "ref", "ffi"],
        default=None,
        help="routed experts of the server and the engine alike (default auto; --quick: ref)",
    )
    known, rest = pre.parse_known_args(argv)
    args = parse_args("e09_serving", __doc__, rest)
    if (known.llama_server is None) != (known.gguf is None):
        raise SystemExit("e09: give --llama-server and --gguf together")
    quick = args.quick
    rounds = known.rounds or (1 if quick else 3)
    # one client is one request per server per round, and this VM's phases move a batch-1
    # step by 30% within minutes: repeat it, alternating servers, so each pair shares a phase
    c1_repeats = known.c1_repeats or (1 if quick else 3)
    if c1_repeats < 1:
        raise SystemExit("e09: --c1-repeats must be >= 1")
    clients = (1, 2) if quick else (1, 2, 4)
    prompt_len, output_len = (32, 12) if quick else (128, 64)
    join_decodes = 1 if quick else 3
    load_before = load_avg()

    cfg, params, ckpt, desc = build_model(quick)
    print(f"[setup] {desc}; load average {load_before}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="e09_"))
    trace_path = work / "serve_trace.json"
    # --quick: plain-JAX experts by default (the installed fused FP8 op dies of SIGILL at
    # prefill sizes on AVX2-only CPUs: an AVX-512 instance of a shared inline function wins
    # the link; docs/serve.md); full: the server's default unless --expert-fn says otherwise
    expert_fn = known.expert_fn or ("ref" if quick else "auto")
    srv = hmoe_server(ckpt, trace_path, max(clients), expert_fn)
    peer = None
    if known.llama_server:
        peer = llama_server(
            known.llama_server, known.gguf, max(clients), 2 * (prompt_len + output_len) + 64, 2
        )
    servers = {"hmoe": srv.url, **({"llama-server": peer.url} if peer else {})}
    extra = {"llama-server": {"cache_prompt": False}}
    runs: list[dict[str, Any]] = []
    steps: dict[int, list[float]] = {1: [], 2: [], 4: []}
    seed = 1000
    try:
        for name, url in servers.items():  # warm: every batch size and the prompt's shapes
            bench(url, "decode_n", max(clients), prompt_len, 4, seed, extra=extra.get(name))
            seed += 1

        def alive() -> None:
            if srv.proc.poll() is not None:
                raise RuntimeError(f"hmoe serve died ({srv.proc.returncode}): {' | '.join(srv.lines[-20:])}")

        for r in range(rounds):
            alive()
            for b, ts in engine_steps(params, cfg, prompt_len, 3 if quick else 5, seed, expert_fn).items():
                steps[b] += ts
            seed += 1
            for c in clients:
                for rep in range(c1_repeats if c == 1 else 1):
                    alive()
                    for name, url in servers.items():
                        res = bench(url, "decode_n", c, prompt_len, output_len, seed, extra=extra.get(name))
                        runs.append(
                            {
                                "server": name,
                                "kind": "decode",
                                "clients": c,
                                "round": r,
                                "rep": rep,
                                "res": res,
                            }
                        )
                        seed += 1
                        print(f"[round {r}] {name} c={c}: {res['output_throughput']:.2f} tok/s, "
                              f"TPOT {res['mean_tpot_ms']:.1f} ms, TTFT {res['mean_ttft_ms']:.0f} ms", flush=True)  # fmt: skip
            for name, url in servers.items():
                res = bench(url, "join", join_decodes, prompt_len, output_len, seed, long_len=prompt_len,
                            extra=extra.get(name))  # fmt: skip
                runs.append(
                    {"server": name, "kind": "join", "clients": join_decodes + 1, "round": r, "res": res}
                )
                seed += 1
    finally:
        rc = srv.stop()
        if peer is not None:
            peer.stop()
    if rc != 0:
        raise RuntimeError(f"hmoe serve exited {rc}: {' | '.join(srv.lines[-10:])}")
    load_after = load_avg()

    step_ms = {b: 1e3 * float(np.median(ts)) for b, ts in steps.items()}
    rows: list[dict[str, Any]] = [
        {"part": "engine_step", "batch": b, "median_ms": step_ms[b], "all_ms": [1e3 * t for t in ts]}
        for b, ts in steps.items()
    ]
    for run in runs:
        summ = (
            summarise_decode(run["res"], run["clients"])
            if run["kind"] == "decode"
            else summarise_join(run["res"], join_decodes)
        )
        rows.append(
            {
                "part": run["kind"],
                "server": run["server"],
                "round": run["round"],
                "rep": run.get("rep", 0),
                **summ,
            }
        )
    slices = trace_slices(trace_path)
    hmoe_runs = [r for r in runs if r["server"] == "hmoe"]
    rows += run_breakdowns(slices, hmoe_runs)

    def per(server: str, c: int, key: str, kind: str = "decode") -> float | None:
        return med(r.get(key) for r in rows if r.get("part") == kind and r.get("server") == server
                   and (kind == "join" or r.get("clients") == c))  # fmt: skip

    summary: dict[str, Any] = {f"engine_step_ms_b{b}": step_ms[b] for b in steps}
    for c in clients:
        for key in (
            "output_tok_s",
            "ttft_mean_ms",
            "ttft_p90_ms",
            "tpot_mean_ms",
            "tpot_p90_ms",
            "tpot_all_decoding_ms",
        ):
            summary[f"{key}_c{c}"] = per("hmoe", c, key)
        tpot = summary[f"tpot_all_decoding_ms_c{c}"]
        step = step_ms.get(c)
        summary[f"serve_overhead_c{c}"] = tpot / step if tpot and step else None
    summary["join_ttft_ms"] = per("hmoe", 0, "join_ttft_ms", "join")
    summary["join_max_decode_gap_ms"] = per("hmoe", 0, "max_decode_gap_ms", "join")
    chunk = med(r["max_chunk_ms"] for r in rows if r.get("part") == "breakdown" and r["kind"] == "join")
    summary["join_prefill_chunk_ms"] = chunk
    step_j = step_ms.get(join_decodes + 1) or step_ms[max(steps)]
    gap = summary["join_max_decode_gap_ms"]
    # a decode row waits for the chunk and its own step in the iteration that ran the chunk
    summary["join_stall_within_one_chunk"] = (
        bool(gap <= chunk + 1.3 * step_j) if gap is not None and chunk is not None else None
    )
    summary["requests_failed"] = int(sum(r["res"]["failed"] for r in runs))
    if peer is not None:
        for c in clients:
            ours, theirs = per("hmoe", c, "output_tok_s"), per("llama-server", c, "output_tok_s")
            summary[f"llama_server_output_tok_s_c{c}"] = theirs
            summary[f"llama_server_tpot_all_decoding_ms_c{c}"] = per(
                "llama-server", c, "tpot_all_decoding_ms"
            )
            summary[f"throughput_vs_llama_server_c{c}"] = ours / theirs if ours and theirs else None
            pairs = paired_ratios(rows, c)
            summary[f"throughput_vs_llama_server_c{c}_pairs"] = pairs
            summary[f"throughput_vs_llama_server_c{c}_pairs_median"] = med(pairs)
        summary["llama_server_join_ttft_ms"] = per("llama-server", 0, "join_ttft_ms", "join")
    for c in clients:
        # the same ratio against the server's own c-row steps, timed in the same window (its
        # trace): immune to the load changing between the solo measurement and the serving
        own = med(r["own_step_ms"] for r in rows if r.get("part") == "breakdown" and r["kind"] == "decode"
                  and r["clients"] == c)  # fmt: skip
        tpot = summary[f"tpot_all_decoding_ms_c{c}"]
        summary[f"server_step_ms_c{c}"] = own
        summary[f"tpot_over_server_step_c{c}"] = tpot / own if tpot and own else None
        b = [r for r in rows if r.get("part") == "breakdown" and r["kind"] == "decode" and r["clients"] == c]
        if b:
            for k in (
                "engine_decode",
                "engine_chunk",
                "compile",
                "scheduler",
                "http_wait",
                "http_detok",
                "http_send",
                "mean_step_ms",
            ):
                summary[f"breakdown_c{c}_{k}_ms"] = med(x[k] for x in b)
    for c in clients:
        lo = loop_overhead(slices, c)
        rows.append({"part": "loop_overhead", "batch": c, **lo})
        summary[f"loop_adds_ms_b{c}"] = lo.get("loop_adds_ms")
        summary[f"loop_period_over_step_b{c}"] = lo.get("period_over_step")
    summary["load_avg_before"], summary["load_avg_after"] = load_before, load_after
    config = {
        "model": desc,
        "checkpoint": str(ckpt),
        "clients": list(clients),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "rounds": rounds,
        "policy": "paper (hmoe serve default)",
        "expert_fn": expert_fn,
        "ffi_extension": _ffi_path(),
        "server_warm_up": next((ln for ln in srv.lines if "warmed up" in ln), None),
        "llama_server": known.llama_server,
        "gguf": known.gguf,
    }
    return emit_record(args, claim=CLAIM, paper_value=PAPER, config=config, rows=rows, summary=summary)


if __name__ == "__main__":
    main()
