"""Answers the proxy gives itself: maintenance, shed (429), its own errors.

Each returns the response and the `Terminal` that records it; nothing here
writes shared state except through the inbox.
"""

from __future__ import annotations

from aiohttp import web

from proxy.control.admission import Rejected
from proxy.control.maintenance import render_json, render_stream
from proxy.errors import JSON_CT, error_response
from proxy.openai.messages import question_text
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import AttemptResult, RequestRecord, Terminal
from proxy.pipeline.relay import SSE_HEADERS

_SHED_MESSAGES = {
    "shed": "the service is under load and sheddable requests are refused for now",
    "queue_full": "the service is under load and its wait queue is full",
    "deadline": "the service is under load: the expected wait exceeds the queue deadline",
    "queue_timeout": "the service is under load: no slot freed up before the deadline",
    "evicted": "the service is under load: a higher-priority request took this slot",
    "client_limit": "this client already holds its share of the engine's slots "
    "(ladder.throttle.max_inflight_per_client)",
}


def maintenance(rec: RequestRecord, inbox: Inbox, why: str) -> tuple[web.Response, Terminal]:
    """Tier 3: the FAQ / maintenance notice as a valid completion; on a path
    it cannot answer (pass-through), an OpenAI 503 error with Retry-After.

    Its `X-Brownout-Tier` is `maintenance` whatever the ladder's tier: the
    ladder routes to maintenance only in that tier, but a request that no
    backend could answer gets this answer in any tier (its access-log line
    says `tier=maintenance` too, `finish`)."""
    rt = rec.rt
    pol = rt.policy.ladder.maintenance
    headers = rec.headers("maintenance")
    headers["X-Brownout-Tier"] = "maintenance"
    headers["Retry-After"] = str(pol.retry_after_s)
    if rec.endpoint not in ("chat", "completions"):
        inbox.maintenance_answer("unavailable")
        headers["x-should-retry"] = "false"
        response = error_response(
            503,
            f"the service is in maintenance ({why}); retry after {pol.retry_after_s} s",
            type_="server_error",
            code="service_unavailable",
            headers=headers,
        )
        return response, Terminal("maintenance", 503, "maintenance_unavailable", why)
    ans = rt.maintenance.answer(question_text(rec.body))
    inbox.maintenance_answer(ans.kind)
    model = rec.body.get("model") or "brownout-maintenance"
    if pol.status_code == 503:
        headers["x-should-retry"] = "false"
    if rec.stream:
        opts = rec.body.get("stream_options") or {}
        body = render_stream(ans.text, model, rec.endpoint, bool(opts.get("include_usage")))
        headers["Content-Type"] = "text/event-stream; charset=utf-8"
        headers.update(SSE_HEADERS)
    else:
        body = render_json(ans.text, model, rec.endpoint)
        headers["Content-Type"] = JSON_CT
    response = web.Response(status=pol.status_code, body=body, headers=headers)
    return response, Terminal("maintenance", pol.status_code, f"maintenance_{ans.kind}", why)


def shed(rec: RequestRecord, inbox: Inbox, r: Rejected) -> AttemptResult:
    inbox.shed(rec.priority, r.reason)
    headers = rec.headers("primary")
    headers["Retry-After"] = str(r.retry_after)
    message = _SHED_MESSAGES.get(r.reason, "the service is under load")
    response = error_response(
        429,
        f"{message}; retry after {r.retry_after} s",
        type_="rate_limit_error",
        code="rate_limit_exceeded",
        headers=headers,
    )
    return AttemptResult("shed", "primary", 429, f"shed_{r.reason}", response=response)


def passed_error(rec: RequestRecord, result: AttemptResult) -> tuple[web.Response, Terminal]:
    """The last attempt's error, when no backend answered."""
    headers = rec.headers(result.backend)
    headers["Content-Type"] = JSON_CT
    response = web.Response(status=result.status, body=result.body, headers=headers)
    return response, Terminal(result.backend, result.status, "error", result.detail)


def proxy_error(
    rec: RequestRecord, status: int, message: str, code: str, backend: str = "none"
) -> tuple[web.Response, Terminal]:
    headers = rec.headers(backend)
    headers["x-should-retry"] = "false"
    response = error_response(status, message, type_="server_error", code=code, headers=headers)
    return response, Terminal(backend, status, "error", message)
