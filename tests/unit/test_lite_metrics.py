"""The request path's lock-free metrics (issue 24) scrape exactly like the
prometheus-client metrics they replaced: names, help, types, labels, values,
`_created` series and order, byte for byte."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from proxy.telemetry.metrics import LiteCounter, LiteHistogram, Metrics

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
VALUES = [0.0, 0.005, 0.0050001, 0.3, 1, 299.9, 300, 301, math.inf, -1.0, 1e-9, 7.25]


def _pair(clock: list[float]) -> tuple[bytes, bytes]:
    """The same updates on both kinds, in two registries."""
    old, new = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    requests = Counter(
        "x_requests", "Requests by backend and status.", ["backend", "status"], registry=old
    )
    lite_requests = LiteCounter(
        "x_requests", "Requests by backend and status.", ("backend", "status"), registry=new
    )
    ttft = Histogram(
        "x_ttft_seconds",
        "TTFT \\ with a backslash\nand a newline.",
        ["backend"],
        buckets=BOUNDS,
        registry=old,
    )
    lite_ttft = LiteHistogram(
        "x_ttft_seconds",
        "TTFT \\ with a backslash\nand a newline.",
        ("backend",),
        buckets=BOUNDS,
        registry=new,
    )
    overhead = Histogram("x_overhead_seconds", "Overhead.", buckets=(0.0001, 0.001), registry=old)
    lite_overhead = LiteHistogram(
        "x_overhead_seconds", "Overhead.", buckets=(0.0001, 0.001), registry=new
    )
    for i, v in enumerate(VALUES):
        clock[0] += 1.5
        backend = ("primary", "fallback", 'odd"\\name')[i % 3]
        requests.labels(backend, str(200 + i % 2)).inc()
        lite_requests.labels(backend, str(200 + i % 2)).inc()
        requests.labels(backend, "503").inc(2.5)
        lite_requests.labels(backend, "503").inc(2.5)
        ttft.labels(backend).observe(v)
        lite_ttft.labels(backend).observe(v)
        overhead.observe(abs(v) / 1000)
        lite_overhead.observe(abs(v) / 1000)
    return generate_latest(old), generate_latest(new)


def test_the_lite_metrics_scrape_like_prometheus_client_s(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_767_225_600.125]
    monkeypatch.setattr("time.time", lambda: clock[0])
    old, new = _pair(clock)
    assert b"x_ttft_seconds_created" in old and b"x_requests_created" in old
    assert new == old


def test_without_created_series_too(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_767_225_600.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    old, new = _pair(clock)
    assert b"_created" not in old
    assert new == old


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="label count"):
        m.requests.labels("primary", "chat")
    with pytest.raises(ValueError, match="non-negative"):
        m.requests.labels("primary", "chat", "200").inc(-1)
    with pytest.raises(ValueError, match="missing label values"):
        m.ttft.observe(1.0)  # labelled: a child's
    m.overhead.observe(0.0002)
    assert b'brownout_proxy_overhead_seconds_bucket{le="0.00025"} 1.0' in m.exposition()
