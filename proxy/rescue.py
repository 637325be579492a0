"""Rescuing a stream that died mid-answer: what was said, and how to go on.

The relay keeps the regions it forwarded (bytes, no decoding on the hot
path); only when a stream actually fails are they decoded here to recover the
partial answer. The fallback then continues it: for chat, the partial text
becomes a final assistant message with `continue_final_message: true` and
`add_generation_prompt: false` (as vLLM and `brownout fallback-server`
accept); for completions, it is appended to the prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from proxy.sse import SSEParser

# The content string literals of chat chunks and of completions. Inside a JSON
# string every `"` is escaped, so `"content":"` only matches a real key.
_LITERAL = rb'\s*"([^"\\]*(?:\\.[^"\\]*)*)"'
_CONTENT_RE = re.compile(rb'"content":' + _LITERAL)
_TEXT_RE = re.compile(rb'"text":' + _LITERAL)
# The C scanner behind json.loads for one string literal.
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def partial_text(regions: list[bytes], endpoint: str) -> tuple[str, int]:
    """The answer text forwarded so far and the number of content chunks
    (≈ tokens: vLLM and the fallback send one token per chunk).

    Fast path (a whole 1,024-chunk answer in well under a millisecond): when
    every event is a single-choice chunk, the content literals are cut out
    with one regex and decoded at once; anything else is parsed event by event.
    """
    blob = b"".join(regions)
    k = blob.count(b'"choices":[{"index":0,') or blob.count(b'"choices": [{"index": 0, ')
    if k and blob.count(b'"index":') == k:
        literals = (_CONTENT_RE if endpoint == "chat" else _TEXT_RE).findall(blob)
        raw = b"".join(literals)
        try:
            text = raw.decode() if b"\\" not in raw else _scanstring(raw.decode() + '"', 0)[0]
        except ValueError:
            pass
        else:
            return text, sum(1 for lit in literals if lit)
    return _partial_text_slow(regions, endpoint)


def _partial_text_slow(regions: list[bytes], endpoint: str) -> tuple[str, int]:
    parser = SSEParser()
    parts: list[str] = []
    chunks = 0
    for region in regions:
        for ev in parser.feed(region):
            if ev.data is None or ev.data == b"[DONE]":
                continue
            try:
                obj = json.loads(ev.data)
                choice = obj["choices"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if not isinstance(choice, dict):
                continue
            if endpoint == "chat":
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                parts.append(text)
                chunks += 1
    return "".join(parts), chunks


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
