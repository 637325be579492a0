"""The export queue of traces (`proxy.telemetry.tracing.BatchExport`): what
the event loop does when a span ends is an append or a count — never a wait
on the collector — and shutting down is bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.policy.telemetry import TelemetryPolicy
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import BatchExport, traces_url


class Stuck(SpanExporter):
    """A collector that never answers: every export blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches: list[int] = []
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        self.batches.append(len(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def same(span: ReadableSpan) -> ReadableSpan:
    return span


def dropped(m: Metrics) -> float | None:
    return m.registry.get_sample_value("brownout_trace_spans_total", {"result": "dropped"})


def test_a_stuck_collector_costs_the_loop_nothing_and_drops_are_counted() -> None:
    m = Metrics()
    exporter = Stuck()
    pol = TelemetryPolicy(otlp_endpoint="http://x", max_queue_spans=8, max_batch_spans=4)
    batch = BatchExport(exporter, pol, m.trace_spans.labels("dropped"), same)
    span = ReadableSpan("s")
    for _ in range(4):
        batch.on_end(span)
    assert exporter.entered.wait(5)  # the thread took a batch and is stuck in export
    t = time.perf_counter()
    for _ in range(1000):
        batch.on_end(span)
    per_span = (time.perf_counter() - t) / 1000
    assert per_span < 50e-6, per_span  # an append or a count: microseconds, not a wait
    assert dropped(m) == 1000 - 8  # the queue holds 8; the rest are counted, not kept
    exporter.release.set()
    t = time.monotonic()
    batch.shutdown(2.0)
    assert time.monotonic() - t < 2.5
    assert sum(exporter.batches) == 4 + 8  # what was queued went out at shutdown


def test_shutdown_is_bounded_by_its_timeout_when_the_collector_hangs() -> None:
    m = Metrics()
    exporter = Stuck()
    pol = TelemetryPolicy(otlp_endpoint="http://x", max_queue_spans=64, max_batch_spans=1)
    batch = BatchExport(exporter, pol, m.trace_spans.labels("dropped"), same)
    for _ in range(10):
        batch.on_end(ReadableSpan("s"))
    assert exporter.entered.wait(5)
    t = time.monotonic()
    batch.shutdown(0.3)  # Stuck.shutdown releases the one export in flight
    assert time.monotonic() - t < 1.0
    batch.on_end(ReadableSpan("late"))  # after shutdown: counted as dropped
    assert dropped(m) == 1


def test_an_endpoint_without_a_path_gets_the_traces_path() -> None:
    assert traces_url("http://otel:4318") == "http://otel:4318/v1/traces"
    assert traces_url("http://otel:4318/") == "http://otel:4318/v1/traces"
    assert traces_url("https://otel/custom/traces") == "https://otel/custom/traces"
