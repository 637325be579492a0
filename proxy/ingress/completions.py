"""Chat and completion requests, from the routed request to the pipeline.

The middlewares have already set the request id (and the log context),
checked the path and the client's key. Here: the body (size, time, coding),
its parse, the request's priority and its session context — then the
pipeline (`proxy.pipeline.serve`).
Anything refused here raises `RequestRejected`; the error middleware answers
it, counts it and logs it.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from proxy.errors import RequestRejected
from proxy.ingress.body import read_body
from proxy.ingress.context import REQUEST_ID, STARTED_AT
from proxy.ingress.identity import client_identity
from proxy.ingress.validate import Endpoint, parse_body
from proxy.openai.auth import bearer_token
from proxy.openai.messages import last_user_text
from proxy.pipeline import RequestRecord, serve
from proxy.runtime.generation import Runtime
from proxy.runtime.keys import STATE
from proxy.sessions.conversation import SessionContext
from proxy.sessions.store import SessionIdError, client_key, session_key

log = structlog.get_logger("brownout.request")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(await completion_record(request, "chat"))


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(await completion_record(request, "completions"))


async def completion_record(request: web.Request, endpoint: Endpoint) -> RequestRecord:
    """The request's record, once its body is read and checked. (Returned,
    not passed on: the pipeline runs one frame less deep, and every
    suspension of a stream resumes each frame on the way down.)"""
    rt = request.app[STATE].current
    server = rt.policy.server
    raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
    parsed = parse_body(raw, endpoint)
    if server.log_prompts:
        # Opt-in only: prompts can hold personal data. (The parse refused lone
        # surrogates, so every string here can be written as JSON.)
        log.info("prompt", messages=parsed.body.get("messages"), prompt=parsed.body.get("prompt"))
    api_key = bearer_token(request.headers.get("Authorization"))
    priority = rt.priority_for(request.headers.get("X-Priority"), api_key)
    sid = request.headers.get("X-Session-Id")
    session = (
        session_context(
            rt,
            sid,
            api_key,
            parsed.body,
            endpoint,
            request.remote,
            request.headers.get("X-Forwarded-For"),
        )
        if sid is not None
        else None
    )
    return RequestRecord(
        request,
        rt,
        endpoint,
        raw,
        parsed.body,
        parsed.stream,
        request[REQUEST_ID],
        request[STARTED_AT],
        priority,
        session,
    )


def session_context(
    rt: Runtime,
    sid: str,
    api_key: str | None,
    body: dict[str, Any],
    endpoint: Endpoint,
    peer: str | None = None,
    forwarded_for: str | None = None,
) -> SessionContext:
    """The session a request belongs to, or the RequestRejected that says why it can't."""
    if endpoint != "chat":
        raise RequestRejected(
            400,
            "X-Session-Id is only supported on /v1/chat/completions",
            "invalid_session",
            "X-Session-Id",
        )
    try:
        # With client keys configured, the key scopes the session.
        key = session_key(rt.policy.sessions.key_prefix, sid, api_key)
    except SessionIdError as exc:
        raise RequestRejected(400, str(exc), "invalid_session_id", "X-Session-Id") from None
    text = last_user_text(body)
    if text is None:
        raise RequestRejected(
            400,
            "a session request must contain a user message with text (the new question)",
            "invalid_session",
            "messages",
        )
    return SessionContext(
        key=key, user_text=text, client=session_client(rt, api_key, peer, forwarded_for)
    )


def session_client(
    rt: Runtime, api_key: str | None, peer: str | None, forwarded_for: str | None = None
) -> str:
    """Whose sessions count together for `sessions.max_sessions_per_client`
    (`proxy.ingress.identity`)."""
    keyed = bool(rt.policy.server.api_keys)
    who = client_identity(peer, api_key, forwarded_for, keyed=keyed)
    return client_key(rt.policy.sessions.key_prefix, who)
