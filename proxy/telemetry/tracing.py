"""OpenTelemetry traces (`telemetry.otlp_endpoint`; the `brownout[otel]` extra).

One span per request (kind SERVER, `POST /v1/chat/completions`), parented on
the client's W3C `traceparent` when it sends one; one child span per backend
attempt (kind CLIENT, `chat {model}` as OpenTelemetry's GenAI conventions
name an inference call), whose context goes to the backend as its
`traceparent` — so a vLLM started with `--otlp-traces-endpoint` hangs its own
spans under the attempt that called it. A rescue is an attempt span of its
own (`brownout.rescue`).

Attributes: the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.system` /
`gen_ai.provider.name`, `gen_ai.usage.input_tokens` / `output_tokens` and
`gen_ai.response.*` when the answer says), HTTP's (`http.response.status_code`,
`server.address`), and Brownout's own (`brownout.tier`, `brownout.backend`,
`brownout.outcome`, `brownout.fault`, `brownout.retry`, `brownout.admission.wait_s`,
...).

Nothing here runs unless the policy names a collector: this module (and the
SDK) is imported only then, and the request path's only cost otherwise is a
`None` check. Spans end on the event loop into a bounded queue; a
`BatchSpanProcessor` thread encodes and posts them, so a slow or unreachable
collector never blocks serving — a full queue drops spans, counted in
`brownout_trace_spans_total{result="dropped"}`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter

from proxy import __version__
from proxy.policy.telemetry import TelemetryPolicy

if TYPE_CHECKING:
    from proxy.backends.upstream import Upstream
    from proxy.pipeline.record import AttemptResult, RequestRecord, Terminal

log = logging.getLogger("brownout.traces")
_OPERATION = {"chat": "chat", "completions": "text_completion"}
_PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# gen_ai.request.* attributes taken from the request body as they are.
_REQUEST_PARAMS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
)
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: `/v1/traces` added to a URL without a path."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


class _CountingExporter(SpanExporter):
    """The OTLP exporter, its outcomes counted (runs on the export thread)."""

    def __init__(self, inner: SpanExporter, spans: Counter) -> None:
        self._inner = inner
        self._exported = spans.labels("exported")
        self._failed = spans.labels("failed")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            self._failed.inc(len(spans))
            raise
        (self._exported if result is SpanExportResult.SUCCESS else self._failed).inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class BatchExport(SpanProcessor):
    """Ended spans into a bounded queue; a daemon thread exports them in
    batches (every `batch_delay_s`, or as soon as a batch is full).

    The SDK's `BatchSpanProcessor` does the same, but logs a warning for every
    span it drops — a log record per span, on the event loop, exactly while
    the collector is unreachable. Here a drop is one counter increment; the
    thread says what was lost, once per export."""

    def __init__(self, exporter: SpanExporter, pol: TelemetryPolicy, dropped: Counter) -> None:
        self._exporter = exporter
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._max = pol.max_queue_spans
        self._batch = pol.max_batch_spans
        self._delay = pol.batch_delay_s
        self._dropped = dropped
        self._drops = 0  # since the thread last said so
        self._wake = threading.Event()
        self._closing = False
        self._deadline = float("inf")  # closing: stop exporting after this
        self._thread = threading.Thread(target=self._run, name="brownout-traces", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        """On the event loop: an append (or a count), never a wait."""
        q = self._queue
        if len(q) >= self._max or self._closing:
            self._dropped.inc()
            self._drops += 1
            return
        q.append(span)
        if len(q) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._export()
        self._export()

    def _export(self) -> None:
        q = self._queue
        while q and time.monotonic() < self._deadline:
            batch = [q.popleft() for _ in range(min(len(q), self._batch))]
            try:
                self._exporter.export(batch)
            except Exception:
                log.exception("trace_export_failed")
            drops, self._drops = self._drops, 0
            if drops:
                log.warning(
                    "trace_spans_dropped: the export queue (telemetry.max_queue_spans) was "
                    "full, %d span(s) dropped; the collector is slow or unreachable",
                    drops,
                )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued within `timeout_s` (blocking: off the loop)."""
        self._deadline = time.monotonic() + timeout_s
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        return True


