"""`Authorization: Bearer <key>`: parsing, and checking a key in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

_SCHEME = "bearer "


def bearer_token(authorization: str | None) -> str | None:
    """The key of a `Bearer` credential (scheme case-insensitive, RFC 9110
    §11.1); None when the header is absent, empty or of another scheme."""
    if not authorization or authorization[:7].lower() != _SCHEME:
        return None
    token = authorization[7:].strip()
    return token or None


def _raw(text: str) -> bytes:
    # aiohttp decodes header bytes that are not UTF-8 with `surrogateescape`:
    # this gives those exact bytes back instead of raising.
    return text.encode("utf-8", "surrogateescape")


def key_matches(token: str | None, keys: Iterable[str]) -> bool:
    """Whether `token` is one of `keys`. Every key is compared, each with
    `hmac.compare_digest`, so the time taken does not say which key (or which
    prefix of one) was close."""
    given = _raw(token or "")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, _raw(key))
    return found and bool(token)


def is_valid_utf8(value: str) -> bool:
    """False when a header value held bytes that are not UTF-8 (aiohttp keeps
    them as lone surrogates, which no encoder downstream accepts)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
