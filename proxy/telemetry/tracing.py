"""OpenTelemetry traces (`telemetry.otlp_endpoint`; the `brownout[otel]` extra).

One span per request (kind SERVER, `POST /v1/chat/completions`), parented on
the client's W3C `traceparent` when it sends one; one child span per backend
attempt (kind CLIENT, `chat {model}` as OpenTelemetry's GenAI conventions
name an inference call), whose context goes to the backend as its
`traceparent` — so a vLLM started with `--otlp-traces-endpoint` hangs its own
spans under the attempt that called it. A rescue is an attempt span of its
own (`brownout.rescue`).

Attributes: the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.system`,
`gen_ai.usage.input_tokens` / `output_tokens` and `gen_ai.response.*` when the
answer says), HTTP's (`http.response.status_code`, `server.address`), and
Brownout's own (`brownout.tier`, `brownout.backend`, `brownout.outcome`,
`brownout.fault`, `brownout.retry`, `brownout.admission.wait_s`, ...).

Nothing here runs unless the policy names a collector: this module (and the
SDK) is imported only then, and the request path's only cost otherwise is a
`None` check. When it runs, the event loop does as little as it can: the
W3C header is parsed and written here, the sampling decision is
`TraceIdRatioBased`'s (the trace id's low 64 bits against the ratio), and a
span is a plain record (ids, times, an attribute dict) appended to a bounded
queue when it ends. The SDK's `Tracer` would cost the loop several times
more per span (measured: `bench/otel_ab.py`): its spans lock and validate
every attribute as it is set. The export thread turns the records into the
SDK's `ReadableSpan`s and hands them to its OTLP/HTTP exporter, so a slow or
unreachable collector never blocks serving — a full queue drops spans,
counted in `brownout_trace_spans_total{result="dropped"}`.
"""

from __future__ import annotations

import collections
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar
from urllib.parse import urlsplit, urlunsplit

import orjson
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
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
# W3C trace context: version-traceid-parentid-flags (a later version may add fields).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MASK64 = (1 << 64) - 1
T = TypeVar("T")


