"""The export queue of traces (`proxy.telemetry.tracing.BatchExport`): what
the event loop does when a span ends is an append or a count — never a wait
on the collector — and shutting down is bounded."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.policy.telemetry import TelemetryPolicy
from proxy.telemetry import tracing
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


class Failing(SpanExporter):
    """A collector that fails until told otherwise; what it was sent, kept."""

    def __init__(self) -> None:
        self.ok = False
        self.batches: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches.append(len(spans))
        self.entered.set()
        self.release.wait(10)
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


def wait_for(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_failing_collector_is_backed_off_and_probed_until_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a failed export nothing more is queued (nor encoded to be lost):
    the queue is dropped and counted, the tracer stops recording
    (`has_room`), and the thread probes with empty exports, further apart
    each time, until one succeeds."""
    monkeypatch.setattr(tracing, "BACKOFF_MIN_S", 0.05)
    m = Metrics()
    exporter = Failing()
    exporter.release.clear()
    pol = TelemetryPolicy(otlp_endpoint="http://x", max_batch_spans=4, batch_delay_s=0.5)
    batch = BatchExport(exporter, pol, m.trace_spans.labels("dropped"), same)
    try:
        for _ in range(4):
            batch.on_end(ReadableSpan("s"))
        assert exporter.entered.wait(5)  # the first batch is being sent (and will fail)
        for _ in range(2):
            batch.on_end(ReadableSpan("queued"))
        exporter.release.set()
        wait_for(lambda: not batch.accepting)
        assert exporter.batches[0] == 4
        assert not batch.has_room()
        assert dropped(m) == 2  # the rest of the queue, not sent to a failing collector
        batch.on_end(ReadableSpan("late"))  # (the tracer does not even build them)
        assert dropped(m) == 3
        wait_for(lambda: len(exporter.batches) >= 3)
        assert exporter.batches[1:3] == [0, 0]  # probes: empty exports
        exporter.ok = True
        wait_for(lambda: batch.accepting)
        assert batch.has_room()
        n = len(exporter.batches)
        batch.on_end(ReadableSpan("again"))
        wait_for(lambda: len(exporter.batches) > n and exporter.batches[-1] == 1)
    finally:
        batch.shutdown(1.0)


def test_probes_back_off_exponentially(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "BACKOFF_MIN_S", 0.04)
    monkeypatch.setattr(tracing, "BACKOFF_MAX_S", 0.16)
    m = Metrics()
    exporter = Failing()
    times: list[float] = []
    real = exporter.export

    def timed(spans: Sequence[ReadableSpan]) -> SpanExportResult:
        times.append(time.monotonic())
        return real(spans)

    exporter.export = timed  # type: ignore[method-assign]
    pol = TelemetryPolicy(otlp_endpoint="http://x", max_batch_spans=1, batch_delay_s=0.01)
    batch = BatchExport(exporter, pol, m.trace_spans.labels("dropped"), same)
    try:
        batch.on_end(ReadableSpan("s"))
        wait_for(lambda: len(times) >= 6)
    finally:
        batch.shutdown(1.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 0.04, 0.08, 0.16, then capped at 0.16 (a loaded machine only adds).
    assert gaps[0] >= 0.035 and gaps[1] >= 0.075 and gaps[2] >= 0.15 and gaps[3] >= 0.15
    assert batch._backoff == 0.16  # capped, not doubling on


def test_an_unsampled_request_builds_no_trace_and_a_backed_off_one_keeps_its_flag() -> None:
    """Not sampled: no trace object, only the backend's traceparent (the
    client's trace id, a span id of ours, flag 00). Sampled while the
    collector is backed off: the same, flag 01, its span counted as dropped."""
    m = Metrics()
    pol = TelemetryPolicy(otlp_endpoint="http://127.0.0.1:9", sample_ratio=0.0)
    t = tracing.Tracing(pol, m.trace_spans)
    try:
        client = "0af7651916cd43dd8448eb211c80319c"

        def rec(header: str | None) -> SimpleNamespace:
            headers = {"traceparent": header} if header else {}
            return SimpleNamespace(request=SimpleNamespace(headers=headers), trace=None)

        r = rec(f"00-{client}-b7ad6b7169203331-00")
        t.start(r)  # type: ignore[arg-type]
        assert r.trace is None
        version, trace_id, span_id, flags = r.traceparent.split("-")
        assert (version, trace_id, flags) == ("00", client, "00")
        assert span_id != "b7ad6b7169203331" and len(span_id) == 16
        r = rec(None)  # sample_ratio 0: never sampled
        t.start(r)  # type: ignore[arg-type]
        assert r.trace is None and r.traceparent.endswith("-00")
        assert r.traceparent.split("-")[1] != client
        t._processor.accepting = False  # backed off
        r = rec(f"00-{client}-b7ad6b7169203331-01")
        t.start(r)  # type: ignore[arg-type]
        assert r.trace is None
        assert r.traceparent.startswith(f"00-{client}-") and r.traceparent.endswith("-01")
        assert dropped(m) == 1
    finally:
        t.shutdown(0.5)
