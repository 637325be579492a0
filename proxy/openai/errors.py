"""The OpenAI error object, and how a backend's error body becomes one.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

The OpenAI SDKs, vLLM and Brownout's fallback server all use this shape, so a
client handles the proxy's own errors and a backend's alike.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

JSON_CT = "application/json"

# The `type` OpenAI gives an error of each status (everything else 4xx,
# 401 and 404 included: invalid_request_error; 5xx: server_error).
_TYPES = MappingProxyType({429: "rate_limit_error"})

# The `code` for errors the HTTP layer raises (routing, limits).
HTTP_CODES = MappingProxyType(
    {
        400: "invalid_request",
        404: "unknown_url",
        405: "method_not_allowed",
        408: "request_timeout",
        413: "request_too_large",
        415: "unsupported_media_type",
        500: "internal_error",
    }
)


def error_type_for(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_object(
    message: str, type_: str, code: str | int | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    """The error object as bytes. Total: a lone surrogate in the message (an
    echoed header or path) is written as its JSON escape, never raises."""
    text = json.dumps(error_object(message, type_, code, param), ensure_ascii=False)
    # Surrogates only occur inside JSON strings, where `\\udXXX` is a valid escape.
    return text.encode("utf-8", "backslashreplace")


def is_error_object(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


def upstream_error_body(status: int, body: bytes) -> bytes:
    """The upstream's error body if it is already OpenAI-shaped, else a wrapped one."""
    try:
        if is_error_object(json.loads(body)):
            return body
    except (ValueError, RecursionError):
        pass
    text = body[:200].decode("utf-8", "replace").strip() or f"HTTP {status}"
    return error_body(f"backend error: {text}", "server_error", status)


def is_context_error(body: bytes) -> bool:
    """A backend's 400 saying the request does not fit its context window
    (OpenAI's code, vLLM's and the fallback server's wording)."""
    return b"context_length_exceeded" in body or b"maximum context length" in body
