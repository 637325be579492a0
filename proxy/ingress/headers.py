"""Request headers towards a backend: what the forwarded bytes really are.

The proxy forwards a body that is not the one on the client's wire: aiohttp
has already undone a `Content-Encoding` (gzip, deflate, br, zstd) when the
handler reads it, and the pipeline may re-serialise it (model rewrite,
trimming, session history). So every header that describes the client's
bytes is dropped and the HTTP client computes its own; so are the hop-by-hop
headers (RFC 9110 §7.6.1), the ones the `Connection` header names, and
Brownout's own request headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from multidict import CIMultiDict

# Describe one connection, not the message.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "expect",
    }
)
# Describe the client's bytes, which are not the bytes forwarded.
_ENTITY = frozenset(
    {"content-length", "content-encoding", "content-md5", "digest", "content-digest"}
)
# Brownout's own request headers; the Accept-Encoding is set below.
_OWN = frozenset({"x-session-id", "x-priority", "x-request-id", "accept-encoding"})
DROPPED = _HOP_BY_HOP | _ENTITY | _OWN

# The codings aiohttp's server undoes on read (a single value, any case).
_DECODED = frozenset({"gzip", "deflate", "br", "zstd"})

BodyCoding = Literal["identity", "decoded", "unsupported"]


def body_coding(content_encoding: str | None) -> BodyCoding:
    """What reading the body gives: the bytes as sent (`identity`), the bytes
    aiohttp decoded, or bytes in a coding nothing here undoes (refuse: 415)."""
    if content_encoding is None:
        return "identity"
    value = content_encoding.strip().lower()
    if value in ("", "identity"):
        return "identity"
    return "decoded" if value in _DECODED else "unsupported"


def forward_headers(
    incoming: Mapping[str, str], request_id: str, authorization: str | None = None
) -> CIMultiDict[str]:
    """The headers to send a backend along with the body the proxy forwards.
    `authorization` replaces the client's (a backend's own `api_key`)."""
    named = incoming.get("Connection")
    drop = DROPPED
    if named:
        drop = drop | {t.strip().lower() for t in named.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in incoming.items():
        if k.lower() not in drop:
            out.add(k, v)
    out["X-Request-Id"] = request_id
    # Relayed bytes are parsed (SSE) or passed through verbatim: no compression.
    out["Accept-Encoding"] = "identity"
    if authorization is not None:
        out["Authorization"] = authorization
    return out
