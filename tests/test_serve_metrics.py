"""/metrics of the HTTP app, in process on the scripted stub backend (no model): the process_*
collectors, vLLM's per-token vllm:time_per_output_token_seconds against the request's own
token times, and the rule that a gauge or counter that does not apply is absent, not 0."""

from __future__ import annotations

import os

import pytest

from hmoe_jax.serve.metrics import ITL_BUCKETS, MaybeMetric, parse_metrics
from tests.serve_stub import BODY, StubBackend, app_for, ids

M = 'model_name="stub"'
TPOT = "vllm:time_per_output_token_seconds"


def _scrape(c) -> tuple[str, dict[str, float]]:
    text = c.get("/metrics").text
    return text, parse_metrics(text)


def _series_names(text: str) -> set[str]:
    return {ln.split("{", 1)[0].split(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_process_metrics_are_exposed():
    c, _ = app_for(StubBackend(ids("ab")))
    _, m = _scrape(c)
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_start_time_seconds",
    ):
        assert name in m, name
    # this very process: its RSS is at least what /proc says it had a moment ago, roughly
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss_pages = int(f.read().split()[1])
    assert m["process_resident_memory_bytes"] >= 0.5 * rss_pages * os.sysconf("SC_PAGE_SIZE")
    assert m["process_open_fds"] >= 3 and m["process_start_time_seconds"] > 1.6e9


def test_time_per_output_token_is_observed_per_gap_with_vllms_buckets():
    script = ids("abcdefg")  # 7 tokens: 6 gaps
    c, state = app_for(StubBackend(script))
    seen: list[list[float]] = []
    observe = state.metrics.observe

    def spy(**kw):  # the token times the server recorded for the request
        seen.append(list(kw["token_s"]))
        observe(**kw)

    state.metrics.observe = spy
    r = c.post("/v1/completions", json={**BODY, "max_tokens": len(script)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == len(script)
    text, m = _scrape(c)
    [tok_s] = seen
    gaps = [b - a for a, b in zip(tok_s, tok_s[1:])]
    assert len(gaps) == len(script) - 1
    assert m[f"{TPOT}_count{{{M}}}"] == len(gaps)
    assert m[f"{TPOT}_sum{{{M}}}"] == pytest.approx(sum(gaps), rel=1e-9, abs=1e-12)
    # vLLM's bucket edges (vllm/v1/metrics/loggers.py), each cumulative count from the gaps
    edges = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0]  # fmt: skip
    assert list(ITL_BUCKETS) == edges
    for le in edges:
        key = f'{TPOT}_bucket{{le="{le}",{M}}}'
        assert m[key] == sum(g <= le for g in gaps), key
    assert m[f'{TPOT}_bucket{{le="+Inf",{M}}}'] == len(gaps)
    # the per-request mean is the other histogram, one observation per request
    rq = "vllm:request_time_per_output_token_seconds"
    assert m[f"{rq}_count{{{M}}}"] == 1
    assert m[f"{rq}_sum{{{M}}}"] == pytest.approx((tok_s[-1] - tok_s[0]) / (len(tok_s) - 1))


def test_gauges_that_do_not_apply_are_absent_not_zero():
    # the P/D shape: no KV usage, no scheduler iterations, two workers that restart
    restarts = {"prefill": 0, "decode": 0}
    c, _ = app_for(StubBackend(ids("ab")), worker_restarts=lambda: dict(restarts))
    text, m = _scrape(c)
    names = _series_names(text)
    for absent in ("vllm:kv_cache_usage_perc", "hmoe:scheduler_iterations", "hmoe:cancel_to_free_iterations"):
        assert absent not in names and absent not in text, absent  # no sample and no # HELP either
    assert "vllm:num_requests_running" in names  # the gauges that apply are there at 0
    assert m[f'hmoe:worker_restarts_total{{{M},role="decode"}}'] == 0
    restarts["decode"] = 2
    _, m = _scrape(c)
    assert m[f'hmoe:worker_restarts_total{{{M},role="decode"}}'] == 2
    assert m[f'hmoe:worker_restarts_total{{{M},role="prefill"}}'] == 0


def test_in_process_shape_has_kv_and_iterations_but_no_worker_restarts():
    kv: dict[str, float | None] = {"v": 0.25}
    c, _ = app_for(StubBackend(ids("ab")), kv_usage=lambda: kv["v"], iterations=lambda: 7)
    text, m = _scrape(c)
    assert m[f"vllm:kv_cache_usage_perc{{{M}}}"] == 0.25 and m[f"hmoe:scheduler_iterations{{{M}}}"] == 7
    assert "hmoe:worker_restarts_total" not in text
    kv["v"] = None  # the probe stops knowing: the gauge goes, no stale 0.25 left behind
    text, _ = _scrape(c)
    assert "vllm:kv_cache_usage_perc" not in text


def test_maybe_metric_refuses_a_bad_shape():
    with pytest.raises(ValueError, match="gauge or counter"):
        MaybeMetric("histogram", "x", "doc", "m")
    with pytest.raises(ValueError, match="_total"):
        MaybeMetric("counter", "hmoe:restarts", "doc", "m", "role")
    g = MaybeMetric("gauge", "g", "doc", "m", "role")
    with pytest.raises(ValueError, match="label"):
        g.set(1.0)  # a labelled metric needs its label value
