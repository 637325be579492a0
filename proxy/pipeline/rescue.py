"""The rescue step: a stream that died mid-answer continues on the fallback,
or ends with its error event and [DONE] — never a silent truncation.

The partial answer (choice 0, extracted once from the kept regions) becomes
the continuation request (`proxy.openai.partial`): an assistant prefill
(`continue_final_message`) where the fallback supports it; a prompt-level
continuation (the partial answer as the previous assistant turn and an
instruction to continue exactly where it stopped) where it does not — learnt
from its advertised capabilities, its 400 to a prefill (never the client's
error, never a backend failure), or `backends.<name>.supports_continuation`.
The seam is checked, not trusted (`proxy.openai.seam`): a continuation by
prompt is often answered from the start, so its first events are held until
it is clear whether it restarts the answer (the repeated prefix is
stripped), overlaps the seam by a few words (the overlap is stripped) or
continues cleanly (relayed as is); one that restarts with different words
cannot be aligned and ends the stream with an error event
(`rescue_misaligned`) and [DONE] rather than relay a second answer. A
prefill continuation is trusted but checked cheaply for a whole restart.
Not rescued: guard trips (the output was the problem), a stream that was
emitting `tool_calls` (a text continuation would turn a tool call into
prose), a fallback that would drop fields, `n > 1` (one continuation cannot
carry several choices), pass-through paths, answers longer than
`server.max_kept_bytes`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import aiohttp
import structlog

from proxy.backends.upstream import Upstream
from proxy.control.breaker import Permit
from proxy.errors import RequestRejected
from proxy.openai.partial import (
    choices_requested,
    continuation_body,
    partial_text,
    prompt_continuation_body,
    streamed_answer,
)
from proxy.openai.seam import prepare
from proxy.openai.sse import error_events
from proxy.openai.usage import ask_for_usage
from proxy.pipeline.adapt import adapted, asks_usage
from proxy.pipeline.call import call, close
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.pump import StreamResult, end_with_error, relay_stream
from proxy.pipeline.record import AttemptResult, RequestRecord
from proxy.pipeline.relay import itl_for, stream_attempt
from proxy.pipeline.seamread import read_seam

log = structlog.get_logger("brownout.request")


def can_rescue(rec: RequestRecord, up: Upstream) -> bool:
    """Whether a failure of `up` mid-answer could be rescued (decided before
    the stream starts: the relay keeps the forwarded regions only then)."""
    fb = rec.rt.upstreams.get("fallback")
    return (
        rec.rt.policy.ladder.failover.rescue_streams
        and rec.endpoint in ("chat", "completions")
        and fb is not None
        and fb is not up
        # Chat continues by prefill or, where the fallback lacks it, by prompt.
        and (rec.chat or fb.supports_continuation)
        and choices_requested(rec.body) == 1
    )


async def rescue_or_end(
    rec: RequestRecord, up: Upstream, result: AttemptResult, inbox: Inbox
) -> AttemptResult:
    """`result` is a stream that ended mid-answer (kind "ended", already
    reported for `up`): the request's final result after a rescue or the end."""
    sr = result.stream
    assert sr is not None
    fb = rec.rt.upstreams.get("fallback")
    if (
        result.trip is None
        and fb is not None
        and sr.regions is not None
        and can_rescue(rec, up)
        and not _calls_tools(sr.regions)
    ):
        permit = fb.breaker_for(rec.model).allow()
        if permit is None:
            inbox.rescue("fallback_unavailable")
        else:
            trace = rec.trace
            if trace is not None:
                trace.begin_attempt(rec, fb, rescue_from=up.name)
            rescued: AttemptResult | None = None
            try:
                rescued = await _rescue_on(rec, fb, permit, up, result, sr, inbox)
            finally:
                inbox.settle(fb, permit)
                if trace is not None:
                    trace.end_rescue(rescued)
            if rescued is not None:
                return rescued
    await end_with_error(sr)
    return result


def _calls_tools(regions: list[bytes]) -> bool:
    """A stream that was emitting `tool_calls`: never restarted as plain text
    (the continuation carries text only). One search, on a failure only."""
    return any(b'"tool_calls"' in r for r in regions)


