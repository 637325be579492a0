"""Validation of OpenAI request bodies before anything goes upstream.

Only what the proxy relies on is checked (shape, types of the fields it
reads); everything else is the backend's business and passes untouched.

Field names are the exception: a name the proxy may echo in a response
header (`X-Brownout-Dropped` names the fields dropped for a backend that
does not honour them) must be an HTTP token (RFC 9110 §5.6.2: ASCII
letters, digits and ``!#$%&'*+-.^_`|~``), 1 to 128 characters. That holds
for every top-level key of the body and for the `type` of each content part
(`messages[].content[type=X]` is such a name). Anything else (CR, LF, NUL,
a space, a comma, non-ASCII, a 1 MB name) is a 400 `invalid_field_name`
naming the field, JSON-escaped, with `param` set: no real OpenAI or vLLM
parameter is outside that set.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, NamedTuple

import orjson

from proxy.errors import RequestRejected

Endpoint = Literal["chat", "completions"]

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})

# An HTTP token (RFC 9110 §5.6.2 tchar), 1-128 characters: safe in a header
# value and in a comma-separated list of names.
MAX_FIELD_NAME = 128
_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1," + str(MAX_FIELD_NAME) + r"}\Z")
# How much of a bad name the error echoes (escaped).
_SHOWN = 64
# The OpenAI and vLLM request fields a body usually has: all tokens, so a
# set lookup spares the regex (~2,700 instructions a key) for them.
_KNOWN_FIELDS = frozenset(
    {
        "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
        "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
        "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "suffix", "echo",
        "best_of", "top_k", "min_p", "repetition_penalty", "metadata", "store",
        "reasoning_effort", "modalities", "service_tier", "ignore_eos", "min_tokens",
    }
)  # fmt: skip
# isinstance() with these tuples: `int | float` builds a union object per call.
_NUMBER = (int, float)
_KNOWN_PARTS = frozenset({"text", "image_url", "input_audio", "file", "refusal", "video_url"})
_CONTENT = (str, list)


class ParsedRequest(NamedTuple):  # one per request: a tuple is made at C speed
    body: dict[str, Any]
    stream: bool


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> RequestRejected:
    return RequestRejected(400, message, code, param)


def is_field_token(name: str) -> bool:
    """A field name the proxy may echo in a response header."""
    return _TOKEN_RE.match(name) is not None


def _bad_name(name: str, noun: str, param: str) -> RequestRejected:
    shown = name if len(name) <= _SHOWN else name[:_SHOWN] + "..."
    # ASCII-escaped (`"a\r\nb"`, `"\u00e9"`): the message is safe to read
    # in any log or terminal; `param` names the field as sent (JSON escapes
    # it), cut to the longest valid name.
    return RequestRejected(
        400,
        f"{json.dumps(shown)} is not a valid {noun}: {noun}s are 1-{MAX_FIELD_NAME} "
        "characters of ASCII letters, digits and !#$%&'*+-.^_`|~",
        "invalid_field_name",
        param[:MAX_FIELD_NAME],
    )


def check_field_names(body: dict[str, Any]) -> None:
    """Every top-level key of a request body is a token (see the module doc)."""
    for key in body:
        if key not in _KNOWN_FIELDS and _TOKEN_RE.match(key) is None:
            raise _bad_name(key, "field name", key)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from a request body, or RequestRejected (400) that says why.

    orjson keeps this total: nesting deeper than 1,024 levels, numbers beyond
    a double (a 5,000-digit integer), invalid UTF-8 and lone surrogate escapes
    (`"\\ud800"`, which no encoder downstream — Redis saves, log lines,
    maintenance answers — can write back) are all refused here, as JSON
    errors with their position, never raised further."""
    if not raw:
        raise _bad("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "UTF-8" in exc.msg:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as ude:
                raise _bad(
                    f"request body is not valid UTF-8 (byte {ude.start})", code="invalid_encoding"
                ) from None
        hint = (
            " (a lone UTF-16 surrogate escape such as \\ud800 is no character)"
            if "surrogate" in exc.msg
            else ""
        )
        raise _bad(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}{hint}",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", code="invalid_json")
    return body


def parse_body(raw: bytes, endpoint: Endpoint) -> ParsedRequest:
    """Decode and check a request body; raise RequestRejected with a clear reason."""
    body = parse_json_object(raw)
    check_field_names(body)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise _bad(f"'{key}' must be a non-negative integer", key, "invalid_type")
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None and (not isinstance(v, _NUMBER) or isinstance(v, bool)):
            raise _bad(f"'{key}' must be a number", key, "invalid_type")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")

    if endpoint == "chat":
        _check_messages(body)
    else:
        _check_prompt(body)
    return ParsedRequest(body, stream)


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    # `where` (the message's name in an error) is only made for an error.
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            where = f"messages[{i}]"
            raise _bad(f"'{where}' must be an object", where, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            where = f"messages[{i}]"
            raise _bad(
                f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}",
                f"{where}.role",
                "invalid_type",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, _CONTENT):
            where = f"messages[{i}]"
            raise _bad(
                f"'{where}.content' must be a string or a list of parts",
                f"{where}.content",
                "invalid_type",
            )
        if isinstance(content, list):
            _check_parts(content, i)


def _check_parts(parts: list[Any], i: int) -> None:
    """Content parts (of `messages[i]`): objects; a `type`, when given, is a
    string; a `text`, when given, is a string (the proxy reads it: sessions,
    FAQ matching)."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            at = f"messages[{i}].content[{j}]"
            raise _bad(f"'{at}' must be an object", at, "invalid_type")
        kind = part.get("type", "text")
        if not isinstance(kind, str):
            at = f"messages[{i}].content[{j}]"
            raise _bad(f"'{at}.type' must be a string", f"{at}.type", "invalid_type")
        if kind not in _KNOWN_PARTS and _TOKEN_RE.match(kind) is None:
            raise _bad_name(kind, "content part type", f"messages[{i}].content[{j}].type")
        if "text" in part and not isinstance(part["text"], str):
            at = f"messages[{i}].content[{j}]"
            raise _bad(f"'{at}.text' must be a string", f"{at}.text", "invalid_type")


def _check_prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is required", "prompt", "missing_field")
    if not isinstance(prompt, _CONTENT):
        raise _bad("'prompt' must be a string or a list", "prompt", "invalid_type")
