"""The response headers of an OpenAI stream (SSE), once.

`X-Accel-Buffering: no` turns nginx's buffering off for this response (nginx
consumes the header); `Cache-Control: no-cache` keeps caches and proxies from
holding events back.
"""

from __future__ import annotations

from types import MappingProxyType

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"

# What every stream carries besides its Content-Type (an upstream's own
# `text/event-stream...` Content-Type is relayed as is).
STREAM_HEADERS = MappingProxyType({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

# A stream's full header set, for streams Brownout writes itself.
SSE_HEADERS = MappingProxyType({"Content-Type": SSE_CONTENT_TYPE, **STREAM_HEADERS})

# Headers that only make sense on a stream (removed when a stream turns into a
# JSON error answer before its first byte).
STREAM_ONLY = frozenset(k.lower() for k in SSE_HEADERS)
