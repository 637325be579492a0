"""`telemetry:` — OpenTelemetry traces, exported over OTLP/HTTP.

Off unless `otlp_endpoint` is set (and then it needs the optional extra:
`pip install 'brownout[otel]'`). One span per request, a child span per
backend attempt; the attempt's context goes to the backend as `traceparent`.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.knobs import knob


@dataclass(frozen=True, slots=True)
class TelemetryPolicy:
    otlp_endpoint: str = knob(
        "",
        "A collector's OTLP/HTTP traces endpoint (`http://otel-collector:4318/v1/traces`; "
        "a URL without a path gets `/v1/traces`), empty = tracing off (no per-request "
        "cost). Needs `pip install 'brownout[otel]'`.",
        secret="userinfo",
    )
    otlp_headers: tuple[str, ...] = knob(
        (),
        "`NAME=value` headers sent with every export (a collector's credentials).",
        secret="value",
    )
    service_name: str = knob("brownout", "The traces' `service.name` resource attribute.")
    sample_ratio: float = knob(
        0.1,
        "Share of requests traced when the client sends no `traceparent` (a client's "
        "sampled flag decides for its own request). A traced request costs the proxy "
        "about 1.17 times the instructions of an untraced one, its spans' export "
        "encoding included; one not traced, almost nothing (`bench/results/otel-cost.md`).",
        ge=0,
        le=1,
        unit="ratio",
    )
    batch_delay_s: float = knob(
        2.0,
        "Ended spans are exported at least this often (or as soon as a batch is full), "
        "by a background thread, never on the event loop.",
        gt=0,
        le=300,
    )
    max_batch_spans: int = knob(
        512, "Spans per export request at most.", ge=1, le=100_000, unit="spans"
    )
    max_queue_spans: int = knob(
        4096,
        "Ended spans waiting for export at most; more are dropped and counted "
        '(`brownout_trace_spans_total{result="dropped"}`), so an unreachable collector '
        "costs memory this bounded and never slows serving.",
        ge=1,
        le=10_000_000,
        unit="spans",
    )
    export_timeout_s: float = knob(
        5.0,
        "One export request's timeout (the background thread's; serving never waits for it).",
        gt=0,
        le=120,
    )