class Tracing:
    """The tracer of one `telemetry:` policy: its own provider (never the
    process's global one), a batch processor with its thread, the exporter."""

    def __init__(self, pol: TelemetryPolicy, spans: Counter) -> None:
        self.policy = pol
        headers = dict(item.partition("=")[::2] for item in pol.otlp_headers)
        exporter = OTLPSpanExporter(
            endpoint=traces_url(pol.otlp_endpoint),
            headers=headers or None,
            timeout=pol.export_timeout_s,
        )
        self._processor = BatchExport(
            _CountingExporter(exporter, spans), pol, spans.labels("dropped")
        )
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(pol.sample_ratio)),
            resource=Resource.create(
                {"service.name": pol.service_name, "service.version": __version__}
            ),
            shutdown_on_exit=False,  # `shutdown`, bounded, from the app's cleanup
        )
        self._provider.add_span_processor(self._processor)
        self.tracer = self._provider.get_tracer("brownout", __version__)

    def start(self, rec: RequestRecord) -> RequestTrace:
        """The request's span, from its arrival (`rec.t0`) on."""
        req = rec.request
        headers = req.headers
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        op = _OPERATION.get(rec.endpoint)
        span = self.tracer.start_span(
            f"{req.method} {_PATH.get(rec.endpoint, req.path)}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=time.time_ns() - int((rec.loop.time() - rec.t0) * 1e9),
        )
        if not span.is_recording():
            # Not sampled: no attributes, no attempt spans; the backend still
            # gets a traceparent (this span's id, the trace's sampled flag).
            return RequestTrace(self, span, op, recording=False)
        body = rec.body
        attrs: dict[str, Any] = {
            "http.request.method": req.method,
            "url.path": req.path,
            "brownout.request_id": rec.rid,
            "brownout.priority": rec.priority,
            "brownout.stream": rec.stream,
        }
        if op is not None:
            attrs["gen_ai.operation.name"] = op
            model = body.get("model")
            if isinstance(model, str):
                attrs["gen_ai.request.model"] = model
            for key, attr in _REQUEST_PARAMS:
                v = body.get(key)
                if v is not None and isinstance(v, int | float) and not isinstance(v, bool):
                    attrs[attr] = v
        if rec.session is not None:
            attrs["brownout.session"] = True
        span.set_attributes(attrs)
        return RequestTrace(self, span, op, recording=True)

    def shutdown(self, timeout_s: float) -> None:
        """Export what is queued, within `timeout_s` (blocking: run it off the loop)."""
        self._processor.shutdown(timeout_s)


