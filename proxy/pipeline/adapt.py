"""The adapt step: the request body as one backend should get it.

Model name, parameters the policy drops removed, fields the backend does not
honour refused (or dropped by name, policy `drop`), `max_tokens` within its
window, messages trimmed to its window. Runs inside the attempt's deadline
(trimming may call the backend's `/tokenize`). Raises `RequestRejected` when
the request cannot fit any way (400 `context_length_exceeded`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy.backends.upstream import Upstream
from proxy.errors import RequestRejected
from proxy.openai.capabilities import without
from proxy.openai.usage import ask_for_usage, usage_plan
from proxy.pipeline.inbox import Inbox
from proxy.pipeline.record import RequestRecord
from proxy.sessions.conversation import surely_fits
from proxy.sessions.counters import EstimateTokenCounter, TokenCountError
from proxy.sessions.trim import ContextTooLong, TrimResult, budget_tokens, trim


async def adapted(
    rec: RequestRecord, up: Upstream, inbox: Inbox, deadline: float
) -> dict[str, Any]:
    cached = rec.adapted.get(up.name)
    if cached is not None:
        return cached
    body = rec.body
    out: dict[str, Any] | None = None
    model = up.policy.model
    if model is not None and body.get("model") != model:
        out = dict(body)
        out["model"] = model
    drop = [k for k in up.drop_params if k in body]
    if drop:
        out = dict(out or body)
        for k in drop:
            del out[k]
        rec.dropped[up.name] = drop
    caps = up.caps
    if caps is not None:
        missing = caps.unsupported(out or body, rec.chat)
        if missing:
            if rec.rt.policy.ladder.failover.unsupported_fields != "drop":
                raise unsupported_fields(up, missing)
            out = without(out or body, missing, caps.content_parts)
            rec.dropped[up.name] = [*drop, *missing]
    window = up.max_model_len
    if window:
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and v >= window:
                out = dict(out or body)
                out[key] = max(1, window // 2)
        if rec.chat:
            trimmed = await trimmed_messages(rec, up, out or body, window, inbox, deadline)
            if trimmed is not None:
                out = dict(out or body)
                out["messages"] = trimmed
    result = out if out is not None else body
    rec.adapted[up.name] = result
    return result


def unsupported_fields(up: Upstream, fields: list[str]) -> RequestRejected:
    """The explicit error for a request this backend would not fully honour
    (503: the request is valid, this backend cannot serve it as asked)."""
    names = ", ".join(fields)
    return RequestRejected(
        503,
        f"the {up.name} backend does not support {names}; the request was not sent "
        "rather than answered without them",
        "unsupported_fields",
        fields[0],
        type_="server_error",
    )


def asks_usage(rec: RequestRecord, up: Upstream) -> bool:
    """Whether Brownout asks `up` for this stream's usage chunk on its own
    behalf (and so removes it from the client's stream)."""
    return rec.stream and up.stream_usage and usage_plan(rec.body) == "ask"


async def payload_for(rec: RequestRecord, up: Upstream, inbox: Inbox, deadline: float) -> bytes:
    body = await adapted(rec, up, inbox, deadline)
    # Unchanged bodies go upstream as the client sent them (but for the
    # usage question of a stream, spliced in).
    unchanged = body is rec.body and not rec.body_changed
    payload = rec.raw if unchanged else json.dumps(body).encode()
    if asks_usage(rec, up):
        return ask_for_usage(payload, body)
    return payload


async def trimmed_messages(
    rec: RequestRecord,
    up: Upstream,
    body: dict[str, Any],
    window: int,
    inbox: Inbox,
    deadline: float,
) -> list[dict[str, Any]] | None:
    """Messages fitted to `window` (None: nothing to drop). Counting runs
    under `deadline` (TimeoutError past it)."""
    tp = rec.rt.policy.sessions.trimming
    if rec.session is None and not tp.trim_stateless:
        return None
    messages = body["messages"]
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    budget = budget_tokens(
        window,
        mt if isinstance(mt, int) else None,
        margin_tokens=tp.margin_tokens,
        default_max_tokens=tp.default_max_tokens,
    )
    if budget > 0 and surely_fits(messages, int(budget * tp.high_water)):
        return None  # the common case: no tokenizer call at all
    try:
        async with asyncio.timeout_at(deadline):
            res = await _trim(rec, up, messages, budget, inbox)
    except ContextTooLong as exc:
        answer = mt if isinstance(mt, int) else tp.default_max_tokens
        near = exc.estimated and exc.prompt_tokens < window
        if near or exc.prompt_tokens + answer <= window:
            # What cannot be dropped fits without our safety margin — or only
            # an estimate (on the large side: the backend could not count) of
            # prompt + answer says it does not, while the prompt alone fits:
            # send that (all history dropped) and let the backend judge; its
            # context error is routed like any other.
            if not exc.messages or len(exc.messages) == len(messages):
                return None
            inbox.trimmed(up, 0)
            return [dict(m) for m in exc.messages]
        raise RequestRejected(
            400,
            f"{exc} (backend {up.name}, max_model_len {window})",
            "context_length_exceeded",
            "messages",
        ) from None
    if not res.trimmed:
        return None
    inbox.trimmed(up, res.dropped_turns)
    return [dict(m) for m in res.messages]


async def _trim(
    rec: RequestRecord, up: Upstream, messages: list[dict[str, Any]], budget: int, inbox: Inbox
) -> TrimResult:
    """Trim with the backend's counter, or an estimate when it cannot count
    (ContextTooLong from either is the caller's)."""
    tp = rec.rt.policy.sessions.trimming
    counter = rec.rt.counter_for(up)
    try:
        res = await trim(
            messages, budget, counter, high_water=tp.high_water, low_water=tp.low_water
        )
    except TokenCountError as exc:
        # The backend cannot count: an estimate, which errs on the large side.
        inbox.token_estimate(up, str(exc))
        return await trim(
            messages,
            budget,
            EstimateTokenCounter(),
            high_water=tp.high_water,
            low_water=tp.low_water,
        )
    if res.estimated:
        inbox.token_estimate(up)
    return res
