"""`/metrics` of `hmoe serve`: Prometheus text format, vLLM's metric names where vLLM has
one (so dashboards and scrapers written for vLLM read ours), `hmoe:` where it has none.

Per-request timings are observed once, when a request ends (perf_counter seconds in the
server process). Token times are when the HTTP layer received each token from the backend,
as vLLM v1 times them in its API-server process (OutputProcessor), not when the engine
sampled it: on a busy host the event loop can get a token milliseconds later, and that is
latency the client sees. Arrival is when uvicorn handed the request over (http.py).
  TTFT = first token - arrival
  inter-token latency = every gap between consecutive tokens
  TPOT (per request) = (last token - first token) / (tokens - 1)
  vllm:time_per_output_token_seconds = every gap between consecutive tokens, as vLLM
    observes it (its pre-0.11 name of the inter-token latency, kept for dashboards that
    read it; vllm/v1/metrics/loggers.py fills both from the same per-token latencies)
  e2e = finish - arrival; queue = prefill start - arrival; prefill = first token - prefill
  start; decode = last token - first token.
Gauges (running, waiting, KV usage, in flight) are read from the live requests at scrape time.
A gauge or counter that does not apply to the backend (KV usage and scheduler iterations under
--pd, worker restarts without workers) or has no value yet is absent from the exposition,
not 0: a 0 would read as "empty" / "never", which is a claim we cannot make.
The process_* metrics (memory, CPU, open fds, start time) and python_* are prometheus_client's
collectors, registered on our registry as they are on its default one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series (vLLM turns them off too)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), seconds / tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISHED_REASONS = ("stop", "length", "abort", "error")


class MaybeMetric(Collector):
    """A gauge or counter that is in the exposition only while it has a value (set), so one
    that does not apply to this backend is absent rather than a constant 0. `label`: the name
    of one label besides model_name (its values are given to set), or None. A counter's value
    is a running total kept elsewhere (a coordinator's restart count), set at scrape time."""

    def __init__(self, kind: str, name: str, doc: str, model_name: str, label: str | None = None):
        if kind not in ("gauge", "counter"):
            raise ValueError(f"MaybeMetric kind must be gauge or counter, got {kind!r}")
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total (its exposed name)")
        self.kind, self.name, self.doc, self.model_name, self.label = kind, name, doc, model_name, label
        self.values: dict[str, float] = {}  # label value ("" without a label) -> value

    def set(self, value: float, label_value: str = "") -> None:
        if (label_value != "") != (self.label is not None):
            raise ValueError(f"{self.name}: label value {label_value!r} for label {self.label!r}")
        self.values[label_value] = float(value)

    def clear(self) -> None:
        self.values.clear()

    @property
    def value(self) -> float | None:
        return self.values.get("")

    def _family(self) -> Metric:
        labels = ["model_name"] + ([self.label] if self.label else [])
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.doc, labels=labels)
        return CounterMetricFamily(self.name, self.doc, labels=labels)

    def describe(self) -> Iterator[Metric]:  # the registry's name-clash check, without values
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        if not self.values:
            return
        fam = self._family()
        for lv, v in sorted(self.values.items()):
            fam.add_metric([self.model_name] + ([lv] if self.label else []), v)
        yield fam


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests prefilling or decoding")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests accepted, not yet started")
        self.in_flight = gauge(
            "hmoe:requests_in_flight", "Accepted requests not yet finished (the admission count)"
        )

        def maybe(kind: str, name: str, doc: str, label: str | None = None) -> MaybeMetric:
            m = MaybeMetric(kind, name, doc, model_name, label)
            r.register(m)
            return m

        # absent while the backend cannot say (--pd has no one KV pool, no scheduler iterations)
        self.kv_usage = maybe(
            "gauge", "vllm:kv_cache_usage_perc", "KV-cache usage: fraction of pool rows in use (0-1)"
        )
        self.iterations = maybe("gauge", "hmoe:scheduler_iterations", "Scheduler iterations run so far")
        self.cancel_iterations = maybe(  # absent until a cancel has been measured
            "gauge",
            "hmoe:cancel_to_free_iterations",
            "Last cancelled request (client gone, stop string): scheduler iterations from the cancel until it was freed",
        )
        self.worker_restarts = maybe(  # only with worker processes (--pd)
            "counter",
            "hmoe:worker_restarts_total",
            "Worker processes restarted after they died, by role",
            label="role",
        )
        # the default registry's process_* / python_* collectors, on ours (vLLM serves them too)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests", lab, registry=r
        )
        self.prompt_tokens = self.prompt_tokens.labels(model_name)
        self.gen_tokens = Counter("vllm:generation_tokens", "Generated tokens", lab, registry=r).labels(
            model_name
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason",
            [*lab, "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "hmoe:requests_rejected", "Requests answered with an error status", [*lab, "status"], registry=r
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Gap between consecutive output tokens", ITL_BUCKETS
        )
        self.tpot_per_token = hist(
            "vllm:time_per_output_token_seconds",
            "Gap between consecutive output tokens (vLLM's former name of the inter-token latency)",
            ITL_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Per request: decode time / (tokens - 1)",
            ITL_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to prefill start", LATENCY_BUCKETS)
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Prefill start to first token", LATENCY_BUCKETS
        )
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        for reason in FINISHED_REASONS:  # every series exists from the start (rate() over 0 works)
            self.success.labels(model_name, reason)

    def observe(
        self,
        *,
        arrival_s: float,
        started_s: float | None,
        token_s: Sequence[float],
        finished_s: float | None,
        prompt_tokens: int,
        finished_reason: str,
    ) -> None:
        """One finished request (token_s: when each token counted in its output was produced)."""
        self.success.labels(self.model_name, finished_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.gen_tokens.inc(len(token_s))
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(len(token_s))
        if finished_s is not None:
            self.e2e.observe(max(0.0, finished_s - arrival_s))
        if started_s is not None:
            self.queue.observe(max(0.0, started_s - arrival_s))
        if not token_s:
            return
        self.ttft.observe(max(0.0, token_s[0] - arrival_s))
        if started_s is not None:
            self.prefill.observe(max(0.0, token_s[0] - started_s))
        self.decode.observe(token_s[-1] - token_s[0])
        for a, b in zip(token_s, token_s[1:]):
            self.itl.observe(b - a)
            self.tpot_per_token.observe(b - a)
        if len(token_s) > 1:
            self.tpot.observe((token_s[-1] - token_s[0]) / (len(token_s) - 1))

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (and the bare name summed over labels): what
    tests and `hmoe bench serve` read back."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            v = float(val)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            out[name] = out.get(name, 0.0) + v
    return out
