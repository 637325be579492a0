"""The attempts stage: try the route's candidates in order until one answers.

One attempt on one backend is admission (the primary, when throttling) →
adapt → backend call → relay with the guard; a stream that dies mid-answer
then goes to the rescue step. Each attempt's result goes to the inbox once;
whether to try again is decided in one place, `next_step` (where the
retry discipline of issue 14 — same-backend retries within a budget, never
after a timeout, 4xx semantics — is meant to go; the loop only acts on it).
"""

from __future__ import annotations

from typing import Literal

from proxy.backends.upstream import Upstream
from proxy.control.admission import Rejected
from proxy.errors import RequestRejected
from proxy.pipeline.adapt import payload_for
from proxy.pipeline.answers import shed
from proxy.pipeline.call import call, close, failed
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.passthrough import relay_passthrough
from proxy.pipeline.record import AttemptResult, RequestRecord
from proxy.pipeline.relay import relay_body, relay_events
from proxy.pipeline.rescue import can_rescue, rescue_or_end

Step = Literal["return", "next"]


def next_step(result: AttemptResult) -> Step:
    """The retry rule. A failure before any byte reached the client (refused
    connection, 5xx, 429, timeout, an error event first, a stream closed
    before its first event) moves on to the next candidate; anything the
    client has seen or must see (an answer, a 4xx, a shed, a mid-answer
    failure, a client that left) ends the attempts."""
    return "next" if result.kind == "failed" else "return"


async def run_attempts(
    rec: RequestRecord, inbox: Inbox, candidates: list[Upstream], *, passthrough: bool = False
) -> AttemptResult | None:
    """The request's result; the last failure when none answered; None when
    no candidate's breaker let a request through."""
    last: AttemptResult | None = None
    prev: Upstream | None = None
    for up in candidates:
        permit = up.breaker.allow()
        if permit is None:
            continue
        if prev is not None:
            inbox.retry(prev, up)
        prev = up
        rec.backend = up.name
        try:
            result = await attempt(rec, up, inbox, passthrough)
            inbox.attempt(up, result, permit)
            if result.kind == "ended" and result.stream is not None:
                result = await rescue_or_end(rec, up, result, inbox)
        finally:
            inbox.settle(up, permit)
        if next_step(result) == "return":
            return result
        last = result
    return last


async def attempt(
    rec: RequestRecord, up: Upstream, inbox: Inbox, passthrough: bool
) -> AttemptResult:
    rt = rec.rt
    if up.name != "primary" or not rt.policy.ladder.throttle.enabled:
        return await _attempt(rec, up, inbox, passthrough)
    # The proxy holds the line in front of the engine (vLLM never says 429).
    try:
        await rt.admission.acquire(rec.priority)
    except Rejected as r:
        return shed(rec, inbox, r)
    try:
        return await _attempt(rec, up, inbox, passthrough)
    finally:
        rt.admission.release()


async def _attempt(
    rec: RequestRecord, up: Upstream, inbox: Inbox, passthrough: bool
) -> AttemptResult:
    # One deadline for preparing the request (trimming may count tokens on
    # the backend) and for the backend's first byte.
    deadline = rec.loop.time() + up.policy.timeouts.first_byte_s
    if passthrough:
        req = rec.request
        url = up.url_for(req.rel_url.raw_path_qs)
        payload: bytes | None = rec.raw or None
        method = req.method
    else:
        url = up.chat_url if rec.chat else up.completions_url
        method = "POST"
        try:
            payload = await payload_for(rec, up, inbox, deadline)
        except TimeoutError:
            # Not the backend's fault (no fault): the request took too long to prepare.
            return failed(
                up,
                504,
                "the request could not be prepared before the deadline",
                "upstream_timeout",
                "",
            )
        except RequestRejected as rej:
            return AttemptResult(
                "refused",
                "none",
                rej.status,
                "rejected",
                detail=rej.message,
                response=rej.response(rec.headers("none")),
                code=rej.code,
            )
    t_call = rec.loop.time()
    rec.overhead_pre = t_call - rec.t0
    resp = await call(rec, up, url, payload, deadline, method)
    if isinstance(resp, AttemptResult):
        return resp
    try:
        sse = resp.status == 200 and resp.headers.get("Content-Type", "").startswith(
            "text/event-stream"
        )
        if passthrough:
            return await relay_passthrough(rec, up, resp, deadline, t_call, sse=sse)
        if rec.stream and sse:
            keep = can_rescue(rec, up) or rec.session is not None
            return await relay_events(rec, up, resp, deadline, t_call, keep=keep)
        return await relay_body(rec, up, resp)
    finally:
        close(resp)