class RequestTrace:
    """One request's spans: the request span and the attempt in progress.
    For a request that is not sampled, only the (non-recording) request span."""

    __slots__ = ("_ctx", "_op", "_tracing", "attempt", "attempts", "recording", "span", "usage")

    def __init__(self, tracing: Tracing, span: Span, op: str | None, *, recording: bool) -> None:
        self._tracing = tracing
        self.span = span
        self.recording = recording
        self._ctx: Context | None = set_span_in_context(span) if recording else None
        self._op = op
        self.attempt: Span | None = None
        self.attempts = 0
        self.usage: tuple[int, int] | None = None  # (input, output) tokens, once known

    def begin_attempt(
        self,
        rec: RequestRecord,
        up: Upstream,
        *,
        retry: int = 0,
        reason: str = "",
        rescue_from: str = "",
    ) -> None:
        """A child span for an attempt on `up` (the `traceparent` it gets)."""
        self.attempts += 1
        if not self.recording:
            return
        self.end_attempt(None)
        model = up.policy.model or rec.model
        attrs: dict[str, Any] = {
            "brownout.backend": up.name,
            "brownout.attempt": self.attempts,
            "brownout.tier": rec.rt.tier,
            "gen_ai.system": up.policy.kind,
            "server.address": up.base.host or "",
        }
        port = up.base.port
        if port is not None:
            attrs["server.port"] = port
        if model is not None:
            attrs["gen_ai.request.model"] = model
        if self._op is not None:
            attrs["gen_ai.operation.name"] = self._op
        if retry:
            attrs["brownout.retry"] = retry
        if reason:
            attrs["brownout.retry_reason"] = reason
        if rescue_from:
            attrs["brownout.rescue"] = True
            attrs["brownout.rescue_from"] = rescue_from
        op = self._op or "http"
        self.attempt = self._tracing.tracer.start_span(
            f"{op} {model}" if model else f"{op} {up.name}",
            context=self._ctx,
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )

    def admission_wait(self, wait_s: float, result: str) -> None:
        """The admission queue's wait before this attempt (the primary, when
        throttling is on) and its end: `admitted`, or why it was shed."""
        span = self.attempt
        if span is not None:
            span.set_attributes(
                {"brownout.admission.wait_s": round(wait_s, 6), "brownout.admission": result}
            )

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """`traceparent` (and `tracestate`) of the attempt in progress, for its backend."""
        span = self.attempt or self.span
        ctx = span.get_span_context()
        headers["traceparent"] = (
            f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        )
        state = ctx.trace_state
        if state:
            headers["tracestate"] = state.to_header()

    def end_attempt(self, result: AttemptResult | None, decision: str = "") -> None:
        """The attempt's outcome (`None`: it ended without one, an exception)."""
        span = self.attempt
        if span is None:
            return
        self.attempt = None
        if result is None:
            span.set_status(Status(StatusCode.ERROR, "attempt ended without a result"))
            span.end()
            return
        attrs: dict[str, Any] = {
            "brownout.outcome": result.outcome,
            "http.response.status_code": result.status,
        }
        if decision:
            attrs["brownout.next"] = decision
        if result.fault:
            attrs["brownout.fault"] = result.fault
            attrs["error.type"] = result.fault
        if result.detail:
            attrs["brownout.detail"] = result.detail[:256]
        if result.ttft is not None:
            attrs["brownout.upstream_ttft_s"] = round(result.ttft, 6)
        if result.kind == "answered" and result.status == 200 and not result.delivered:
            self._answer_attributes(result, attrs)
        span.set_attributes(attrs)
        if result.kind in ("failed", "ended"):
            span.set_status(Status(StatusCode.ERROR, result.fault or result.outcome))
        span.end()

    def end_rescue(self, result: AttemptResult | None) -> None:
        """The rescue's outcome: the stream continued to its end on the
        fallback, or not (`None`: the fallback could not take it over)."""
        span = self.attempt
        if span is None:
            return
        self.attempt = None
        outcome = "not_taken_over" if result is None else result.outcome
        span.set_attribute("brownout.outcome", outcome)
        if result is None or result.kind != "answered":
            span.set_status(Status(StatusCode.ERROR, f"rescue {outcome}"))
        span.end()

    def _answer_attributes(self, result: AttemptResult, attrs: dict[str, Any]) -> None:
        """gen_ai.usage.* and gen_ai.response.* of a whole (non-streaming) answer."""
        body = getattr(result.response, "body", None)
        if not isinstance(body, bytes) or not body.startswith(b"{"):
            return
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        _response_attributes(obj, attrs)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.note_usage(usage, attrs)

    def note_usage(self, usage: Mapping[str, Any], attrs: dict[str, Any] | None = None) -> None:
        """An answer's `usage` object (on the attempt, and the request at its end)."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return
        self.usage = (prompt, completion)
        if attrs is not None:
            attrs["gen_ai.usage.input_tokens"] = prompt
            attrs["gen_ai.usage.output_tokens"] = completion

    def finish(self, rec: RequestRecord, term: Terminal) -> None:
        """The request's end: what the client got."""
        span = self.span
        if not self.recording:
            span.end()
            return
        self.end_attempt(None)  # one still open: the request ended under it
        attrs: dict[str, Any] = {
            "http.response.status_code": term.status,
            "brownout.backend": term.backend,
            "brownout.tier": "maintenance" if term.backend == "maintenance" else rec.rt.tier,
            "brownout.outcome": term.outcome,
            "brownout.attempts": self.attempts,
        }
        if rec.rescued:
            attrs["brownout.rescued"] = True
        if term.client_ttft is not None:
            attrs["brownout.ttft_s"] = round(term.client_ttft, 6)
        if term.detail:
            attrs["brownout.detail"] = term.detail[:256]
        usage = self.usage
        if usage is not None:
            attrs["gen_ai.usage.input_tokens"] = usage[0]
            attrs["gen_ai.usage.output_tokens"] = usage[1]
        error = term.stream_error or (term.outcome if term.status >= 500 else "")
        if error:
            attrs["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, error))
        span.set_attributes(attrs)
        span.end()


def _response_attributes(obj: Mapping[str, Any], attrs: dict[str, Any]) -> None:
    rid, model = obj.get("id"), obj.get("model")
    if isinstance(rid, str):
        attrs["gen_ai.response.id"] = rid
    if isinstance(model, str):
        attrs["gen_ai.response.model"] = model
    choices = obj.get("choices")
    if isinstance(choices, list):
        reasons = [
            c["finish_reason"]
            for c in choices
            if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)
        ]
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
