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

# `X-Brownout-Dropped`: the names of the fields dropped for a backend.
DROPPED_HEADER = "X-Brownout-Dropped"
# The longest value the header gets (nginx's default proxy_buffer_size, 4 KiB
# on most platforms, holds every response header together).
MAX_DROPPED_CHARS = 1024
# Shown as is: visible ASCII but the list separator.
_VISIBLE = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}
# Kept inside an escaped name (its `%` is escaped too).
_NAME_SAFE = _VISIBLE - {"%"}
_MORE_RESERVE = len(",(+999999999 more)")


def header_name(name: str) -> str:
    """A field name as a header list element: as is when it is visible ASCII
    without a comma (every name the ingress lets through); otherwise (CR,
    LF, NUL, space, comma, non-ASCII, a lone surrogate) percent-encoded as
    its UTF-8 bytes, `%` included; an empty name is `""`. The ingress refuses
    such names in a body (`proxy.ingress.validate`); this keeps a name from
    elsewhere (a policy's `drop_params`) from ever breaking the response head."""
    if not name:
        return '""'
    if all(c in _VISIBLE for c in name):
        return name
    out: list[str] = []
    for c in name:
        if c in _NAME_SAFE:
            out.append(c)
        else:
            out.extend(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
    return "".join(out)


def dropped_value(names: list[str]) -> str:
    """The `X-Brownout-Dropped` value: the names, comma-separated, at most
    `MAX_DROPPED_CHARS` long; names that do not fit are counted in a last
    element `(+N more)` (not a valid field name, so never mistaken for one)."""
    out: list[str] = []
    size = 0
    for i, name in enumerate(names):
        item = header_name(name)
        add = len(item) + (1 if out else 0)
        room = MAX_DROPPED_CHARS - (0 if i == len(names) - 1 else _MORE_RESERVE)
        if size + add > room:
            out.append(f"(+{len(names) - i} more)")
            break
        out.append(item)
        size += add
    return ",".join(out)
