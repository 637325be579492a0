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

from proxy.openai.chunkrun import Run
from proxy.openai.chunks import CONTENT_RE, TEXT_RE
from proxy.openai.sse import DONE, SSEParser

# The C scanner behind json.loads for one string literal (not in typeshed).
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def choices_requested(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


_INDEX0 = b'"choices":[{"index":0,'
_INDEX0_SPACED = b'"choices": [{"index": 0, '


def partial_text(
    regions: Sequence[bytes], endpoint: str, runs: Sequence[Run | None] | None = None
) -> tuple[str, int]:
    """Choice 0's text forwarded so far and its number of content chunks
    (≈ tokens: vLLM and the fallback send one token per chunk).

    `runs` (the relay's, one per region: `StreamResult.runs`): the text of a
    region's run of text chunks is its literals, already cut out by the relay
    (`proxy.openai.chunkrun`); only the events around the runs are searched.

    Fast path (a whole 1,024-chunk answer in well under a millisecond): when
    every event is a single-choice chunk of index 0, the content literals are
    cut out with one regex and decoded at once; anything else is parsed event
    by event.
    """
    if runs is not None and len(runs) == len(regions):
        found = _literals_with_runs(regions, runs, endpoint == "chat")
        if found is not None:
            return _decoded(*found) or _partial_text_slow(b"".join(regions), endpoint)
    blob = b"".join(regions)
    k = blob.count(_INDEX0) or blob.count(_INDEX0_SPACED)
    if k and blob.count(b'"index":') == k:
        literals = (CONTENT_RE if endpoint == "chat" else TEXT_RE).findall(blob)
        decoded = _decoded(b"".join(literals), len(literals) - literals.count(b""))
        if decoded is not None:
            return decoded
    return _partial_text_slow(blob, endpoint)


def _decoded(raw: bytes, chunks: int) -> tuple[str, int] | None:
    """The text of raw JSON string contents (escapes kept), None if invalid."""
    try:
        text = raw.decode() if b"\\" not in raw else _scanstring(raw.decode() + '"', 0)[0]
    except ValueError:
        return None
    return text, chunks


def _spans(region: bytes, run: Run | None) -> tuple[tuple[int, int], ...]:
    """The parts of `region` around its run (the whole region without one)."""
    if run is None:
        return ((0, len(region)),)
    return ((0, run.start), (run.end, len(region)))


def _literals_with_runs(
    regions: Sequence[bytes], runs: Sequence[Run | None], chat: bool
) -> tuple[bytes, int] | None:
    """Choice 0's raw literals and non-empty chunks, as the fast path finds
    them, with each run read from its literals and only the events around
    the runs searched. None: no run to use, a run of the other endpoint's
    field, or an event around them that is not a single-choice chunk of index 0."""
    if all(run is None for run in runs):
        return None
    pattern = CONTENT_RE if chat else TEXT_RE
    parts: list[bytes] = []
    chunks = 0
    for region, run in zip(regions, runs, strict=True):
        if run is not None and run.chat != chat:
            return None
        for i, (start, end) in enumerate(_spans(region, run)):
            if i == 1:  # between the two spans: the run
                assert run is not None
                parts.append(run.raw)
                chunks += run.events - run.empties
            if start == end:
                continue
            k = region.count(_INDEX0, start, end) or region.count(_INDEX0_SPACED, start, end)
            if region.count(b'"index":', start, end) != k:
                return None
            literals = pattern.findall(region, start, end)
            parts.append(b"".join(literals))
            chunks += len(literals) - literals.count(b"")
    return b"".join(parts), chunks


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


def streamed_answer(
    regions: Sequence[bytes] | None, endpoint: str, runs: Sequence[Run | None] | None = None
) -> str | None:
    """Choice 0's full text of a finished stream, or None when it did not finish.
    `runs`: as for `partial_text`."""
    if not regions:
        return None
    if runs is None or len(runs) != len(regions):
        runs = [None] * len(regions)
    # Regions are whole events: the finish is in one of the last (never in a
    # run of text chunks: theirs are all `"finish_reason":null`).
    if not any(
        region.find(b'"finish_reason":"', start, end) >= 0
        or region.find(b'"finish_reason": "', start, end) >= 0
        for region, run in zip(regions[-3:], runs[-3:], strict=True)
        for start, end in _spans(region, run)
    ):
        return None
    return partial_text(regions, endpoint, runs)[0]


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
