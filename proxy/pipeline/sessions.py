"""The session steps: history in before routing, the finished turn out after.

A turn is saved only for a finished answer (choice 0's text; never after an
error, a guard trip or a client that left), before the client sees the end of
the stream, so the next turn finds this one.
"""

from __future__ import annotations

import structlog

from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import RequestRecord
from proxy.sessions.conversation import make_turn, merge_history
from proxy.sessions.store import SessionStoreUnavailable

log = structlog.get_logger("brownout.request")


async def load_history(rec: RequestRecord, inbox: Inbox) -> None:
    ctx = rec.session
    if ctx is None:
        return
    try:
        history = await rec.rt.store.load(ctx.key)
    except SessionStoreUnavailable as exc:
        ctx.status = "unavailable"
        inbox.session_op("load", "unavailable")
        log.warning("session_store_unavailable", request_id=rec.rid, op="load", error=str(exc))
        return
    inbox.session_op("load", "ok")
    ctx.history_messages = len(history)
    if history:
        rec.body = merge_history(rec.body, history)
        rec.body_changed = True


async def save_turn(rec: RequestRecord, assistant: str | None, inbox: Inbox) -> None:
    ctx = rec.session
    if ctx is None or ctx.status == "unavailable" or assistant is None:
        return
    rt = rec.rt
    # A store outage queues the turn (in order) instead of losing it.
    turn = make_turn(ctx, assistant, rt.turn_ids.next())
    if await rt.pending_saves.save(rt.store, ctx.key, turn):
        ctx.saved = True
        inbox.session_op("save", "ok")
    else:
        inbox.session_op("save", "queued")
        log.warning("session_save_queued", request_id=rec.rid, waiting=len(rt.pending_saves))
