"""Brownout writes OTLP's protobuf by hand (`proxy.telemetry.otlp`): what it
writes must be what the SDK's encoder writes for the same spans, message
for message, and what a collector decodes."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from proxy.telemetry.otlp import CLIENT, SERVER, Encoder, SpanRecord, varint

RESOURCE = {"service.name": "edge-gw", "service.version": "1.2.3", "telemetry.sdk.name": "x"}
ATTRS: dict[str, Any] = {
    "http.request.method": "POST",
    "brownout.stream": True,
    "brownout.session": False,
    "brownout.attempt": 1,
    "http.response.status_code": 200,
    "gen_ai.usage.output_tokens": 1 << 40,
    "brownout.negative": -3,
    "brownout.ttft_s": 0.012345,
    "gen_ai.response.finish_reasons": ["stop", "length"],
    "brownout.detail": "é" * 200,  # a length over 127 bytes: a two-byte varint
    "brownout.empty": "",
}


def record(**kw: Any) -> SpanRecord:
    base: dict[str, Any] = {
        "name": "POST /v1/chat/completions",
        "kind": SERVER,
        "trace_id": 0x0AF7651916CD43DD8448EB211C80319C,
        "span_id": 0xB7AD6B7169203331,
        "parent_id": 0x00F067AA0BA902B7,
        "remote_parent": True,
        "state": "vendor=abc",
        "start_ns": 1_700_000_000_000_000_000,
        "end_ns": 1_700_000_000_123_456_789,
        "attributes": dict(ATTRS),
        "error": None,
    }
    return SpanRecord(**{**base, **kw})


def sdk_span(r: SpanRecord) -> ReadableSpan:
    state = TraceState.from_header([r.state]) if r.state else None
    flags = TraceFlags(1)
    parent = (
        SpanContext(r.trace_id, r.parent_id, r.remote_parent, flags, state) if r.parent_id else None
    )
    return ReadableSpan(
        r.name,
        context=SpanContext(r.trace_id, r.span_id, False, flags, state),
        parent=parent,
        resource=Resource(RESOURCE),
        attributes=r.attributes,
        kind=SpanKind.SERVER if r.kind == SERVER else SpanKind.CLIENT,
        status=Status(StatusCode.ERROR, r.error) if r.error is not None else Status(),
        start_time=r.start_ns,
        end_time=r.end_ns,
        instrumentation_scope=InstrumentationScope("brownout", "9.9"),
    )


RECORDS = [
    record(),
    record(kind=CLIENT, parent_id=0xB7AD6B7169203331, remote_parent=False, span_id=5),
    record(parent_id=0, state="", error="upstream_disconnect"),
    record(kind=CLIENT, attributes={}, error=""),
]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_encoding_is_the_sdks(n: int) -> None:
    records = RECORDS[:n]
    mine = ExportTraceServiceRequest()
    enc = Encoder(RESOURCE, "brownout", "9.9")
    data = enc.encode(records)
    mine.ParseFromString(data)
    theirs = encode_spans([sdk_span(r) for r in records])
    assert mine == theirs
    # Again: the cached attributes encode the same.
    assert enc.encode(records) == data


def test_what_a_collector_reads() -> None:
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(Encoder(RESOURCE, "brownout", "9.9").encode(RECORDS[:3]))
    [rs] = msg.resource_spans
    assert {a.key: a.value.string_value for a in rs.resource.attributes} == RESOURCE
    [ss] = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("brownout", "9.9")
    server, client, root = ss.spans
    assert server.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent_span_id.hex() == "00f067aa0ba902b7"
    assert server.trace_state == "vendor=abc"
    assert server.kind == 2 and client.kind == 3
    assert server.flags == 0x300 and client.flags == 0x100
    got = {a.key: a.value for a in server.attributes}
    assert got["brownout.stream"].bool_value is True
    assert got["brownout.session"].WhichOneof("value") == "bool_value"
    assert got["gen_ai.usage.output_tokens"].int_value == 1 << 40
    assert got["brownout.negative"].int_value == -3
    assert got["brownout.ttft_s"].double_value == 0.012345
    assert [v.string_value for v in got["gen_ai.response.finish_reasons"].array_value.values] == [
        "stop",
        "length",
    ]
    assert root.parent_span_id == b"" and root.status.code == 2
    assert root.status.message == "upstream_disconnect"
    assert server.end_time_unix_nano - server.start_time_unix_nano == 123_456_789


def test_an_empty_export_is_an_empty_request() -> None:
    assert ExportTraceServiceRequest.FromString(b"") == ExportTraceServiceRequest()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 1 << 63, -1, -(1 << 63)])
def test_varint(n: int) -> None:
    from google.protobuf.internal.encoder import _VarintBytes  # type: ignore[attr-defined]

    assert varint(n) == _VarintBytes(n if n >= 0 else n + (1 << 64))
