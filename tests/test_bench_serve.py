"""`hmoe bench serve` (issue 14): vLLM's metric definitions and key names, checked on exact
synthetic inputs, and its timing checked against a scripted fake server with known delays
(tests/fake_server.py, a separate process that records when it sent each chunk on the
same monotonic clock): TTFT / TPOT / ITL to under 1 ms. The bench is an HTTP client only:
running it must not import jax."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from hmoe_jax.bench.stats import RequestOutput, calculate_metrics, parse_goodput
from hmoe_jax.bench.workload import ScenarioSizes, arrival_gaps, load_dataset, scenario

ROOT = Path(__file__).resolve().parents[1]
TTFT_S = 0.060
ITL_S = [0.020, 0.005, 0.040, 0.010]  # 5 chunks per request


# ---------------------------------------------------------------- definitions, exact


def test_metrics_follow_vllm_definitions_exactly():
    outs = [
        RequestOutput(10, True, ttft=0.1, itl=[0.02, 0.04], latency=0.2, output_tokens=3),
        RequestOutput(20, True, ttft=0.3, itl=[0.01], latency=0.5, output_tokens=5),  # usage says 5 tokens
        RequestOutput(30, True, ttft=0.05, itl=[], latency=0.05, output_tokens=1),  # 1 token: no TPOT
        RequestOutput(40, False, error="HTTP 429"),
    ]
    r = calculate_metrics(outs, 2.0, goodput={"ttft": 200, "tpot": 60}, percentiles=(50, 90, 99, 99.9))
    assert r["completed"] == 3 and r["failed"] == 1
    assert r["total_input_tokens"] == 60 and r["total_output_tokens"] == 9
    assert r["request_throughput"] == 1.5 and r["output_throughput"] == 4.5
    assert r["total_token_throughput"] == pytest.approx(34.5)
    tpots = [(0.2 - 0.1) / 2, (0.5 - 0.3) / 4]  # (E2EL - TTFT) / (tokens - 1)
    assert r["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    assert r["std_ttft_ms"] == pytest.approx(1000 * np.std([0.1, 0.3, 0.05]))
    itls = [0.02, 0.04, 0.01]  # pooled over requests
    assert r["mean_itl_ms"] == pytest.approx(1000 * np.mean(itls))
    assert r["p90_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 90))
    assert r["p99.9_e2el_ms"] == pytest.approx(1000 * np.percentile([0.2, 0.5, 0.05], 99.9))
    # goodput: ttft <= 200 ms and tpot <= 60 ms; the 1-token request counts tpot 0
    assert r["request_goodput"] == pytest.approx(2 / 2.0)
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{k}_{m}_ms" in r
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="NAME:MS"):
        parse_goodput(["latency:5"])


def test_arrivals_poisson_and_gamma():
    rate = 10.0
    for burstiness in (1.0, 0.25, 4.0):
        g = np.array(arrival_gaps(4000, rate, burstiness, seed=1))
        assert g.mean() == pytest.approx(1 / rate, rel=0.06)
        cv2 = g.var() / g.mean() ** 2  # gamma: 1 / shape
        assert cv2 == pytest.approx(1 / burstiness, rel=0.15)
    assert arrival_gaps(3, float("inf"), 1.0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="burstiness"):
        arrival_gaps(3, 1.0, 0.0)


def test_scenarios_and_dataset(tmp_path):
    s = ScenarioSizes(num_prompts=3, prompt_len=8, output_len=16, long_prompt_len=100)
    p2 = scenario("1p2d", s)
    assert [(r.prompt_len, r.output_len, r.after_first_token_of) for r in p2] == [
        (8, 16, ()),
        (8, 16, ()),
        (100, 1, (0, 1)),
    ]
    assert len(scenario("decode_n", s)) == 3 and scenario("long_prefill", s)[0].prompt_len == 100
    assert scenario("random", s, seed=3)[0].prompt == scenario("random", s, seed=3)[0].prompt
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": [5, 6, 7], "output_len": 4}\n{"prompt": "hello world", "output_len": 2}\n')
    d = load_dataset(f)
    assert [(r.prompt_len, r.output_len) for r in d] == [(3, 4), (2, 2)]


# ---------------------------------------------------------------- against the fake server


def start_fake(log: Path, *extra: str):
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("fake_server.py")),  # test-only: not shipped in the package
        "--ttft-s",
        str(TTFT_S),
        "--itl-s",
        ",".join(map(str, ITL_S)),
        *extra,
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, m.group(1)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    proc, url = start_fake(tmp_path_factory.mktemp("fake") / "fake.log")
    yield url
    proc.terminate()
    proc.wait(10)


def run_bench(url: str, *args: str) -> dict:
    """`python -m hmoe_jax.bench serve` in a fresh interpreter (`hmoe bench serve` without the
    rest of the CLI); also reports whether jax got imported."""
    argv = ["serve", "--url", url, "--quiet", *args]
    code = (
        "import json, sys; from hmoe_jax.bench.__main__ import main; "
        f"rc = main({argv!r}); print(json.dumps({{'rc': rc, 'jax': 'jax' in sys.modules}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    tail = json.loads(lines[-1])
    assert tail == {"rc": 0, "jax": False}, tail
    return json.loads(lines[-2])


ATTEMPTS = 3  # a shared 2-vCPU host can preempt the bench or the fake for milliseconds


@pytest.mark.timing
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_timing_against_scripted_fake_server(fake, endpoint, tmp_path):
    """Wall-clock (the `timing` lane: to 1 ms, which a neighbour on a shared 2-core host can
    take away). TTFT / TPOT / ITL within 1 ms of what the fake did (its arrival and send times on the
    same clock: the known delays, which follow its script within a few ms). The claim is about the bench's measurement; a run disturbed by other work on
    this shared host (a process preempted for milliseconds) is measured again, up to
    ATTEMPTS times, and every attempt's errors are reported on failure."""
    failures = []
    for _ in range(ATTEMPTS):
        try:
            return check_bench_timing(fake, endpoint, tmp_path)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    pytest.fail(f"{endpoint}: no attempt within 1 ms: {failures}")


