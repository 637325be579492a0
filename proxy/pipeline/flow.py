"""The request pipeline, stage by stage (see the package docstring).

`serve` is the only place a request's end is recorded: whatever the stages
return, raise or suffer (a client that leaves cancels the handler), exactly
one `Terminal` goes to `finish`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.errors import error_response
from proxy.openai.sse import error_events
from proxy.pipeline.answers import maintenance, passed_error, proxy_error
from proxy.pipeline.attempts import run_attempts
from proxy.pipeline.finish import finish, terminal_of
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import RequestRecord, Terminal
from proxy.pipeline.sessions import load_history, save_turn
from proxy.policy import Priority
from proxy.runtime.generation import Runtime

log = structlog.get_logger("brownout.request")


def serve_passthrough(
    request: web.Request, rt: Runtime, raw: bytes, rid: str, t0: float, priority: Priority
) -> Coroutine[Any, Any, web.StreamResponse]:
    """Every other /v1/* request: the same stages, the body passed on unchanged.
    (Chat and completions: `serve` of the ingress's record.)"""
    return serve(RequestRecord(request, rt, "passthrough", raw, {}, False, rid, t0, priority))


async def serve(rec: RequestRecord) -> web.StreamResponse:
    inbox = Inbox(rec.rt, rec.rid, rec.request, rec.body)
    tracing = rec.rt.tracing
    if tracing is not None:
        tracing.start(rec)  # rec.trace when sampled, else only rec.traceparent
    term: Terminal | None = None
    response: web.StreamResponse
    # In flight from here to the record: what a reload's drain waits for.
    rec.rt.inflight += 1
    try:
        # The stages, inline: every suspension of a stream resumes each frame
        # of the chain, so the pipeline keeps it short.
        if rec.session is not None:
            refused = await load_history(rec, inbox)
            if refused is not None:  # a new session past its client's cap
                response, term = refused
                return response
        rt = rec.rt
        # In maintenance a backend gets a request only as its recovery trial
        # (Runtime.route): the maintenance answer stays the tier's answer unless
        # the trial answers — a backend that cannot take this request (fields it
        # does not honour, a window too small, its admission full) is no reason
        # to answer otherwise than without the trial.
        trial = rt.tier == "maintenance"
        dest, candidates = rt.route()
        if dest == "maintenance":
            response, term = maintenance(rec, inbox, f"tier {rt.tier}")
            return response
        canary = rt.canary
        if canary is not None and dest == "primary":
            # A gray release: the request's bucket picks its arm; a candidate
            # failure before the first byte is then retried on the primary.
            # (Idle, it costs three attribute reads: `routing` and `mirroring`
            # are set when the rollout's state changes, not computed here.)
            ro = canary.rollout
            if ro.routing:
                if canary.wants_candidate(rec):
                    cand = rt.upstreams.get("candidate")
                    if cand is not None and cand.available:
                        candidates = [cand, *candidates]
            elif ro.mirroring and rec.endpoint == "chat":
                cand = rt.upstreams.get("candidate")
                if cand is not None and cand.available:
                    canary.maybe_mirror(rec, cand)
        result = await run_attempts(
            rec, inbox, candidates, passthrough=rec.endpoint == "passthrough"
        )
        unanswered = (
            result is None
            or result.kind == "failed"
            or (trial and result.kind in ("refused", "shed"))
        )
        if unanswered and rt.policy.ladder.maintenance.enabled:
            response, term = maintenance(rec, inbox, "no backend could answer")
            return response
        if result is None or result.kind == "failed":
            if result is None:
                response, term = proxy_error(
                    rec, 502, "no backend could be reached", "upstream_unreachable"
                )
            else:
                response, term = passed_error(rec, result)
            return response
        if result.answer is not None:
            await save_turn(rec, result.answer, inbox)
        assert result.response is not None
        term = terminal_of(result)
        return result.response
    except asyncio.CancelledError:
        # The client went away (aiohttp cancels the handler): no answer to
        # give, but the request still ends on the record.
        client = rec.client
        started = client is not None and client.prepared
        term = Terminal(rec.backend, 200 if started else 499, "client_disconnect")
        raise
    except Exception as exc:
        log.exception("request_failed", request_id=rec.rid, error=type(exc).__name__)
        response, term = await _internal_error(rec, exc)
        return response
    finally:
        rec.rt.inflight -= 1
        if term is not None:
            rec.candidate_fault = inbox.candidate_fault
            finish(rec, term, inbox)


async def _internal_error(
    rec: RequestRecord, exc: Exception
) -> tuple[web.StreamResponse, Terminal]:
    """An unexpected exception: an OpenAI error, in-band when the stream is under way."""
    message = f"internal error in the proxy ({type(exc).__name__})"
    client = rec.client
    if client is not None and client.prepared:
        if rec.endpoint == "passthrough" and not client.headers.get("Content-Type", "").startswith(
            "text/event-stream"
        ):
            # A body of unknown format under way: cut it rather than end it.
            transport = rec.request.transport
            if transport is not None:
                transport.close()
        else:
            with contextlib.suppress(
                ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError
            ):
                await client.write(error_events(message, "server_error", "internal_error"))
        term = Terminal(rec.backend, 200, "internal_error", message, stream_error="internal_error")
        return client, term
    response = error_response(
        500, message, type_="server_error", code="internal_error", headers=rec.headers(rec.backend)
    )
    return response, Terminal(rec.backend, 500, "internal_error", message)
