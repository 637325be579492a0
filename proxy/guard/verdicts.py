"""What the guard answers: the trip of a rule, the verdict on a region, the
in-band error event that ends a stopped stream, and the small helpers that read
a chunk's choices and phrase a trip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from proxy.openai.sse import error_events

RuleName = Literal[
    "control_chars", "replacement_chars", "special_tokens", "repetition", "malformed"
]

EXCERPT: Final = 40
"""The longest `Trip.excerpt`."""


@dataclass(frozen=True, slots=True)
class Trip:
    """A rule fired. `message` is for the client; `excerpt` (≤ 40 chars) for logs."""

    rule: RuleName
    message: str
    excerpt: str
    # Whole events of the region before the offending one: valid, to forward.
    prefix: bytes = b""


GuardVerdict: TypeAlias = bytes | Trip
"""`feed`'s answer: the region itself (unchanged), a new region, or a Trip."""


def invalid_output_event(trip: Trip) -> bytes:
    """The in-band error event (then `[DONE]`) that ends a stream the guard stopped."""
    return error_events(trip.message, "server_error", "invalid_output")


# --------------------------------------------------------------------------- helpers

ERROR_OBJECT: Final = "error object"
NOT_JSON: Final = object()


def choice_texts(obj: Any) -> list[tuple[int, str]] | str:
    """(choice index, text) of a chunk or body, or why it is not one.

    Text is `delta.content` / `message.content` (chat) or `text` (completions).
    """
    if obj is NOT_JSON:
        return "not JSON"
    if not isinstance(obj, dict):
        return "not a JSON object"
    if "error" in obj:
        return ERROR_OBJECT
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return "no choices list"
    out: list[tuple[int, str]] = []
    for ch in choices:
        if not isinstance(ch, dict):
            return "a choice is not an object"
        index = ch.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return "a choice has a bad index"
        holder = ch.get("delta")
        if holder is None:
            holder = ch.get("message")
        if holder is None:
            text = ch.get("text")
        elif isinstance(holder, dict):
            text = holder.get("content")
        else:
            return "a choice's delta is not an object"
        if isinstance(text, str):
            out.append((index, text))
        elif text is not None:
            return "a choice's text is not a string"
    return out


def malformed_trip(reason: str, data: bytes, dropped: bool = False) -> Trip:
    message = (
        "The backend sent a malformed event; it was dropped."
        if dropped
        else "The backend sent a malformed answer, so it was stopped."
    )
    return Trip("malformed", message, f"{reason}: {data[:16]!r}"[:EXCERPT])


def excerpt_around(text: str, start: int, end: int) -> str:
    """repr of text[start:end] with a few characters either side, ≤ 40 chars."""
    r = repr(text[max(0, start - 6) : end + 6])
    return r if len(r) <= EXCERPT else r[: EXCERPT - 1] + "…"