def check_bench_timing(fake, endpoint, tmp_path):
    n_req, n_tok = 12, 1 + len(ITL_S)
    log0 = len(httpx.get(f"{fake}/log").json())
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"prompt": [7] * 4, "output_len": n_tok}) + "\n" for _ in range(n_req)))
    r = run_bench(
        fake, "--dataset", str(ds), "--endpoint", endpoint, "--max-concurrency", "1", "--no-initial-test"
    )
    log = httpx.get(f"{fake}/log").json()[log0:]
    assert r["completed"] == n_req and len(log) == n_req
    assert r["output_lens"] == [n_tok] * n_req  # from the usage chunk
    # What the server actually did, on the same clock: its TTFT (arrival -> first send) and
    # every gap between sends. The bench adds only the localhost transfer on top.
    true_ttft = [rec["send_s"][0] - rec["arrival_s"] for rec in log]
    true_itl = [b - a for rec in log for a, b in zip(rec["send_s"], rec["send_s"][1:])]
    true_tpot = [(rec["send_s"][-1] - rec["send_s"][0]) / (n_tok - 1) for rec in log]
    bench_itl = [x for per in r["itls"] for x in per]
    bench_tpot = [sum(per) / (n_tok - 1) for per in r["itls"]]  # = (E2EL - TTFT) / (n - 1) here
    assert len(bench_itl) == len(true_itl) == n_req * len(ITL_S)  # the empty role chunk is no token
    err = {
        "ttft": np.abs(np.array(r["ttfts"]) - true_ttft),
        "itl": np.abs(np.array(bench_itl) - true_itl),
        "tpot": np.abs(np.array(bench_tpot) - true_tpot),
    }
    print(
        endpoint,
        {
            k: f"p25 {np.percentile(v, 25) * 1e3:.3f} ms, median {np.median(v) * 1e3:.3f} ms"
            for k, v in err.items()
        },
    )
    # Per request, the bench is off by the localhost transfer only (~0.3 ms each way when
    # neither process waits for a CPU). On this shared 2-vCPU host either process can be
    # preempted for milliseconds, which hits some requests and not others; a timing bug
    # (wrong start, the role chunk counted, a gap dropped) would hit every request, so the
    # lower quartile of the errors must be under 1 ms.
    for k, v in err.items():
        assert np.percentile(v, 25) < 1e-3, f"p25 |bench - server| {k} {np.percentile(v, 25) * 1e3:.3f} ms"
    # the summary is the statistics of those per-request values
    assert r["median_ttft_ms"] == pytest.approx(1e3 * np.median(r["ttfts"]))
    assert r["mean_tpot_ms"] == pytest.approx(1e3 * np.mean(bench_tpot))
    assert r["p90_itl_ms"] == pytest.approx(1e3 * np.percentile(bench_itl, 90))
    # The fake itself follows its script (its asyncio wake-ups add a little on a busy host).
    assert abs(np.median(true_ttft) - TTFT_S) < 5e-3
    per_gap = np.array(r["itls"])  # [requests, gaps]
    for j, want in enumerate(ITL_S):
        assert abs(statistics.median(per_gap[:, j]) - want) < 5e-3, (j, per_gap[:, j])


