"""Prometheus metrics of one fallback server, on its own registry.

The model-level series reuse vLLM's names and `model_name` label, so the
proxy's vLLM scrape (pressure signals) and existing vLLM dashboards work on
the fallback unchanged. HTTP outcomes have a brownout-prefixed counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.fallback.engines.admission import Admission
from proxy.fallback.engines.interface import Load
from proxy.fallback.features.grammarlane import GrammarLane

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class FallbackMetrics:
    def __init__(
        self,
        model_name: str,
        admission: Admission,
        load: Callable[[], Load] | None = None,
        side: Admission | None = None,
    ) -> None:
        """`load` reads the engine in use; without one, the admission's counts stand in.
        `side`: the side lane's own admission, whose queue counts as waiting too."""
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]
        read = load if load is not None else (lambda: Load(admission.running, 0, 0.0))
        running = Gauge(
            "vllm:num_requests_running", "Requests the engine is generating for.", m, registry=r
        )
        running.labels(model_name).set_function(lambda: read().running)
        waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests waiting: for a slot (HTTP queue) or inside the engine for KV cache.",
            m,
            registry=r,
        )
        queues = (admission,) if side is None else (admission, side)
        waiting.labels(model_name).set_function(
            lambda: sum(q.waiting for q in queues) + read().waiting
        )
        kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache in use, 0-1 (batched: the paged cache's used blocks; threads: the "
            "worst case of the running requests over the KV budget).",
            m,
            registry=r,
        )
        kv.labels(model_name).set_function(lambda: read().kv_cache_usage)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "From request arrival to the end of generation.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting for a generation slot.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", m, registry=r
        ).labels(model_name)
        self._finished = Counter(
            "vllm:request_success",
            "Finished generations by finish reason (abort: client gone or shutdown).",
            [*m, "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self._http = Counter(
            "brownout_fallback_http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )

    def watch_grammar(self, lane: GrammarLane[Any, Any]) -> None:
        """Export the grammar lane's counts (once, when the server has xgrammar)."""
        self.registry.register(_GrammarCollector(lane))

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def http_request(self, endpoint: str, status: int) -> None:
        self._http.labels(endpoint, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCollector(Collector):
    """`brownout_fallback_grammar_*`: the grammar lane, read at scrape time."""

    def __init__(self, lane: GrammarLane[Any, Any]) -> None:
        self._lane = lane

    def collect(self) -> Iterator[Metric]:
        counts = self._lane.counts
        outcomes = CounterMetricFamily(
            "brownout_fallback_grammar_requests",
            "Requests for a grammar by outcome: hit (from the cache), timeout (503), "
            "shed (line full, 503), left (gone while in line: nothing compiled).",
            labels=["outcome"],
        )
        done = {"hit": counts.hits, "timeout": counts.timeouts, "shed": counts.shed}
        for outcome, value in (done | {"left": counts.left}).items():
            outcomes.add_metric([outcome], value)
        yield outcomes
        compiles = CounterMetricFamily(
            "brownout_fallback_grammar_compiles",
            "Grammar compiles by result: started, compiled, failed (a bad schema).",
            labels=["result"],
        )
        for name in ("started", "compiled", "failed"):
            compiles.add_metric([name], getattr(counts, name))
        yield compiles
        lane = GaugeMetricFamily(
            "brownout_fallback_grammar_lane",
            "Grammar compiles running on their threads, and requests in line for one.",
            labels=["state"],
        )
        lane.add_metric(["running"], self._lane.running)
        lane.add_metric(["waiting"], self._lane.waiting)
        yield lane
