"""The finish step: one terminal record per request — one metrics update and
one access-log line, on every path (answer, upstream error, shed, maintenance,
rejected, client disconnect, unexpected exception)."""

from __future__ import annotations

from typing import Any

import structlog

from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import AttemptResult, RequestRecord, Terminal

log = structlog.get_logger("brownout.request")


def terminal_of(result: AttemptResult) -> Terminal:
    return Terminal(
        result.backend,
        result.status,
        result.outcome,
        result.detail,
        client_ttft=result.client_ttft,
        overhead=result.overhead if result.kind == "answered" else None,
        events=result.events,
        stream_error=result.outcome if result.delivered and result.kind == "ended" else "",
        bad_request=result.code if result.kind == "refused" else "",
        answer=result.answer,
        tokens=result.tokens,
    )


def finish(rec: RequestRecord, term: Terminal, inbox: Inbox | None = None) -> None:
    rt = rec.rt
    m = rt.metrics
    now = rec.loop.time()
    elapsed = now - rec.t0
    recorder = rt.recorder
    if recorder is not None:
        # The flight recorder: one tuple of plain values on a deque (nothing
        # that keeps the request's objects alive); encoded off the loop.
        s = rec.session
        body = rec.body
        recorder.put(
            (
                "req",
                rec.t0,
                rec.endpoint,
                rec.priority,
                rec.stream,
                s.key if s is not None else None,
                len(rec.raw),
                body.get("max_tokens") or body.get("max_completion_tokens"),
                inbox.attempts if inbox is not None else None,
                term.backend,
                term.status,
                term.outcome,
                term.client_ttft,
                elapsed,
                term.events,
                inbox.retries if inbox is not None else 0,
                rec.rescued,
                inbox.identity if inbox is not None else None,
                rt.tier,
                (body.get("messages", body.get("prompt")), term.answer)
                if recorder.policy.content
                else None,
            )
        )
    rt.count_request(term.backend, rec.endpoint, term.status)
    bm = rt.backend_metrics.get(term.backend)
    if bm is not None:
        bm.duration.observe(elapsed)
        bm.ttft.observe(term.client_ttft if term.client_ttft is not None else elapsed)
    if term.overhead is not None:
        m.overhead.observe(term.overhead)
    if term.outcome == "client_disconnect":
        m.client_disconnects.labels(term.backend).inc()
    elif term.stream_error:
        m.stream_errors.labels(term.backend, term.stream_error).inc()
    if term.bad_request:
        m.bad_requests.labels(term.bad_request).inc()
    if term.tokens:
        tier = rt.tier
        for t in term.tokens:
            m.count_tokens(t.backend, t.model, tier, t.prompt, t.completion)
            if t.tpot is not None:
                tb = rt.backend_metrics.get(t.backend)
                if tb is not None:
                    tb.per_output_token.observe(t.tpot)
    canary = rt.canary
    if canary is not None and canary.rollout.running:
        canary.finished(rec, term, elapsed)  # the gates' sample (a rollout runs)
    extra: dict[str, Any] = {}
    notes = []
    for backend, sg in rec.guards:
        # Guard notes (log-mode rules, dropped malformed events): counted, and
        # named once in this line whatever their number.
        for note in sg.notes:
            count = sg.dropped if note.rule == "malformed" and sg.dropped else 1
            m.guard_notes.labels(note.rule, backend).inc(count)
            notes.append(
                {"rule": note.rule, "backend": backend, "count": count, "excerpt": note.excerpt}
            )
    if notes:
        extra["guard_notes"] = notes
    trace = rec.trace
    if trace is not None:
        trace.finish(rec, term)
    if rec.rescued:
        extra["rescued"] = True
    if term.detail:
        extra["detail"] = term.detail
    # `log.bind().info`, not `log.info`: the same bound logger, without the
    # lazy proxy's failed attribute lookup (an AttributeError made and
    # dropped, ~8,000 instructions) on every request.
    log.bind().info(
        "request",
        request_id=rec.rid,
        endpoint=rec.endpoint,
        backend=term.backend,
        # What the client was told: a maintenance answer's tier is maintenance.
        tier="maintenance" if term.backend == "maintenance" else rt.tier,
        status=term.status,
        stream=rec.stream,
        outcome=term.outcome,
        duration_ms=round(elapsed * 1000, 2),
        ttft_ms=round(term.client_ttft * 1000, 2) if term.client_ttft is not None else None,
        events=term.events,
        **extra,
    )