def test_bench_triggers_concurrency_and_rate_against_fake(fake):
    log0 = len(httpx.get(f"{fake}/log").json())
    r = run_bench(
        fake, "--scenario", "1p2d", "--prompt-len", "4", "--long-prompt-len", "16", "--no-initial-test"
    )
    log = httpx.get(f"{fake}/log").json()[log0:]
    by_len = sorted(log, key=lambda rec: rec["arrival_s"])
    # the long prefill arrives only after both decode streams sent their first token
    assert by_len[2]["arrival_s"] >= max(by_len[0]["send_s"][0], by_len[1]["send_s"][0])
    assert r["completed"] == 3 and r["output_lens"] == [5, 5, 1]
    # closed loop: at most 2 in flight; open loop at 50 req/s: spaced like the gaps
    log0 += len(log)
    run_bench(
        fake, "--scenario", "decode_n", "--num-prompts", "4", "--max-concurrency", "2", "--no-initial-test"
    )
    log = httpx.get(f"{fake}/log").json()[log0:]
    spans = [(rec["arrival_s"], rec["send_s"][-1]) for rec in log]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 2
    r = run_bench(fake, "--scenario", "decode_n", "--num-prompts", "4", "--request-rate", "50", "--seed", "4")
    gaps = arrival_gaps(4, 50.0, 1.0, 4)
    assert np.allclose(np.diff(r["start_s"]), gaps[1:], atol=0.01)
    assert r["request_rate"] == 50.0 and "p99_itl_ms" in r


def test_bench_reports_a_dead_server(tmp_path):
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--scenario", "decode_n", "--quiet"]
    out = subprocess.run(
        [sys.executable, "-m", "hmoe_jax.cli", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 1 and "hmoe: error: bench serve against http://127.0.0.1:9" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "hmoe_jax.cli", *argv, "--goodput", "ttft"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "--goodput" in out.stderr


def test_bench_resends_a_request_the_server_dropped_before_answering(tmp_path):
    """The keep-alive race, scripted: the fake closes the first two requests that arrive on a
    reused connection without a byte of response ("Server disconnected without sending a
    response"). Each is sent again on a fresh connection: nothing fails, and the result
    counts the resends; a request the server answered (even with an error) is never resent."""
    proc, url = start_fake(tmp_path / "fake.log", "--drop-reused", "2")
    try:
        ds = tmp_path / "d.jsonl"
        ds.write_text("".join(json.dumps({"prompt": [7] * 4, "output_len": 5}) + "\n" for _ in range(4)))
        # one at a time: the /v1/models connection is reused by request 1 (dropped, resent
        # on a new connection), that one by request 2 (dropped, resent), then no more drops
        r = run_bench(url, "--dataset", str(ds), "--max-concurrency", "1", "--no-initial-test")
        assert httpx.get(f"{url}/dropped").json() == {"dropped": 2}
        assert r["completed"] == 4 and r["failed"] == 0 and r["errors"] == [""] * 4
        assert r["retries"] == [1, 1, 0, 0]
        assert len(httpx.get(f"{url}/log").json()) == 4  # each answered exactly once
    finally:
        proc.terminate()
        proc.wait(10)


def test_bench_pool_expires_idle_connections_before_servers_close_them(tmp_path):
    """Common servers close idle keep-alive connections after 5 s (cpp-httplib, uvicorn):
    the bench's pool drops them sooner, and against a server with a short keep-alive (0.3
    s) requests spaced around it all complete."""
    from hmoe_jax.bench.client import KEEPALIVE_EXPIRY_S, limits

    assert KEEPALIVE_EXPIRY_S < 5 and limits().keepalive_expiry == KEEPALIVE_EXPIRY_S
    proc, url = start_fake(tmp_path / "fake.log", "--keep-alive-s", "0.3")
    try:
        r = run_bench(
            url, "--scenario", "decode_n", "--num-prompts", "6", "--request-rate", "3", "--seed", "2"
        )
        assert r["completed"] == 6 and r["failed"] == 0
    finally:
        proc.terminate()
        proc.wait(10)
