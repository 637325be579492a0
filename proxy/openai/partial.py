"""The answer a stream has said so far, and the request that continues it.

Rescue and sessions both need the text of forwarded chunks. It is extracted
once, at the end, from the kept regions (never per chunk). With `n > 1` the
choices' chunks interleave: only choice 0 (what OpenAI clients call *the*
answer) is extracted, so a session turn never mixes choices.

To continue, the partial text becomes a final assistant message with
`continue_final_message: true` and `add_generation_prompt: false` (as vLLM and
`brownout fallback-server` accept); for completions, it is appended to the
prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from proxy.openai.chunks import CONTENT_RE, TEXT_RE, has_finish_reason
from proxy.openai.sse import DONE, SSEParser

# The C scanner behind json.loads for one string literal (not in typeshed).
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def choices_requested(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def partial_text(regions: Sequence[bytes], endpoint: str) -> tuple[str, int]:
    """Choice 0's text forwarded so far and its number of content chunks
    (≈ tokens: vLLM and the fallback send one token per chunk).

    Fast path (a whole 1,024-chunk answer in well under a millisecond): when
    every event is a single-choice chunk of index 0, the content literals are
    cut out with one regex and decoded at once; anything else is parsed event
    by event.
    """
    blob = b"".join(regions)
    k = blob.count(b'"choices":[{"index":0,') or blob.count(b'"choices": [{"index": 0, ')
    if k and blob.count(b'"index":') == k:
        literals = (CONTENT_RE if endpoint == "chat" else TEXT_RE).findall(blob)
        raw = b"".join(literals)
        try:
            text = raw.decode() if b"\\" not in raw else _scanstring(raw.decode() + '"', 0)[0]
        except ValueError:
            pass
        else:
            return text, sum(1 for lit in literals if lit)
    return _partial_text_slow(blob, endpoint)


def _choice0(obj: Any) -> dict[str, Any] | None:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _partial_text_slow(blob: bytes, endpoint: str) -> tuple[str, int]:
    parser = SSEParser()
    parts: list[str] = []
    for ev in parser.feed(blob) + parser.flush():
        if ev.data is None or ev.data == DONE:
            continue
        try:
            choice = _choice0(json.loads(ev.data))
        except ValueError:
            continue
        if choice is None:
            continue
        if endpoint == "chat":
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            parts.append(text)
    return "".join(parts), len(parts)


def streamed_answer(regions: Sequence[bytes] | None, endpoint: str) -> str | None:
    """Choice 0's full text of a finished stream, or None when it did not finish."""
    if not regions or not has_finish_reason(b"".join(regions[-3:])):
        return None
    return partial_text(regions, endpoint)[0]


def answer_from_body(body: bytes) -> str | None:
    """Choice 0's text of a finished non-streaming chat answer, else None."""
    try:
        choice = _choice0(json.loads(body))
    except (ValueError, RecursionError):
        return None
    if choice is None or not choice.get("finish_reason"):
        return None
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def continuation_body(
    body: dict[str, Any], partial: str, produced: int, endpoint: str
) -> dict[str, Any]:
    """The request that makes a backend continue `partial` where it stopped."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = out.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            out[key] = max(1, v - produced)
    if not partial:
        return out  # nothing was said yet: the same request, afresh
    if endpoint == "chat":
        out["messages"] = [*body["messages"], {"role": "assistant", "content": partial}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            out["prompt"] = prompt + partial
    return out


#: The instruction of a prompt-level continuation (a fallback without prefill).
CONTINUE_INSTRUCTION = (
    "Your previous answer was cut off. Continue it exactly where it stopped, "
    "from the next character: do not repeat anything, do not start over, "
    "do not comment."
)


def prompt_continuation_body(body: dict[str, Any], partial: str, produced: int) -> dict[str, Any]:
    """A chat continuation without a prefill: the partial answer as the
    previous assistant turn, then a user turn asking to continue it."""
    out = continuation_body(body, "", produced, "chat")
    out.pop("continue_final_message", None)
    out.pop("add_generation_prompt", None)
    if partial:
        out["messages"] = [
            *body["messages"],
            {"role": "assistant", "content": partial},
            {"role": "user", "content": CONTINUE_INSTRUCTION},
        ]
    return out
