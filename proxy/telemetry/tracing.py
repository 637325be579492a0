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
`gen_ai.usage.input_tokens` / `output_tokens` (streamed or not) and
`gen_ai.response.*` when the answer says), HTTP's
(`http.response.status_code`, `server.address`), and Brownout's own
(`brownout.tier`, `brownout.backend`, `brownout.outcome`, `brownout.fault`,
`brownout.retry`, `brownout.admission.wait_s`, ...).

Nothing here runs unless the policy names a collector: this module is
imported only then, and the request path's only cost otherwise is a `None`
check. When it runs, the event loop does as little as it can (measured:
`bench/otel_ab.py`, `bench/results/otel-cost.md`):

- The sampling decision comes first, once per request: the client's sampled
  flag, else `TraceIdRatioBased`'s rule (the trace id's low 64 bits against
  the ratio). A request that is not sampled gets no trace object at all:
  only its backend's `traceparent` string, formatted once (the client's
  trace id, or a new one, under a span id of ours, flag 00).
- A sampled span is a plain record (ids, times, an attribute dict) appended
  to a bounded queue when it ends; the SDK's `Tracer` would cost the loop
  several times more per span (its spans lock and validate every attribute).
- The export thread writes OTLP's protobuf itself (`proxy.telemetry.otlp`):
  the SDK's encoder costs more CPU per request than serving it.
- A collector that fails (refused, timed out, not 2xx) is backed off: what
  is queued is dropped, sampled requests are not recorded (their spans
  counted as dropped, their backends still get a sampled `traceparent`), and
  the thread probes with an empty export after 1 s, 2 s, ... 30 s until it
  answers. So an unreachable collector costs the loop what an unsampled
  request costs, and the thread encodes nothing that it would then lose.

