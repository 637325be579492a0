"""OTLP/HTTP for Brownout's spans: the protobuf written by hand, posted with
the standard library (on the export thread).

The SDK's exporter builds a protobuf message object per span, per attribute
and per value, then serializes them: a few hundred microseconds of CPU for a
request's two spans, more than serving the request costs
(`bench/otel_ab.py`). The spans here are plain records with a dozen
attributes whose keys, and mostly their values, repeat from span to span, so
this writes `ExportTraceServiceRequest`'s wire format directly, each
attribute's encoded `KeyValue` looked up in a small cache. The output is
what the SDK's encoder writes for the same spans (checked against it in
tests/unit/test_otlp_encode.py).

Transport: one kept-alive `http.client` connection, `POST` of
`application/x-protobuf`, the policy's headers, `export_timeout_s` per socket
operation. No retries here: the export queue backs off after a failure
(`proxy.telemetry.tracing.BatchExport`) instead of re-sending on a timer.
"""

from __future__ import annotations

import http.client
import ssl
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from proxy import __version__

# Span.kind in OTLP's numbering (SPAN_KIND_SERVER, SPAN_KIND_CLIENT).
SERVER = 2
CLIENT = 3
_KIND = {SERVER: b"\x30\x02", CLIENT: b"\x30\x03"}
# Span.flags (field 16, fixed32): "has is_remote" and "is_remote", as the SDK sets them.
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)
_STATUS_UNSET = b"\x7a\x00"  # Span.status (15): an empty Status, code UNSET
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_SMALL = [bytes((i,)) for i in range(128)]
_CACHE_MAX = 8192


class SpanRecord(NamedTuple):
    """An ended span as the loop leaves it."""

    name: str
    kind: int  # SERVER | CLIENT
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    remote_parent: bool
    state: str  # the client's tracestate
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None  # the status description of an ERROR span, None: UNSET


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint (a negative int64 as its 10-byte two's complement)."""
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the length, the bytes."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else varint(n)) + payload


def any_value(v: Any) -> bytes:
    """An `AnyValue` message's bytes (str, bool, int, float, or a sequence of them)."""
    if isinstance(v, str):
        return _field(b"\x0a", v.encode())
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _pack_d(v)
    if isinstance(v, list | tuple):
        return _field(b"\x2a", b"".join(_field(b"\x0a", any_value(x)) for x in v))
    return _field(b"\x0a", str(v).encode())


def key_value(tag: bytes, key: str, v: Any) -> bytes:
    """A `KeyValue` as the field `tag` of its message."""
    return _field(tag, _field(b"\x0a", key.encode()) + _field(b"\x12", any_value(v)))


class Encoder:
    """Span records → an `ExportTraceServiceRequest`, one resource and scope.
    Not thread-safe: the export thread's alone."""

    def __init__(self, resource: Mapping[str, Any], scope: str, version: str) -> None:
        # ResourceSpans.resource (1): Resource.attributes (1) ...
        res = b"".join(key_value(b"\x0a", k, v) for k, v in resource.items())
        self._resource = _field(b"\x0a", res)
        # ScopeSpans.scope (1): InstrumentationScope.name (1), version (2).
        self._scope = _field(
            b"\x0a", _field(b"\x0a", scope.encode()) + _field(b"\x12", version.encode())
        )
        self._kv: dict[tuple[str, type, Any], bytes] = {}
        self._floats: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}

    def _float_prefix(self, key: str) -> bytes:
        """A float attribute's `KeyValue` up to its 8 value bytes."""
        k = _field(b"\x0a", key.encode())
        prefix = b"\x4a" + varint(len(k) + 11) + k + b"\x12\x09\x21"
        if len(self._floats) > _CACHE_MAX:
            self._floats.clear()
        self._floats[key] = prefix
        return prefix

    def encode(self, records: Iterable[SpanRecord]) -> bytes:
        spans = b"".join([_field(b"\x12", self._span(r)) for r in records])
        # ExportTraceServiceRequest.resource_spans (1): resource, scope_spans (2).
        return _field(b"\x0a", self._resource + _field(b"\x12", self._scope + spans))

    def _span(self, r: SpanRecord) -> bytes:
        names = self._names
        name = names.get(r.name)
        if name is None:
            if len(names) > _CACHE_MAX:
                names.clear()
            name = names[r.name] = _field(b"\x2a", r.name.encode())
        parts = [
            b"\x0a\x10",
            r.trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            r.span_id.to_bytes(8, "big"),
        ]
        if r.state:
            parts.append(_field(b"\x1a", r.state.encode()))
        if r.parent_id:
            parts += (b"\x22\x08", r.parent_id.to_bytes(8, "big"))
        parts += (name, _KIND[r.kind], b"\x39", _pack_q(r.start_ns), b"\x41", _pack_q(r.end_ns))
        cache = self._kv
        for k, v in r.attributes.items():
            t = v.__class__
            if t is float:  # rarely the same twice: a cached prefix and the 8 bytes
                prefix = self._floats.get(k)
                if prefix is None:
                    prefix = self._float_prefix(k)
                parts += (prefix, _pack_d(v))
                continue
            ck = (k, t, v) if t is not list else (k, t, tuple(v))
            b = cache.get(ck)
            if b is None:
                if len(cache) > _CACHE_MAX:  # unique values (request ids) fill it
                    cache.clear()
                b = cache[ck] = key_value(b"\x4a", k, v)
            parts.append(b)
        if r.error is None:
            parts.append(_STATUS_UNSET)
        else:  # Status.message (2), code (3) = ERROR
            parts.append(_field(b"\x7a", _field(b"\x12", r.error.encode()) + b"\x18\x02"))
        parts.append(_FLAGS_REMOTE if r.parent_id and r.remote_parent else _FLAGS_LOCAL)
        return b"".join(parts)


class ExportError(Exception):
    """The collector could not be reached, or did not answer 2xx."""


class HttpExporter:
    """`POST`s encoded requests to the collector over one kept-alive connection."""

    def __init__(self, url: str, headers: Mapping[str, str], timeout_s: float) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._timeout = timeout_s
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"brownout/{__version__}",
            **headers,
        }
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def post(self, body: bytes) -> None:
        """Sends `body`; raises `ExportError` unless the collector answers 2xx."""
        for fresh in (False, True):
            reused = self._conn is not None
            conn = self._conn or self._connect()
            self._conn = conn
            try:
                conn.request("POST", self._path, body, self._headers)
                resp = conn.getresponse()
                resp.read()
            except (http.client.HTTPException, OSError) as exc:
                self.close()
                # A kept-alive connection the collector closed meanwhile: once more, fresh.
                stale = isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError)
                if reused and stale and not fresh:
                    continue
                raise ExportError(f"{type(exc).__name__}: {exc}") from exc
            if resp.will_close:
                self.close()
            if not 200 <= resp.status < 300:
                raise ExportError(f"HTTP {resp.status}")
            return

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
