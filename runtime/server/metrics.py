"""Prometheus metrics of the server, on a registry of its own (several apps may live in one process).

Names follow vLLM's with an `fxrewrite:` prefix, so vLLM dashboards need only the prefix changed.
Gauges are refreshed from `LLMEngine.get_stats()` after every engine step; counters and histograms
are fed by the async engine as outputs arrive. Units: seconds, tokens, fraction (0..1) of KV blocks.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Bucket edges of vLLM's histograms (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metrics, labelled with the served model name."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)
        self._running = Gauge("fxrewrite:num_requests_running", "Requests in the running batch.",
                              labels, registry=r)
        self._waiting = Gauge("fxrewrite:num_requests_waiting", "Requests waiting to be scheduled.",
                              labels, registry=r)
        self._kv_usage = Gauge("fxrewrite:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                               labels, registry=r)
        self._free_blocks = Gauge("fxrewrite:num_free_blocks", "KV-cache blocks not held by any request.",
                                  labels, registry=r)
        self._num_blocks = Gauge("fxrewrite:num_blocks", "KV-cache blocks in total.", labels, registry=r)
        self.prompt_tokens = Counter("fxrewrite:prompt_tokens", "Prompt tokens of requests that produced output.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("fxrewrite:generation_tokens", "Generated tokens.",
                                         labels, registry=r).labels(model_name)
        # Both count completions: a request with n=3 is three (vLLM's counts each of n's child requests).
        self._success = Counter("fxrewrite:request_success", "Finished completions (each of a request's n) by "
                                "finish reason.", labels + ["finished_reason"], registry=r)
        self.aborted = Counter("fxrewrite:request_aborted", "Completions aborted (each of a request's n; client gone "
                               "or error).", labels, registry=r).labels(model_name)
        self.ttft = Histogram("fxrewrite:time_to_first_token_seconds", "Time to first token (seconds).",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("fxrewrite:inter_token_latency_seconds",
                             "Time between successive outputs of a request, per token (seconds).",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("fxrewrite:e2e_request_latency_seconds", "Request latency (seconds).",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self._preemptions = Counter("fxrewrite:num_preemptions", "Sequences preempted (their KV blocks freed, to "
                                    "be recomputed).", labels, registry=r).labels(model_name)
        self._seen_preemptions = 0
        self._model_name = model_name

    def update_engine_stats(self, stats: dict) -> None:
        """Refresh the gauges from `LLMEngine.get_stats()` (keys as in the engine contract)."""
        name = self._model_name
        self._running.labels(name).set(stats.get("num_running", 0))
        self._waiting.labels(name).set(stats.get("num_waiting", 0))
        self._kv_usage.labels(name).set(stats.get("kv_cache_usage", 0.0))
        if "num_free_blocks" in stats:
            self._free_blocks.labels(name).set(stats["num_free_blocks"])
        if "num_blocks" in stats:
            self._num_blocks.labels(name).set(stats["num_blocks"])
        preemptions = stats.get("num_preemptions", self._seen_preemptions)  # the engine's count since start
        if preemptions > self._seen_preemptions:
            self._preemptions.inc(preemptions - self._seen_preemptions)
        self._seen_preemptions = preemptions

    def record_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self._model_name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
