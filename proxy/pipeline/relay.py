"""The relay step: a backend's response → the client, as an `AttemptResult`.

Non-streaming answers are read whole (within `idle_s`), checked by the guard
and passed on; streams go through the pump (`proxy.pipeline.pump`) with the
guard on every region. Nothing here touches a breaker or a metric: what
happened travels back in the result.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from proxy.backends.upstream import Upstream
from proxy.control.retrybudget import retry_after_s
from proxy.errors import JSON_CT, error_body
from proxy.guard.verdicts import Trip
from proxy.openai.errors import is_context_error, upstream_error_body
from proxy.openai.partial import answer_from_body, streamed_answer
from proxy.openai.usage import usage_of_body
from proxy.pipeline.adapt import asks_usage
from proxy.pipeline.call import failed
from proxy.pipeline.pump import EventStream, StreamResult, relay_stream
from proxy.pipeline.record import AttemptKind, AttemptResult, RequestRecord, TokenCount
from proxy.telemetry.metrics import Buckets

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# Worth a second try on the same backend (504 is a timeout: never retried there).
TRANSIENT_STATUS = frozenset({429, 500, 502, 503})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Headers of a pass-through answer that describe its body (hop-by-hop and
# framing headers are aiohttp's business).
PASSTHROUGH_HEADERS = ("Content-Type", "Content-Encoding", "Retry-After")


_ERROR_BODY = re.compile(rb'\s*\{\s*"error"\s*:')


def _is_error_object(body: bytes) -> bool:
    """`{"error": {...}}` without `choices` (checked only when it starts like one)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "choices" not in obj


def _fault(status: int) -> str:
    return "" if status == 429 else f"http_{status}"  # 429 is load, not a broken backend


def shed_fault(status: int, headers: Mapping[str, str]) -> str:
    """The breaker fault of an HTTP error answer. A 429, or a 503 that says
    when to come back (`Retry-After`: the fallback server's "over capacity",
    a load balancer shedding), is load on a working backend, not a broken
    one: it fails over (and is retried within the budget), but never opens
    the backend's breaker — a burst would otherwise take a healthy fallback
    out and send users to maintenance."""
    if status == 503 and "Retry-After" in headers:
        return ""
    return _fault(status)


async def relay_body(
    rec: RequestRecord, up: Upstream, resp: aiohttp.ClientResponse
) -> AttemptResult:
    t_upstream = rec.loop.time()
    try:
        async with asyncio.timeout(up.policy.timeouts.idle_s):
            body = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        name = type(exc).__name__
        return failed(
            up, 502, f"backend answer could not be read: {name}", "upstream_error", "body", name
        )
    status = resp.status
    if status in RETRYABLE_STATUS:
        return AttemptResult(
            "failed",
            up.name,
            status,
            "error",
            fault=shed_fault(status, resp.headers),
            body=upstream_error_body(status, body),
            retry=f"http_{status}" if status in TRANSIENT_STATUS else "",
            retry_after=retry_after_s(resp.headers.get("Retry-After")),
        )
    headers = rec.headers(up.name)
    if status == 400 and is_context_error(body):
        # The request is too long for this backend: never resent to it
        # unchanged (the attempt loop may route it to a larger window).
        headers["Content-Type"] = JSON_CT
        return AttemptResult(
            "refused",
            up.name,
            400,
            "rejected",
            detail="backend: context length exceeded",
            response=web.Response(
                status=400, body=upstream_error_body(status, body), headers=headers
            ),
            code="context_length_exceeded",
        )
    if status == 200 and _ERROR_BODY.match(body, 0, 64) and _is_error_object(body):
        # A 200 that carries an error object is a failure, not an answer (it
        # must not close a half-open breaker; nothing reached the client yet).
        return failed(
            up,
            502,
            "backend answered 200 with an error object",
            "upstream_error",
            "upstream_error",
            "http_200_error",
        )._replace(body=upstream_error_body(502, body))
    guard = rec.rt.guard
    if status == 200 and guard is not None:
        trip = guard.check_body(body)
        if trip is not None:
            out = web.Response(
                status=502,
                body=error_body(trip.message, "server_error", "invalid_output"),
                headers={**headers, "Content-Type": JSON_CT},
            )
            return AttemptResult(
                "ended",
                up.name,
                502,
                "guard_trip",
                detail=trip.rule,
                response=out,
                fault="invalid_output",
                trip=trip,
            )
    ctype = resp.headers.get("Content-Type", JSON_CT)
    if status >= 400:
        body = upstream_error_body(status, body)
        ctype = JSON_CT
    headers["Content-Type"] = ctype
    answer = None
    tokens: tuple[TokenCount, ...] = ()
    if status == 200:
        if rec.session is not None and rec.chat:
            answer = answer_from_body(body)
        usage = usage_of_body(body)
        if usage is not None:
            tokens = (TokenCount(up.name, rec.model_for(up.name), *usage),)
    now = rec.loop.time()
    return AttemptResult(
        "answered",
        up.name,
        status,
        "complete",
        response=web.Response(status=status, body=body, headers=headers),
        healthy=True,  # a 4xx is the request's fault, not the backend's
        overhead=rec.overhead_pre + (now - t_upstream),
        answer=answer,
        tokens=tokens,
    )


