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
from typing import Any

from proxy.sse import SSEParser


def partial_text(regions: list[bytes], endpoint: str) -> tuple[str, int]:
    """The answer text forwarded so far and the number of content chunks
    (≈ tokens: vLLM and the fallback send one token per chunk)."""
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
