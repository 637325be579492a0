"""The session steps: history in before routing, the finished turn out after.

A turn is saved only for a finished answer (choice 0's text; never after an
error, a guard trip or a client that left), before the client sees the end of
the stream, so the next turn finds this one.

A new session of a client that holds `sessions.max_sessions_per_client` live
sessions already is refused before routing: 429 `session_limit` with
`Retry-After` (when its oldest session expires). The client's existing
sessions, and its requests without `X-Session-Id`, go on working.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from proxy.errors import error_response
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import RequestRecord, Terminal
from proxy.sessions.conversation import make_turn, merge_history
from proxy.sessions.store import SessionLimitReached, SessionStoreUnavailable

log = structlog.get_logger("brownout.request")


async def load_history(rec: RequestRecord, inbox: Inbox) -> tuple[web.Response, Terminal] | None:
    """Merges the stored history into the request; the 429 to answer instead
    when the request would open a session past its client's cap."""
    ctx = rec.session
    if ctx is None:
        return None
    try:
        history = await rec.rt.store.load(ctx.key, ctx.client)
    except SessionLimitReached as exc:
        inbox.session_op("load", "limit")
        log.warning("session_limit", request_id=rec.rid, limit=exc.limit)
        return session_limit(rec, exc)
    except SessionStoreUnavailable as exc:
        ctx.status = "unavailable"
        inbox.session_op("load", "unavailable")
        log.warning("session_store_unavailable", request_id=rec.rid, op="load", error=str(exc))
        return None
    inbox.session_op("load", "ok")
    # Turns that wait for the store (it refuses writes but serves reads) are
    # this session's latest: the conversation keeps them.
    waiting = rec.rt.pending_saves.waiting(ctx.key)
    if waiting:
        history = [*history, *(m for t in waiting for m in t.messages())]
        history = history[-2 * rec.rt.policy.sessions.max_turns :]
    ctx.history_messages = len(history)
    if history:
        rec.body = merge_history(rec.body, history)
        rec.body_changed = True
    return None


def session_limit(rec: RequestRecord, exc: SessionLimitReached) -> tuple[web.Response, Terminal]:
    assert rec.session is not None
    rec.session.status = "limit"
    headers = rec.headers("none")
    headers["Retry-After"] = str(exc.retry_after_s)
    message = (
        f"this client holds {exc.limit} chat sessions already (sessions.max_sessions_per_client); "
        "continue one of them, send the conversation without X-Session-Id, "
        "or retry when one expires"
    )
    response = error_response(
        429,
        message,
        type_="invalid_request_error",
        code="session_limit",
        param="X-Session-Id",
        headers=headers,
    )
    return response, Terminal("none", 429, "rejected", message, bad_request="session_limit")


async def save_turn(rec: RequestRecord, assistant: str | None, inbox: Inbox) -> None:
    ctx = rec.session
    if ctx is None or ctx.status == "unavailable" or assistant is None:
        return
    rt = rec.rt
    # A store outage queues the turn (in order) instead of losing it.
    turn = make_turn(ctx, assistant, rt.turn_ids.next())
    saved = await rt.pending_saves.save(rt.store, ctx.key, turn, ctx.client)
    if saved:
        ctx.saved = True
        inbox.session_op("save", "ok")
    elif saved is None:  # a new session past its client's cap (a race with the load's check)
        inbox.session_op("save", "limit")
    else:
        inbox.session_op("save", "queued")
        log.warning("session_save_queued", request_id=rec.rid, waiting=len(rt.pending_saves))