async def relay_events(
    rec: RequestRecord,
    up: Upstream,
    resp: aiohttp.ClientResponse,
    deadline: float,
    t_call: float,
    *,
    keep: bool,
    prefix: bytes = b"",
) -> AttemptResult:
    rt = rec.rt
    pol = rt.policy.server
    headers = rec.headers(up.name)
    headers["Content-Type"] = resp.headers.get("Content-Type", "text/event-stream")
    headers.update(SSE_HEADERS)
    client = rec.client = EventStream(status=200, headers=headers)
    sg = rt.guard.stream() if rt.guard is not None else None
    if sg is not None:
        rec.guards.append((up.name, sg))
    result = await relay_stream(
        rec.request,
        resp,
        headers,
        heartbeat_s=pol.heartbeat_s,
        first_byte_deadline=deadline,
        idle_s=up.policy.timeouts.idle_s,
        client=client,
        keep=keep,
        guard=sg,
        end_response=rec.session is None,
        max_event_bytes=pol.max_event_bytes,
        keep_limit=pol.max_kept_bytes,
        prefix=prefix,
        strip_usage=asks_usage(rec, up),
        itl=itl_for(rec, up.name),
    )
    return stream_attempt(rec, up, result, t_call)


def stream_attempt(
    rec: RequestRecord, up: Upstream, result: StreamResult, t_call: float
) -> AttemptResult:
    """What a relayed stream's outcome means for the request and the backend."""
    overhead = None
    if result.first_event_at is not None and result.headers_sent_at is not None:
        overhead = rec.overhead_pre + max(0.0, result.headers_sent_at - result.first_event_at)
    outcome = result.outcome
    status = 200
    response = result.client
    fault = retry = ""
    body = b""
    healthy = False
    ttft: float | None = None
    answer: str | None = None
    stream: StreamResult | None = None
    trip: Trip | None = None
    tokens: tuple[TokenCount, ...] = ()
    usage = result.usage
    if usage is not None:
        tokens = (TokenCount(up.name, rec.model_for(up.name), *usage, _tpot(result, usage[1])),)
    # One AttemptResult built once (no `_replace`: this runs on every stream).
    if not result.started:
        assert result.response is not None
        status = result.status
        if status in RETRYABLE_STATUS:
            kind: AttemptKind = "failed"
            raw = result.response.body
            # An error event instead of the answer is transient; a stream that
            # opened and never sent its first token (closed, silent) is not.
            if outcome == "upstream_error" and status in TRANSIENT_STATUS:
                retry = f"http_{status}"
            response = None
            fault = _fault(status) and outcome
            body = raw if isinstance(raw, bytes) else b""
        else:
            # The backend's own 4xx error event, before any answer: passed on as is.
            kind, response, healthy = "answered", result.response, True
    elif outcome == "complete":
        kind, healthy = "answered", True
        if rec.session is not None and rec.chat:
            answer = streamed_answer(result.regions, "chat", result.runs)
        ttft = (result.first_event_at or t_call) - t_call
    elif outcome == "client_disconnect":
        kind = "client_gone"
    else:
        kind, fault, stream = "ended", outcome, result
        if outcome == "guard_trip":
            fault, trip = "invalid_output", result.trip
    return AttemptResult(
        kind,
        up.name,
        status,
        outcome,
        detail=result.detail,
        response=response,
        delivered=result.started,
        fault=fault,
        healthy=healthy,
        ttft=ttft,
        client_ttft=(
            result.headers_sent_at - rec.t0 if result.headers_sent_at is not None else None
        ),
        overhead=overhead,
        events=result.events,
        body=body,
        trip=trip,
        answer=answer,
        stream=stream,
        retry=retry,
        tokens=tokens,
    )


def itl_for(rec: RequestRecord, backend: str) -> Buckets | None:
    bm = rec.rt.backend_metrics.get(backend)
    return bm.inter_token if bm is not None else None


def _tpot(result: StreamResult, completion: int) -> float | None:
    """Seconds per output token after the first: the stream's first to last
    events over its other completion tokens (vLLM's time_per_output_token)."""
    first, last = result.first_event_at, result.last_event_at
    if first is None or last is None or completion < 2:
        return None
    return max(0.0, last - first) / (completion - 1)
