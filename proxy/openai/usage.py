"""Token usage on the wire: asking a backend for it, finding it, reading it.

Counting tokens needs the answer's `usage`. A JSON answer carries it; a
stream carries it only when the request says `stream_options.include_usage`,
and then as one extra chunk, the last data event before `[DONE]`, with an
empty `choices` list. Brownout asks a backend for it on every stream
(`backends.<name>.stream_usage`) and, when the client did not ask, removes
that one chunk before the client sees it: the client's bytes are those it
would have got without the question.

On the relay's hot path nothing here parses JSON per chunk: the usage chunk
is recognised by where it is (the region's last event, or the one before a
trailing `[DONE]`) and how it ends (`}}`: the `usage` object closes the
chunk in vLLM's and the fallback server's layout, while a content chunk
ends with its `choices` list, `]}`), two `endswith` tests per region; only
that one event is then decoded, once per stream.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal, NamedTuple

from proxy.openai.sse import DONE_EVENT

# The two ways a region can end when its usage chunk is there.
USAGE_TAILS: Final = (b"}}\n\n", DONE_EVENT)
_EMPTY_CHOICES: Final = (b'"choices":[]', b'"choices": []')
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


def usage_span(region: bytes) -> tuple[int, int] | None:
    """Where the usage chunk is in `region` (whole events, LF line ends):
    its last event, or the one before a trailing `[DONE]`, when that event
    has an empty `choices` list and a `usage` key. Call it only when
    `region.endswith(USAGE_TAILS)`."""
    end = len(region)
    if region.endswith(DONE_EVENT):
        end -= len(DONE_EVENT)
        if end < 2 or region[end - 2 : end] != b"\n\n":
            return None
    before = region.rfind(b"\n\n", 0, end - 2)
    start = before + 2 if before >= 0 else 0
    if not region.startswith(b"data:", start):
        return None
    event = region[start:end]
    if not event.endswith(b"}}\n\n") or b'"usage"' not in event:
        return None
    if _EMPTY_CHOICES[0] not in event and _EMPTY_CHOICES[1] not in event:
        return None
    return start, end


def parse_usage_event(event: bytes) -> Usage | None:
    """The counts of a usage chunk (`data: {...}`), or None if it has none
    (its `usage` object decoded alone: half the cost of the whole chunk)."""
    return usage_of_body(event)


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