def parse_traceparent(header: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a valid W3C `traceparent`, else None."""
    m = _TRACEPARENT.fullmatch(header.strip())
    if m is None:
        return None
    version, trace, parent, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, parent_id = int(trace, 16), int(parent, 16)
    if not trace_id or not parent_id:
        return None
    return trace_id, parent_id, int(flags, 16)


class SpanRecord(NamedTuple):
    """An ended span as the loop leaves it (the export thread builds the SDK's span)."""

    name: str
    kind: SpanKind
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    remote_parent: bool
    flags: int
    state: str  # the client's tracestate
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None  # the status description of an ERROR span, None: UNSET


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


class BatchExport(Generic[T]):
    """Ended spans into a bounded queue; a daemon thread exports them in
    batches (every `batch_delay_s`, or as soon as a batch is full), each
    turned into the SDK's span by `convert` there, off the loop.

    The SDK's `BatchSpanProcessor` does the same for its own spans, but logs
    a warning for every span it drops — a log record per span, on the event
    loop, exactly while the collector is unreachable. Here a drop is one
    counter increment; the thread says what was lost, once per export."""

    def __init__(
        self,
        exporter: SpanExporter,
        pol: TelemetryPolicy,
        dropped: Counter,
        convert: Callable[[T], ReadableSpan],
    ) -> None:
        self._exporter = exporter
        self._convert = convert
        self._queue: collections.deque[T] = collections.deque()
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

    def on_end(self, span: T) -> None:
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
        convert = self._convert
        while q and time.monotonic() < self._deadline:
            batch = [convert(q.popleft()) for _ in range(min(len(q), self._batch))]
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


class Tracing:
    """The tracer of one `telemetry:` policy: the sampling ratio, the
    resource, the export queue and its thread, the OTLP exporter."""

    def __init__(self, pol: TelemetryPolicy, spans: Counter) -> None:
        self.policy = pol
        headers = dict(item.partition("=")[::2] for item in pol.otlp_headers)
        exporter = OTLPSpanExporter(
            endpoint=traces_url(pol.otlp_endpoint),
            headers=headers or None,
            timeout=pol.export_timeout_s,
        )
        self._resource = Resource.create(
            {"service.name": pol.service_name, "service.version": __version__}
        )
        self._scope = InstrumentationScope("brownout", __version__)
        # TraceIdRatioBased's rule: sampled when the low 64 bits are below this.
        self._bound = round(pol.sample_ratio * (_MASK64 + 1))
        self._bits = random.getrandbits
        self._processor = BatchExport(
            _CountingExporter(exporter, spans),
            pol,
            spans.labels("dropped"),
            convert=self._readable,
        )
        self.emit = self._processor.on_end

    def start(self, rec: RequestRecord) -> RequestTrace:
        """The request's span, from its arrival (`rec.t0`) on."""
        req = rec.request
        header = req.headers.get("traceparent")
        parent = parse_traceparent(header) if header else None
        bits = self._bits
        if parent is not None:
            trace_id, parent_id, flags = parent
            flags &= 1  # sampled or not: the client's decision
            state = req.headers.get("tracestate", "")
        else:
            trace_id = bits(128) or 1
            parent_id, state = 0, ""
            flags = 1 if (trace_id & _MASK64) < self._bound else 0
        trace = RequestTrace(self, trace_id, bits(64) or 1, parent_id, flags, state)
        if not flags:
            return trace  # not sampled: only the backend's traceparent
        trace.start_ns = time.time_ns() - int((rec.loop.time() - rec.t0) * 1e9)
        op = trace.op = _OPERATION.get(rec.endpoint)
        trace.name = f"{req.method} {_PATH.get(rec.endpoint, req.path)}"
        attrs = trace.attrs = {
            "http.request.method": req.method,
            "url.path": req.path,
            "brownout.request_id": rec.rid,
            "brownout.priority": rec.priority,
            "brownout.stream": rec.stream,
        }
        if op is not None:
            body = rec.body
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
        return trace

    def _readable(self, r: SpanRecord) -> ReadableSpan:
        """A record as the SDK's span (on the export thread)."""
        state = TraceState.from_header([r.state]) if r.state else None
        flags = TraceFlags(r.flags)
        parent = (
            SpanContext(r.trace_id, r.parent_id, r.remote_parent, flags, state)
            if r.parent_id
            else None
        )
        return ReadableSpan(
            r.name,
            context=SpanContext(r.trace_id, r.span_id, False, flags, state),
            parent=parent,
            resource=self._resource,
            attributes=r.attributes,
            kind=r.kind,
            status=Status(StatusCode.ERROR, r.error) if r.error is not None else _UNSET,
            start_time=r.start_ns,
            end_time=r.end_ns,
            instrumentation_scope=self._scope,
        )

    def shutdown(self, timeout_s: float) -> None:
        """Export what is queued, within `timeout_s` (blocking: run it off the loop)."""
        self._processor.shutdown(timeout_s)


_UNSET = Status(StatusCode.UNSET)


class _Attempt:
    """The attempt span in progress."""

    __slots__ = ("attrs", "name", "span_id", "start_ns")

    def __init__(self, name: str, span_id: int, attrs: dict[str, Any]) -> None:
        self.name = name
        self.span_id = span_id
        self.attrs = attrs
        self.start_ns = time.time_ns()


class RequestTrace:
    """One request's spans: the request span and the attempt in progress.
    A request that is not sampled records nothing; its backend still gets a
    `traceparent` (this request span's id, in the same trace)."""

    __slots__ = (
        "_tracing",
        "attempt",
        "attempts",
        "attrs",
        "flags",
        "name",
        "op",
        "parent_id",
        "span_id",
        "start_ns",
        "state",
        "trace_id",
        "usage",
    )

    def __init__(
        self,
        tracing: Tracing,
        trace_id: int,
        span_id: int,
        parent_id: int,
        flags: int,
        state: str,
    ) -> None:
        self._tracing = tracing
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.flags = flags  # 1: sampled (recorded and exported)
        self.state = state
        self.start_ns = 0
        self.name = ""
        self.op: str | None = None
        self.attrs: dict[str, Any] = {}
        self.attempt: _Attempt | None = None
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
        if not self.flags:
            return
        self.end_attempt(None)
        model = up.policy.model or rec.model
        base = up.base
        attrs: dict[str, Any] = {
            "brownout.backend": up.name,
            "brownout.attempt": self.attempts,
            "brownout.tier": rec.rt.tier,
            "gen_ai.system": up.policy.kind,
            "server.address": base.host or "",
        }
        port = base.port
        if port is not None:
            attrs["server.port"] = port
        if model is not None:
            attrs["gen_ai.request.model"] = model
        op = self.op
        if op is not None:
            attrs["gen_ai.operation.name"] = op
        if retry:
            attrs["brownout.retry"] = retry
        if reason:
            attrs["brownout.retry_reason"] = reason
        if rescue_from:
            attrs["brownout.rescue"] = True
            attrs["brownout.rescue_from"] = rescue_from
        op = op or "http"
        name = f"{op} {model}" if model else f"{op} {up.name}"
        self.attempt = _Attempt(name, self._tracing._bits(64) or 1, attrs)

    def admission_wait(self, wait_s: float, result: str) -> None:
        """The admission queue's wait before this attempt (the primary, when
        throttling is on) and its end: `admitted`, or why it was shed."""
        a = self.attempt
        if a is not None:
            a.attrs["brownout.admission.wait_s"] = round(wait_s, 6)
            a.attrs["brownout.admission"] = result

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """The `traceparent` of the attempt in progress, for its backend (the
        client's `tracestate` is passed through with the other headers)."""
        a = self.attempt
        span_id = a.span_id if a is not None else self.span_id
        headers["traceparent"] = f"00-{self.trace_id:032x}-{span_id:016x}-{self.flags:02x}"

    def _emit(
        self,
        name: str,
        kind: SpanKind,
        span_id: int,
        parent_id: int,
        start_ns: int,
        attrs: dict[str, Any],
        error: str | None,
    ) -> None:
        remote = parent_id == self.parent_id
        self._tracing.emit(
            SpanRecord(
                name,
                kind,
                self.trace_id,
                span_id,
                parent_id,
                remote,
                self.flags,
                self.state,
                start_ns,
                time.time_ns(),
                attrs,
                error,
            )
        )

    def _end(self, a: _Attempt, error: str | None) -> None:
        self._emit(a.name, SpanKind.CLIENT, a.span_id, self.span_id, a.start_ns, a.attrs, error)

    def end_attempt(self, result: AttemptResult | None, decision: str = "") -> None:
        """The attempt's outcome (`None`: it ended without one, an exception)."""
        a = self.attempt
        if a is None:
            return
        self.attempt = None
        if result is None:
            self._end(a, "attempt ended without a result")
            return
        attrs = a.attrs
        attrs["brownout.outcome"] = result.outcome
        attrs["http.response.status_code"] = result.status
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
        failed = result.kind in ("failed", "ended")
        self._end(a, (result.fault or result.outcome) if failed else None)

    def end_rescue(self, result: AttemptResult | None) -> None:
        """The rescue's outcome: the stream continued to its end on the
        fallback, or not (`None`: the fallback could not take it over)."""
        a = self.attempt
        if a is None:
            return
        self.attempt = None
        outcome = "not_taken_over" if result is None else result.outcome
        a.attrs["brownout.outcome"] = outcome
        ok = result is not None and result.kind == "answered"
        self._end(a, None if ok else f"rescue {outcome}")

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
        if not self.flags:
            return
        self.end_attempt(None)  # one still open: the request ended under it
        attrs = self.attrs
        attrs["http.response.status_code"] = term.status
        attrs["brownout.backend"] = term.backend
        attrs["brownout.tier"] = "maintenance" if term.backend == "maintenance" else rec.rt.tier
        attrs["brownout.outcome"] = term.outcome
        attrs["brownout.attempts"] = self.attempts
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
        self._emit(
            self.name,
            SpanKind.SERVER,
            self.span_id,
            self.parent_id,
            self.start_ns,
            attrs,
            error or None,
        )


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