async def _rescue_on(
    rec: RequestRecord,
    fb: Upstream,
    permit: Permit,
    up: Upstream,
    result: AttemptResult,
    sr: StreamResult,
    inbox: Inbox,
) -> AttemptResult | None:
    """None: the fallback could not take over (the caller ends the stream)."""
    client = sr.client
    assert client is not None
    kind = "chat" if rec.chat else "completions"
    partial, produced = partial_text(sr.regions or [], kind, sr.runs)
    log.warning(
        "stream_rescue",
        request_id=rec.rid,
        from_backend=up.name,
        to_backend=fb.name,
        reason=sr.outcome,
        partial_chars=len(partial),
    )
    t_call = rec.loop.time()
    inbox.call_at = t_call
    deadline = t_call + fb.policy.timeouts.first_byte_s
    url = fb.chat_url if rec.chat else fb.completions_url
    try:
        # An SSE comment: invisible to OpenAI clients, visible on the wire.
        note = f": brownout-rescue from={up.name} to={fb.name} reason={sr.outcome}\n\n"
        await client.write(note.encode())
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return result._replace(kind="client_gone", outcome="client_disconnect", stream=None)
    try:
        fitted = await adapted(rec, fb, inbox, deadline)
    except (TimeoutError, RequestRejected) as exc:
        log.warning("stream_rescue_impossible", request_id=rec.rid, reason=str(exc))
        inbox.rescue("failed")
        return None
    if rec.dropped.get(fb.name):
        # The client's headers are gone: dropping fields now would be silent.
        log.warning("stream_rescue_impossible", request_id=rec.rid, reason="unsupported fields")
        inbox.rescue("failed")
        return None
    prefill = rec.chat and bool(partial) and fb.supports_continuation
    trusted = prefill or not rec.chat  # the fallback continues the text itself
    body = (
        continuation_body(fitted, partial, produced, kind)
        if prefill or not rec.chat
        else prompt_continuation_body(fitted, partial, produced)
    )
    ask = asks_usage(rec, fb)
    resp = await call(rec, fb, url, _payload(body, ask), deadline)
    if prefill and not isinstance(resp, AttemptResult) and resp.status == 400:
        # The fallback refuses the assistant prefill: learn it (not a backend
        # failure, not the client's error) and continue by prompt instead.
        with contextlib.suppress(aiohttp.ClientError):
            await resp.read()
        close(resp)
        fb.supports_continuation = False
        inbox.rescue("prefill_rejected")
        log.warning("continuation_unsupported", request_id=rec.rid, backend=fb.name)
        body = prompt_continuation_body(fitted, partial, produced)
        trusted = False
        resp = await call(rec, fb, url, _payload(body, ask), deadline)
    if isinstance(resp, AttemptResult):
        inbox.failure(fb, permit, "rescue", resp.detail or resp.fault, suspect=True)
        inbox.rescue("failed")
        return None
    try:
        if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith(
            "text/event-stream"
        ):
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()
            if resp.status >= 500:
                inbox.failure(fb, permit, f"http_{resp.status}", suspect=True)
            inbox.rescue("failed")
            return None
        rt = rec.rt
        pol = rt.policy.server
        seam = await read_seam(
            resp,
            client,
            prepare(partial),
            endpoint=kind,
            restart_only=trusted,
            first_byte_deadline=deadline,
            idle_s=fb.policy.timeouts.idle_s,
            heartbeat_s=pol.heartbeat_s,
            max_event_bytes=pol.max_event_bytes,
        )
        if seam.seam.kind != "clean":
            log.warning(
                "stream_rescue_seam",
                request_id=rec.rid,
                backend=fb.name,
                seam=seam.seam.kind,
                stripped_chars=seam.seam.strip,
                by_prompt=not trusted,
            )
        if seam.seam.kind in ("restart", "overlap"):
            inbox.rescue(f"{seam.seam.kind}_stripped")
        if seam.seam.kind == "misaligned":
            inbox.rescue("misaligned")
            return await _misaligned(rec, fb, result, sr)
        if seam.failure is not None:
            more = seam.failure
        else:
            # The same guard as the answer it continues: a token split at the seam is seen.
            sg = rec.guards[-1][1] if rec.guards else None
            more = await relay_stream(
                rec.request,
                resp,
                {},
                heartbeat_s=pol.heartbeat_s,
                first_byte_deadline=seam.first_byte_deadline,
                idle_s=fb.policy.timeouts.idle_s,
                client=client,
                keep=True,
                guard=sg,
                end_response=rec.session is None,
                max_event_bytes=pol.max_event_bytes,
                keep_limit=pol.max_kept_bytes,
                prefix=seam.prefix,
                strip_usage=ask,
                itl=itl_for(rec, fb.name),
            )
    finally:
        close(resp)
    sr.events += more.events
    if sr.regions is not None and more.regions:
        sr.regions.extend(more.regions)
        if sr.runs is not None and more.runs is not None:
            sr.runs.extend(more.runs)
    elif more.regions is None:
        sr.regions = None
    fb_result = stream_attempt(rec, fb, more, t_call)
    inbox.attempt(fb, fb_result._replace(stream=None), permit)
    events = sr.events
    # Each leg's usage on its own backend: the cut answer's, when it sent
    # any, and the continuation's (whose prompt includes the partial answer).
    tokens = result.tokens + fb_result.tokens
    if more.outcome == "complete":
        inbox.rescue("rescued")
        rec.rescued = True
        answer = None
        if rec.session is not None and rec.chat and sr.regions is not None:
            answer = streamed_answer(sr.regions, "chat", sr.runs)
        return result._replace(
            kind="answered",
            outcome="complete",
            detail=f"rescued on {fb.name} after {sr.detail or up.name + ' failed'}",
            events=events,
            answer=answer,
            stream=None,
            tokens=tokens,
        )
    if more.outcome == "client_disconnect":
        return result._replace(
            kind="client_gone",
            outcome="client_disconnect",
            events=events,
            stream=None,
            tokens=tokens,
        )
    inbox.rescue("failed")
    await end_with_error(more)
    return result._replace(
        outcome=more.outcome,
        detail=f"rescue on {fb.name} failed: {more.detail}",
        events=events,
        stream=None,
        tokens=tokens,
    )


def _payload(body: dict[str, Any], ask: bool) -> bytes:
    payload = json.dumps(body).encode()
    return ask_for_usage(payload, body) if ask else payload


async def _misaligned(
    rec: RequestRecord, fb: Upstream, result: AttemptResult, sr: StreamResult
) -> AttemptResult:
    """The continuation restarted the answer with different words: relaying
    it would give the client a second answer after the first; dropping it
    would present the cut answer as whole. The stream ends in-band instead
    (the fallback worked: nothing is charged to its breaker)."""
    detail = (
        f"the answer was cut and {fb.name} restarted it differently: "
        "the continuation cannot be aligned with what was sent"
    )
    log.warning("stream_rescue_misaligned", request_id=rec.rid, backend=fb.name)
    client = sr.client
    assert client is not None
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
        await client.write(error_events(detail, "server_error", "rescue_misaligned"))
    return result._replace(detail=f"rescue on {fb.name} misaligned", stream=None)
