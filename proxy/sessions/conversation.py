"""Sessions in the request flow: merge stored history, fit the window, save turns.

The client sends `X-Session-Id` and only its new message (and optionally its
own system prompt). The proxy prepends the stored history, trims the result
to the chosen backend's context window, and after a *finished* answer
(`finish_reason` seen — not on errors, not on a client that left, not on a
guard trip) appends the user's message and the assistant's full text as one
turn.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from proxy.sessions.store import Turn

# A generous upper bound of template tokens per message (role markers,
# separators): used only to decide that counting is unnecessary.
_TEMPLATE_TOKENS_PER_MESSAGE = 16


@dataclass
class SessionContext:
    key: str
    user_text: str
    status: str = "used"  # value of the X-Brownout-Session header
    # Whose sessions this one counts with (`client_key`): the cap of
    # `sessions.max_sessions_per_client`. None: no cap.
    client: str | None = None
    history_messages: int = 0
    saved: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def merge_history(body: dict[str, Any], history: list[dict[str, str]]) -> dict[str, Any]:
    """The client's system prompt(s) first, then the history, then its new messages."""
    messages = body["messages"]
    head = [m for m in messages if m.get("role") in ("system", "developer")]
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    return {**body, "messages": [*head, *history, *rest]}


def answer_from_body(body: bytes) -> str | None:
    """The assistant text of a finished non-streaming chat answer."""
    try:
        obj = json.loads(body)
        choice = obj["choices"][0]
        if not choice.get("finish_reason"):
            return None
        content = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return content if isinstance(content, str) else None


def surely_fits(messages: list[dict[str, Any]], budget: int) -> bool:
    """A cheap upper bound: no tokenizer makes more tokens than UTF-8 bytes,
    plus the template's per-message overhead. When even that fits, counting
    (a /tokenize round trip or a tokenizer call) is skipped."""
    total = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            total += len(c.encode("utf-8", "surrogatepass"))
        elif c is not None:
            total += len(json.dumps(c).encode())
        total += _TEMPLATE_TOKENS_PER_MESSAGE
        if total > budget:
            return False
    return True


class TurnIds:
    """Unique turn ids without a urandom call per answer: a random prefix per
    instance, then a counter."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._count)}"


def make_turn(ctx: SessionContext, assistant: str, turn_id: str) -> Turn:
    # A fresh id per answer: a save retried after a timeout is stored once.
    return Turn(user=ctx.user_text, assistant=assistant, id=turn_id)
