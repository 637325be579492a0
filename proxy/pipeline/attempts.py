"""The attempts stage: try the route's candidates in order until one answers.

One attempt on one backend is admission (the primary, when throttling) →
adapt → backend call → relay with the guard; a stream that dies mid-answer
then goes to the rescue step. Each attempt's result goes to the inbox once;
whether to try again — the same backend within its retry budget, the next
candidate, or not at all — is decided in one place, `next_step`; the loop
only acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Literal, NamedTuple

import aiohttp
from aiohttp import web
from yarl import URL

from proxy.backends.upstream import ProbeMisconfigured, Upstream
from proxy.control.admission import Rejected
from proxy.control.attribution import definitive
from proxy.control.breaker import Permit
from proxy.control.retrybudget import backoff
from proxy.errors import JSON_CT, RequestRejected, error_response
from proxy.pipeline.adapt import payload_for
from proxy.pipeline.answers import shed
from proxy.pipeline.call import call, close, failed
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.passthrough import relay_passthrough
from proxy.pipeline.record import AttemptResult, RequestRecord
from proxy.pipeline.relay import relay_body, relay_events
from proxy.pipeline.rescue import can_rescue, rescue_or_end
from proxy.policy.ladder import FailoverPolicy

Step = Literal["return", "retry", "next"]


class Decision(NamedTuple):
    step: Step
    reason: str = ""  # why not "return": the retries metric's `reason`
    delay: float = 0.0  # "retry": wait this long first


_RETURN = Decision("return")  # the common answer, built once


def next_step(
    result: AttemptResult,
    pol: FailoverPolicy,
    *,
    retries: int,
    remaining_s: float,
    larger_window_next: bool,
    rand: Callable[[], float],
) -> Decision:
    """The retry rule, in one place (no I/O; the loop acts on it).

    - An answer, a client-fault 4xx (content policy, bad parameters), a shed
      (a retry's shed: "next"), a mid-answer failure, a client that left: "return".
    - A transient failure before the first byte (`result.retry`: a 5xx, a
      connection reset, a 429): "retry" on the same backend, up to
      `retry_max` times, after a jittered backoff — or the backend's
      `Retry-After` when it is short and fits the `remaining_s` of the
      request's first-byte deadline (the loop also spends the backend's retry
      budget); else "next".
    - Any other failure before the first byte (a timeout, a stream that never
      sent its first token, a refused connection): "next" at once.
    - Too long for this backend's context window: "next" when a later
      candidate has a larger one, else "return" (the 400) — never the same
      request to the same backend again.
    - Fields this backend does not honour: "next" (the error naming them is
      the answer if no other backend takes the request).
    """
    kind = result.kind
    if kind == "shed" and retries:
        # Its slot went to another request while it backed off: the next
        # backend rather than a 429 that its first attempt never got.
        return Decision("next", "shed")
    if kind == "refused":
        if result.code == "unsupported_fields":
            return Decision("next", "unsupported_fields")
        if result.code == "context_length_exceeded" and larger_window_next:
            return Decision("next", "context_length")
        return _RETURN
    if kind != "failed":
        return _RETURN
    reason = result.retry or result.fault or f"http_{result.status}"
    if not result.retry or retries >= pol.retry_max or definitive(result.body):
        # An engine that died (or ran out of memory) is not asked again.
        return Decision("next", reason)
    after = result.retry_after
    if after is not None:
        if after > pol.retry_after_max_s or after >= remaining_s:
            return Decision("next", reason)  # the backend asks for longer than we have
        return Decision("retry", reason, after)
    delay = backoff(retries + 1, pol.retry_backoff_s, pol.retry_backoff_max_s, rand)
    if delay >= remaining_s:
        return Decision("next", reason)
    return Decision("retry", reason, delay)


async def run_attempts(
    rec: RequestRecord, inbox: Inbox, candidates: list[Upstream], *, passthrough: bool = False
) -> AttemptResult | None:
    """The request's result; the last failure when none answered (an error
    naming unsupported fields before a plain failure); None when no
    candidate's breaker let a request through.

    A request fails once per backend: the retries of one request on the same
    backend reach its breaker as one outcome (the last attempt's). A request
    that gets a 5xx from every backend while their probes pass is the
    request's problem (`_failed_everywhere`): its failures are forgiven."""
    rt = rec.rt
    pol = rt.policy.ladder.failover
    loop = rec.loop
    last: AttemptResult | None = None
    refusal: AttemptResult | None = None
    prev: Upstream | None = None
    why = ""
    # 5xx failures that moved the request on (forgiven if it failed everywhere).
    server_errors: list[tuple[Upstream, AttemptResult, Permit]] = []
    trace = rec.trace
    retry_reason = ""  # why this attempt is a retry (its span says)
    for i, up in enumerate(candidates):
        retries = 0
        budget = up.retry_budget
        started = loop.time()
        # The candidate's, retries included.
        deadline = started + up.policy.timeouts.first_byte_s
        delay = 0.0
        while True:
            if delay:
                await asyncio.sleep(delay)
                delay = 0.0
            permit = up.breaker_for(rec.model).allow()
            if permit is None:
                break
            if prev is not None and prev is not up:
                inbox.retry(prev, up, why)
            prev = up
            rec.backend = up.name
            reported = False
            traced: AttemptResult | None = None
            d = _RETURN
            if trace is not None:
                reason = retry_reason if retries else (why if i else "")
                trace.begin_attempt(rec, up, retry=retries, reason=reason)
            try:
                # A retry gets what is left of the first attempt's deadline.
                result = await attempt(rec, up, inbox, passthrough, deadline if retries else None)
                traced = result
                if result.kind == "ended" and result.stream is not None:
                    inbox.attempt(up, result, permit)
                    reported = True
                    if trace is not None:
                        trace.end_attempt(result)  # the rescue is an attempt of its own
                    result = await rescue_or_end(rec, up, result, inbox)
                if not retries and result.kind != "shed":
                    # Retries are not requests, and neither is a request that
                    # admission shed before it reached the backend: counted, a
                    # burst of 429s would buy the admitted requests extra retries.
                    budget.request(started, pol.retry_budget_window_s)
                d = next_step(
                    result,
                    pol,
                    retries=retries,
                    remaining_s=deadline - loop.time(),
                    larger_window_next=(
                        result.kind == "refused" and _larger_window(up, candidates[i + 1 :])
                    ),
                    rand=rt.rand,
                )
                if d.step == "retry":
                    now = loop.time()
                    w = pol.retry_budget_window_s
                    if budget.take(now, w, pol.retry_budget_ratio, pol.retry_budget_min):
                        # Not reported: the retry's outcome is this request's one.
                        retries += 1
                        inbox.note(up, result)  # the flight recorder's (not reported)
                        inbox.retry(up, up, d.reason)
                        delay = d.delay
                        last = result
                        retry_reason = d.reason
                        continue
                    inbox.budget_exhausted(up, d.reason)
                    d = Decision("next", d.reason)
                if not reported:
                    inbox.attempt(up, result, permit)
                    if d.step == "next" and _server_error(result):
                        server_errors.append((up, result, permit))
            finally:
                inbox.settle(up, permit)
                if trace is not None:
                    trace.end_attempt(traced, d.step)
            if d.step == "return":
                return result
            why = d.reason
            # Kept: if no later candidate answers, this is the error to pass on
            # (fields a backend does not honour before a plain failure; a window
            # too small for the request is not: the larger backend's own failure
            # is the cause — chaos drill 8 answered poison with the primary's 400).
            if result.kind == "refused" and d.reason != "context_length":
                refusal = result
            else:
                last = result
            break
    if refusal is None and last is not None and _server_error(last):
        everywhere = await _failed_everywhere(rec, inbox, server_errors, last)
        if everywhere is not None:
            return everywhere
    return refusal or last


def _server_error(result: AttemptResult) -> bool:
    """A failed attempt that the backend answered with a 5xx (an HTTP error
    or an error event before the answer): what a poison request gets."""
    return (
        result.kind == "failed"
        and result.status >= 500
        and (result.fault.startswith("http_5") or result.fault == "upstream_error")
    )


async def _failed_everywhere(
    rec: RequestRecord,
    inbox: Inbox,
    failures: list[tuple[Upstream, AttemptResult, Permit]],
    last: AttemptResult,
) -> AttemptResult | None:
    """Every backend answered this request with a 5xx: if each passes its
    recovery probe (shared, at most one in flight per backend, a verdict
    reused for `health.interval_s`), the request is the problem — a 502
    naming it, its failures forgiven (charged to no one), not retried
    further; else None."""
    ups = list({up.name: up for up, _, _ in failures}.values())
    if len(ups) < 2:
        return None
    since = rec.t0  # a probe from before this request's failures says nothing of them
    verdicts = await asyncio.gather(*(up.shared_probe(rec.model, since) for up in ups))
    if any(v is not None for v in verdicts):
        return None
    names = ", ".join(up.name for up in ups)
    message = (
        f"the request failed with a server error on every backend ({names}) while each "
        "answers its health probe: the request itself is the problem (a parameter, schema "
        "or prompt the engines cannot handle); not retried"
    )
    for up, _, permit in failures:
        inbox.forgive(up, permit)
    headers = rec.headers(last.backend)
    headers["x-should-retry"] = "false"
    response = error_response(
        502, message, type_="server_error", code="request_failed_everywhere", headers=headers
    )
    return AttemptResult(
        "refused",
        last.backend,
        502,
        "rejected",
        detail="request failed on every backend",
        response=response,
        code="request_failed_everywhere",
    )


async def call_whole(
    rec: RequestRecord,
    up: Upstream,
    url: URL,
    payload: bytes | None,
    deadline: float,
    method: str,
) -> aiohttp.ClientResponse | AttemptResult:
    """A non-streaming call: its headers come after the whole generation, so
    `deadline` (first_byte_s) cannot tell a long answer from a stalled
    engine. Past it the backend's recovery probe (its 1-token chat) decides:
    a probe that fails ends the call as a first-byte timeout (the next
    candidate takes the request); one that passes lets it run to
    `timeouts.total_s` (a long generation is the request's, never a fault)."""
    total = rec.loop.time() + up.policy.timeouts.total_s
    task = asyncio.ensure_future(call(rec, up, url, payload, total, method, "total_timeout"))
    try:
        try:
            return await asyncio.wait_for(
                asyncio.shield(task), max(0.0, deadline - rec.loop.time())
            )
        except TimeoutError:
            pass
        why = await up.shared_probe(None if up.policy.model else rec.model, rec.loop.time())
        if why is None or isinstance(why, ProbeMisconfigured):
            return await task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return failed(
            up,
            504,
            "backend did not answer before the deadline, and its health probe failed too",
            "upstream_timeout",
            "first_byte_timeout",
            str(why),
        )
    except asyncio.CancelledError:
        task.cancel()
        raise


def _larger_window(up: Upstream, rest: list[Upstream]) -> bool:
    """Whether a later candidate's context window is known to be larger than `up`'s."""
    mine = up.max_model_len
    return any(
        o.max_model_len is not None and (mine is None or o.max_model_len > mine) for o in rest
    )


async def attempt(
    rec: RequestRecord,
    up: Upstream,
    inbox: Inbox,
    passthrough: bool,
    deadline: float | None = None,
) -> AttemptResult:
    rt = rec.rt
    # The proxy holds the line in front of the engine (vLLM never says 429).
    # (Admission inline, not a wrapper: one coroutine frame less per request.)
    throttle = rt.policy.ladder.throttle
    admit = up.name == "primary" and throttle.enabled
    client = who = ""
    if admit:
        # The client's identity: the admission's fair share, the optional cap.
        who = inbox.who if throttle.fair_share or throttle.max_inflight_per_client else ""
        cap = throttle.max_inflight_per_client
        if cap:
            # One client's share of the engine's slots (chaos drill 8: one
            # client's long answers held them all and the others were shed).
            client = who
            if not rt.client_slots.take(client, cap):
                return shed(rec, inbox, Rejected("client_limit", 1))
        trace = rec.trace
        waited_from = rec.loop.time() if trace is not None else 0.0
        try:
            await rt.admission.acquire(rec.priority, who)
        except Rejected as r:
            if client:
                rt.client_slots.give(client)
            if trace is not None:
                trace.admission_wait(rec.loop.time() - waited_from, r.reason)
            return shed(rec, inbox, r)
        if trace is not None:
            trace.admission_wait(rec.loop.time() - waited_from, "admitted")
    try:
        # One deadline for preparing the request (trimming may count tokens on
        # the backend) and for the backend's first byte, retries included.
        if deadline is None:
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
                backend = up.name if rej.code == "unsupported_fields" else "none"
                return AttemptResult(
                    "refused",
                    backend,
                    rej.status,
                    "rejected",
                    detail=rej.message,
                    response=rej.response(rec.headers(backend)),
                    code=rej.code,
                )
        t_call = rec.loop.time()
        rec.overhead_pre = t_call - rec.t0
        inbox.call_at = t_call
        if rec.stream or passthrough:
            resp = await call(rec, up, url, payload, deadline, method)
        else:
            resp = await call_whole(rec, up, url, payload, deadline, method)
        if isinstance(resp, AttemptResult):
            if resp.code == "total_timeout":
                headers = rec.headers(up.name)
                headers["Content-Type"] = JSON_CT
                headers["x-should-retry"] = "false"
                return resp._replace(
                    response=web.Response(status=504, body=resp.body, headers=headers)
                )
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
            if sse:
                # An event stream for a request that asked for one JSON body is
                # a broken backend, and nothing reached the client: the next one.
                return failed(
                    up,
                    502,
                    "backend answered a non-streaming request with an event stream",
                    "upstream_error",
                    "sse_for_json",
                    "sse_for_json",
                )
            return await relay_body(rec, up, resp)
        finally:
            close(resp)
    finally:
        if admit:
            rt.admission.release(who)
            if client:
                rt.client_slots.give(client)
