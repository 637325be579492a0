"""A stand-in OpenTelemetry collector: OTLP/HTTP protobuf on `POST /v1/traces`.

    python -m tests.integration.otlp_receiver PORT

Each export is decoded with opentelemetry-proto (as a collector would) and
its spans kept; `GET /spans` answers them as JSON (ids in hex, attributes as
plain values), `DELETE /spans` forgets them. A separate process, so the
proxy's exporter talks to it over a real socket as it would to a collector.
"""

from __future__ import annotations

import sys
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPANS: web.AppKey[list[dict[str, Any]]] = web.AppKey("spans", list)
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


async def traces(request: web.Request) -> web.Response:
    if request.content_type != "application/x-protobuf":
        return web.Response(status=415)
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(await request.read())
    out = request.app[SPANS]
    for rs in msg.resource_spans:
        resource = {a.key: value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    {
                        "name": s.name,
                        "kind": KINDS.get(s.kind, str(s.kind)),
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                        "resource": resource,
                        "scope": ss.scope.name,
                        "headers": {
                            k: v for k, v in request.headers.items() if k.lower().startswith("x-")
                        },
                    }
                )
    return web.Response(
        body=ExportTraceServiceResponse().SerializeToString(),
        content_type="application/x-protobuf",
    )


async def spans(request: web.Request) -> web.Response:
    return web.json_response(request.app[SPANS])


async def forget(request: web.Request) -> web.Response:
    request.app[SPANS].clear()
    return web.Response(status=204)


def main() -> None:
    app = web.Application()
    app[SPANS] = []
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/spans", spans)
    app.router.add_delete("/spans", forget)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
