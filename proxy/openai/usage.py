"""Token usage on the wire: asking a backend for it, finding it, reading it.

Counting tokens needs the answer's `usage`. A JSON answer carries it; a
stream carries it only when the request says `stream_options.include_usage`,
and then as one extra chunk, the last data event before `[DONE]`, with an
empty `choices` list. Brownout asks a backend for it on every stream
(`backends.<name>.stream_usage`) and, when the client did not ask, removes
that one chunk before the client sees it: the client's bytes are those it
would have got without the question.

On the relay's hot path nothing here parses JSON: the usage chunk is
recognised by where it is (the region's last event, or the one before a
trailing `[DONE]`) and how it ends (`}}`: the `usage` object closes the
chunk in vLLM's and the fallback server's layout, while a content chunk
ends with its `choices` list, `]}`) — one byte read per region; then, once
per stream, a few bounded byte searches find it and two small regexes read
its counts.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, Literal, NamedTuple

from proxy.openai.sse import DONE_EVENT

# An empty choices list followed by the usage object: compact, and as
# Python's json.dumps spaces it.
_MARKERS: Final = (b'"choices":[],"usage":{', b'"choices": [], "usage": {')
_PROMPT: Final = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION: Final = re.compile(rb'"completion_tokens":\s*(\d+)')
_ASK: Final = b',"stream_options":{"include_usage":true}'

_DECODER: Final = json.JSONDecoder()

UsagePlan = Literal["client", "ask", "no"]


class Usage(NamedTuple):
    prompt: int
    completion: int


def usage_plan(body: dict[str, Any]) -> UsagePlan:
    """What a streaming request says about usage: the client asked for the
    usage chunk ("client": it gets it, as the backend sent it); it did not
    ("ask": Brownout may ask and strip it); or asking would change the other
    chunks ("no": `continuous_usage_stats` without `include_usage` — vLLM
    would put usage in every chunk once `include_usage` is set)."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict):
        return "ask"
    if opts.get("include_usage") is True:
        return "client"
    if opts.get("continuous_usage_stats"):
        return "no"
    return "ask"


def ask_for_usage(payload: bytes, body: dict[str, Any]) -> bytes:
    """`payload` (the JSON object `body`, as bytes) with
    `stream_options.include_usage: true` — spliced in before the closing
    brace when the body has no `stream_options`, re-serialised otherwise."""
    if "stream_options" not in body:
        end = payload.rfind(b"}")
        if end > 0 and body:
            return payload[:end] + _ASK + payload[end:]
    opts = body.get("stream_options")
    merged = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return json.dumps({**body, "stream_options": merged}).encode()


def find_usage(region: bytes) -> tuple[int, int, Usage | None] | None:
    """The usage chunk of `region` (whole events, LF line ends): its span and
    counts, when its last event — or the one before a trailing `[DONE]` — is
    a `data:` event whose empty `choices` list is followed by its `usage`
    object (vLLM's, the fallback server's and OpenAI's layout). The
    relay calls it only for a region whose fourth byte from the end is `}`
    or `E` (the ends of `}}\n\n` and `[DONE]\n\n`). Byte searches bounded to
    that event, two small regexes for the counts; no copy, no JSON."""
    end = len(region)
    if region.endswith(DONE_EVENT):
        end -= len(DONE_EVENT)
    if not region.endswith(b"\n\n", 0, end):
        return None
    before = region.rfind(b"\n\n", 0, end - 2)
    start = before + 2 if before >= 0 else 0
    if not region.startswith(b"data:", start):
        return None
    at = region.find(_MARKERS[0], start, end)
    if at < 0:
        at = region.find(_MARKERS[1], start, end)
        if at < 0:
            return None
    p = _PROMPT.search(region, at, end)
    c = _COMPLETION.search(region, at, end)
    usage = Usage(int(p[1]), int(c[1])) if p is not None and c is not None else None
    return start, end, usage


def usage_of_body(body: bytes) -> Usage | None:
    """The counts of a JSON answer's `usage`, without parsing the whole body:
    the last `"usage":` key (vLLM, the fallback server and OpenAI put it after
    `choices`) and its object, decoded alone."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    colon = body.find(b":", at + 7, at + 16)
    if colon < 0:
        return None
    brace = body.find(b"{", colon, colon + 8)
    if brace < 0:
        return None
    try:
        obj, _ = _DECODER.raw_decode(body[brace : brace + 4096].decode(errors="replace"))
    except (ValueError, RecursionError):
        return None
    return _counts(obj)


def _counts(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(p) is not int or type(c) is not int or p < 0 or c < 0:
        return None
    return Usage(p, c)