A full queue drops spans too; `brownout_trace_spans_total{result}` counts
them all.
"""

from __future__ import annotations

import collections
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client import Counter

from proxy import __version__
from proxy.policy.telemetry import TelemetryPolicy
from proxy.telemetry.otlp import CLIENT, SERVER, Encoder, HttpExporter, SpanRecord

if TYPE_CHECKING:
    from proxy.backends.upstream import Upstream
    from proxy.pipeline.record import AttemptResult, RequestRecord, Terminal, TokenCount

__all__ = ["BatchExport", "RequestTrace", "SpanRecord", "Tracing", "parse_traceparent"]

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
# After an export failure: the first probe after this, doubling up to the cap.
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
# A NamedTuple built from its fields' tuple: half the cost of its keyword-capable __new__.
_record: Callable[[type[SpanRecord], tuple[Any, ...]], SpanRecord] = tuple.__new__
T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


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


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: `/v1/traces` added to a URL without a path."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


class Exporter(Protocol[T_contra]):
    """What the export queue hands its batches to (on its thread)."""

    def export(self, spans: Sequence[T_contra], /) -> SpanExportResult: ...

    def shutdown(self) -> None: ...


class OtlpExporter:
    """Span records to the collector (OTLP/HTTP protobuf), outcomes counted."""

    def __init__(self, pol: TelemetryPolicy, encoder: Encoder, spans: Counter) -> None:
        headers = dict(item.partition("=")[::2] for item in pol.otlp_headers)
        self._http = HttpExporter(traces_url(pol.otlp_endpoint), headers, pol.export_timeout_s)
        self._encoder = encoder
        self._exported = spans.labels("exported")
        self._failed = spans.labels("failed")
        self.error = ""  # the last failure, for the log line

    def export(self, spans: Sequence[SpanRecord], /) -> SpanExportResult:
        try:
            # No spans: an empty request, the probe of a collector backed off.
            self._http.post(self._encoder.encode(spans) if spans else b"")
        except Exception as exc:
            self._failed.inc(len(spans))
            self.error = str(exc) or type(exc).__name__
            return SpanExportResult.FAILURE
        self._exported.inc(len(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._http.close()


class BatchExport(Generic[T]):
    """Ended spans into a bounded queue; a daemon thread exports them in
    batches (every `batch_delay_s`, or as soon as a batch is full), each
    span turned into what the exporter takes by `convert` there, off the loop.

    The SDK's `BatchSpanProcessor` does the same for its own spans, but logs
    a warning for every span it drops — a log record per span, on the event
    loop, exactly while the collector is unreachable. Here a drop is one
    counter increment; the thread says what was lost, once per export.

    A failed export backs off: the queue is emptied (its spans counted as
    dropped), `accepting` turns False (the tracer records nothing then), and
    after `BACKOFF_MIN_S`, doubling to `BACKOFF_MAX_S`, the thread probes the
    collector with an empty export; the first that succeeds turns it back on."""

    def __init__(
        self,
        exporter: Exporter[Any],
        pol: TelemetryPolicy,
        dropped: Counter,
        convert: Callable[[T], Any] | None = None,
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
        # Read on the loop: False while the collector is backed off.
        self.accepting = True
        self._backoff = 0.0
        self._probe_at = 0.0
        self._thread = threading.Thread(target=self._run, name="brownout-traces", daemon=True)
        self._thread.start()

    def has_room(self) -> bool:
        """Whether spans ended now would be kept (on the loop: two reads)."""
        return self.accepting and len(self._queue) < self._max

    def drop(self, n: int) -> None:
        """`n` spans not recorded (the collector is backed off, the queue full)."""
        self._dropped.inc(n)
        self._drops += n

    def on_end(self, span: T) -> None:
        """On the event loop: an append (or a count), never a wait."""
        q = self._queue
        if len(q) >= self._max or self._closing or not self.accepting:
            self._dropped.inc()
            self._drops += 1
            return
        q.append(span)
        if len(q) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while True:
            wait = self._delay
            if not self.accepting:
                wait = max(0.0, self._probe_at - time.monotonic())
            self._wake.wait(wait)
            self._wake.clear()
            if self._closing:
                break
            if self.accepting:
                self._export()
            elif time.monotonic() >= self._probe_at:
                self._probe()
        if self.accepting:
            self._export()

    def _send(self, batch: list[Any]) -> bool:
        try:
            result = self._exporter.export(batch)
        except Exception:
            log.exception("trace_export_failed")
            return False
        return result is not SpanExportResult.FAILURE

    def _export(self) -> None:
        q = self._queue
        convert = self._convert
        while q and time.monotonic() < self._deadline:
            n = min(len(q), self._batch)
            pop = q.popleft
            batch = (
                [pop() for _ in range(n)] if convert is None else [convert(pop()) for _ in range(n)]
            )
            ok = self._send(batch)
            self._say_drops()
            if not ok:
                self._back_off()
                return

    def _say_drops(self) -> None:
        drops, self._drops = self._drops, 0
        if drops:
            log.warning(
                "trace_spans_dropped: %d span(s) dropped (telemetry.max_queue_spans full, or "
                "the collector backed off); the collector is slow or unreachable",
                drops,
            )

    def _back_off(self) -> None:
        first = self.accepting
        self.accepting = False
        # What is queued would only wait for a collector that is not answering.
        q, self._queue = self._queue, collections.deque()
        if q:
            self._dropped.inc(len(q))
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
        self._probe_at = time.monotonic() + self._backoff
        if first:
            log.warning(
                "trace_export_failing: %s; spans are not recorded until the collector answers "
                "(next try in %.3g s)",
                getattr(self._exporter, "error", "") or "export failed",
                self._backoff,
            )

    def _probe(self) -> None:
        if self._send([]):
            self._backoff = 0.0
            self.accepting = True
            log.warning("trace_export_recovered: the collector answers again; tracing resumed")
        else:
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
            self._probe_at = time.monotonic() + self._backoff
        self._say_drops()

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
        # The SDK's resource (telemetry.sdk.* included), encoded once.
        resource = Resource.create(
            {"service.name": pol.service_name, "service.version": __version__}
        )
        encoder = Encoder(dict(resource.attributes), "brownout", __version__)
        # TraceIdRatioBased's rule: sampled when the low 64 bits are below this.
        self._bound = round(pol.sample_ratio * (_MASK64 + 1))
        self._bits = random.getrandbits
        self._processor: BatchExport[SpanRecord] = BatchExport(
            OtlpExporter(pol, encoder, spans), pol, spans.labels("dropped")
        )
        self.emit = self._processor.on_end
        self._names: dict[tuple[str, str], str] = {}

    def start(self, rec: RequestRecord) -> None:
        """The request's sampling decision, from its arrival (`rec.t0`) on:
        `rec.trace` when it is recorded, else only `rec.traceparent` (what
        its backends get)."""
        req = rec.request
        header = req.headers.get("traceparent")
        parent = parse_traceparent(header) if header else None
        bits = self._bits
        if parent is not None:
            trace_id, parent_id, flags = parent
            flags &= 1  # sampled or not: the client's decision
        else:
            trace_id = bits(128) or 1
            parent_id = 0
            flags = 1 if (trace_id & _MASK64) < self._bound else 0
        span_id = bits(64) or 1
        proc = self._processor
        if not flags or not proc.has_room():
            if flags:  # sampled, but the collector is backed off (or the queue full)
                proc.drop(1)
            # (%-formatting: half the time of an f-string's format specs)
            rec.traceparent = "00-%032x-%016x-0%d" % (trace_id, span_id, flags)  # noqa: UP031
            return
        state = req.headers.get("tracestate", "") if parent_id else ""
        trace = rec.trace = RequestTrace(self, trace_id, span_id, parent_id, state)
        trace.start_ns = time.time_ns() - int((rec.loop.time() - rec.t0) * 1e9)
        op = trace.op = _OPERATION.get(rec.endpoint)
        key = (req.method, rec.endpoint)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"{req.method} {_PATH.get(rec.endpoint, req.path)}"
        trace.name = name
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
            for key_, attr in _REQUEST_PARAMS:
                v = body.get(key_)
                if v is not None and isinstance(v, int | float) and not isinstance(v, bool):
                    attrs[attr] = v
        if rec.session is not None:
            attrs["brownout.session"] = True

    def shutdown(self, timeout_s: float) -> None:
        """Export what is queued, within `timeout_s` (blocking: run it off the loop)."""
        self._processor.shutdown(timeout_s)


class _Attempt:
    """The attempt span in progress."""

    __slots__ = ("attrs", "backend", "name", "span_id", "start_ns")

    def __init__(self, name: str, backend: str, span_id: int, attrs: dict[str, Any]) -> None:
        self.name = name
        self.backend = backend
        self.span_id = span_id
        self.attrs = attrs
        self.start_ns = time.time_ns()


class RequestTrace:
    """A sampled request's spans: the request span and the attempt in progress
    (a request that is not sampled has none: `Tracing.start`)."""

    __slots__ = (
        "_tracing",
        "attempt",
        "attempts",
        "attrs",
        "name",
        "op",
        "parent_id",
        "span_id",
        "start_ns",
        "state",
        "trace_id",
    )

    def __init__(
        self, tracing: Tracing, trace_id: int, span_id: int, parent_id: int, state: str
    ) -> None:
        self._tracing = tracing
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.state = state
        self.start_ns = 0
        self.name = ""
        self.op: str | None = None
        self.attrs: dict[str, Any] = {}
        self.attempt: _Attempt | None = None
        self.attempts = 0

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
        self.attempt = _Attempt(name, up.name, self._tracing._bits(64) or 1, attrs)

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
        headers["traceparent"] = "00-%032x-%016x-01" % (self.trace_id, span_id)  # noqa: UP031

    def _emit(
        self,
        name: str,
        kind: int,
        span_id: int,
        parent_id: int,
        start_ns: int,
        attrs: dict[str, Any],
        error: str | None,
    ) -> None:
        self._tracing.emit(
            _record(
                SpanRecord,
                (
                    name,
                    kind,
                    self.trace_id,
                    span_id,
                    parent_id,
                    parent_id == self.parent_id,  # the client's span: a remote parent
                    self.state,
                    start_ns,
                    time.time_ns(),
                    attrs,
                    error,
                ),
            )
        )

    def _end(self, a: _Attempt, error: str | None) -> None:
        self._emit(a.name, CLIENT, a.span_id, self.span_id, a.start_ns, a.attrs, error)

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
        if result.tokens:
            _usage(result.tokens, a.backend, attrs)
        if result.kind == "answered" and result.status == 200 and not result.delivered:
            _answer_attributes(result, attrs)
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
        if result is not None and result.tokens:
            _usage(result.tokens, a.backend, a.attrs)
        ok = result is not None and result.kind == "answered"
        self._end(a, None if ok else f"rescue {outcome}")

    def finish(self, rec: RequestRecord, term: Terminal) -> None:
        """The request's end: what the client got."""
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
        tokens = term.tokens
        if tokens:
            # Every backend that answered (a rescued stream: both halves).
            attrs["gen_ai.usage.input_tokens"] = sum(t.prompt for t in tokens)
            attrs["gen_ai.usage.output_tokens"] = sum(t.completion for t in tokens)
        error = term.stream_error or (term.outcome if term.status >= 500 else "")
        if error:
            attrs["error.type"] = error
        self._emit(
            self.name,
            SERVER,
            self.span_id,
            self.parent_id,
            self.start_ns,
            attrs,
            error or None,
        )


def _usage(tokens: tuple[TokenCount, ...], backend: str, attrs: dict[str, Any]) -> None:
    """The attempt's backend's usage (an answer's `usage`, streamed or not)
    on its span; the request's is the sum, at its end."""
    for t in reversed(tokens):
        if t.backend == backend:
            attrs["gen_ai.usage.input_tokens"] = t.prompt
            attrs["gen_ai.usage.output_tokens"] = t.completion
            return


def _answer_attributes(result: AttemptResult, attrs: dict[str, Any]) -> None:
    """gen_ai.response.* of a whole (non-streaming) answer."""
    body = getattr(result.response, "body", None)
    if not isinstance(body, bytes) or not body.startswith(b"{"):
        return
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    if isinstance(obj, dict):
        _response_attributes(obj, attrs)


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
