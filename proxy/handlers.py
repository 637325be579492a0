"""HTTP handlers: admission checks → backend choice → upstream call → relay.

Data flows one way through `forward_completion`: validate the request, try
the candidate backends in order (the next one only when the previous could
not be reached at all), relay the answer, record metrics and one log line.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import JSON_CT, RequestRejected, error_body, error_response
from proxy.keys import RUNTIME
from proxy.relay import StreamResult, relay_stream
from proxy.runtime import Runtime, request_id
from proxy.upstream import HOP_BY_HOP, Upstream
from proxy.validate import Endpoint, parse_body

log = structlog.get_logger("brownout.request")

_NO_RETRY = {"x-should-retry": "false"}


def _check_api_key(rt: Runtime, request: web.Request) -> None:
    keys = rt.policy.server.api_keys
    if not keys:
        return
    auth = request.headers.get("Authorization", "")
    token = auth[7:] if auth[:7].lower() == "bearer " else ""
    if token not in keys:
        raise RequestRejected(401, "invalid or missing API key", "invalid_api_key")


def upstream_headers(request: web.Request, up: Upstream, rid: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in request.headers.items():
        if k.lower() not in HOP_BY_HOP:
            out.add(k, v)
    out["X-Request-Id"] = rid
    # Relayed bytes are parsed (SSE) or passed through verbatim: no compression.
    out["Accept-Encoding"] = "identity"
    if up.auth_header is not None:
        out["Authorization"] = up.auth_header
    return out


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise RequestRejected(
            413,
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit",
            "request_too_large",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestRejected(
            413, f"request body exceeds the {limit}-byte limit", "request_too_large"
        ) from None


def _upstream_error_body(status: int, body: bytes) -> bytes:
    """The upstream's error body if it is already OpenAI-shaped, else a wrapped one."""
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return body
    except ValueError:
        pass
    text = body[:200].decode("utf-8", "replace").strip() or f"HTTP {status}"
    return error_body(f"backend error: {text}", "server_error", status)


def _response_headers(rt: Runtime, rid: str, backend: str) -> dict[str, str]:
    return {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier, "X-Brownout-Backend": backend}


async def forward_completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    rid = request_id(request.headers.get("X-Request-Id"))
    base = {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier}
    try:
        _check_api_key(rt, request)
        raw = await _read_body(request, rt.policy.server.max_body_bytes)
        parsed = parse_body(raw, endpoint)
    except RequestRejected as rej:
        rt.metrics.bad_requests.labels(rej.code).inc()
        rt.count_request("none", endpoint, rej.status)
        log.info("request_rejected", request_id=rid, status=rej.status, reason=rej.code)
        return rej.response(base)

    if rt.policy.server.log_prompts:
        # Opt-in only: prompts can hold personal data.
        log.info(
            "prompt",
            request_id=rid,
            messages=parsed.body.get("messages"),
            prompt=parsed.body.get("prompt"),
        )
    rt.inflight += 1
    try:
        return await _try_backends(request, rt, endpoint, raw, parsed.body, parsed.stream, rid, t0)
    finally:
        rt.inflight -= 1


async def _try_backends(
    request: web.Request,
    rt: Runtime,
    endpoint: Endpoint,
    raw: bytes,
    body: dict[str, Any],
    stream: bool,
    rid: str,
    t0: float,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    last_error = "no backend configured"
    for up in rt.candidates():
        if up.policy.model is not None and body.get("model") != up.policy.model:
            payload = json.dumps({**body, "model": up.policy.model}).encode()
        else:
            payload = raw
        url = up.chat_url if endpoint == "chat" else up.completions_url
        headers = upstream_headers(request, up, rid)
        bm = rt.backend_metrics[up.name]
        t_call = loop.time()
        deadline = t_call + up.policy.timeouts.first_byte_s
        try:
            async with asyncio.timeout_at(deadline):
                resp = await up.session.post(url, data=payload, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            bm.upstream_errors.inc()
            last_error = f"{up.name} backend unreachable: {exc.os_error.strerror or exc}"
            log.warning("upstream_unreachable", request_id=rid, backend=up.name, error=last_error)
            continue
        except TimeoutError:
            rt.metrics.upstream_errors.labels(up.name, "first_byte_timeout").inc()
            return _finish_error(
                rt,
                endpoint,
                rid,
                up.name,
                504,
                "backend did not answer before the deadline",
                "upstream_timeout",
                t0,
            )
        except aiohttp.ClientError as exc:
            rt.metrics.upstream_errors.labels(up.name, "request").inc()
            return _finish_error(
                rt,
                endpoint,
                rid,
                up.name,
                502,
                f"backend request failed: {type(exc).__name__}",
                "upstream_error",
                t0,
            )
        overhead_pre = t_call - t0
        try:
            return await _relay(
                request, rt, endpoint, up, resp, stream, rid, t0, deadline, overhead_pre
            )
        finally:
            if resp.content.is_eof():
                resp.release()
            else:
                # Not fully read (client left, error, timeout): closing the
                # connection makes vLLM abort the request and free its KV cache.
                resp.close()
    return _finish_error(rt, endpoint, rid, "none", 502, last_error, "upstream_unreachable", t0)


async def _relay(
    request: web.Request,
    rt: Runtime,
    endpoint: Endpoint,
    up: Upstream,
    resp: aiohttp.ClientResponse,
    stream: bool,
    rid: str,
    t0: float,
    deadline: float,
    overhead_pre: float,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    headers = _response_headers(rt, rid, up.name)
    ctype = resp.headers.get("Content-Type", JSON_CT)
    t_upstream = loop.time()
    if not stream or resp.status != 200 or not ctype.startswith("text/event-stream"):
        try:
            async with asyncio.timeout(up.policy.timeouts.idle_s):
                body = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            rt.metrics.upstream_errors.labels(up.name, "body").inc()
            return _finish_error(
                rt,
                endpoint,
                rid,
                up.name,
                502,
                f"backend answer could not be read: {type(exc).__name__}",
                "upstream_error",
                t0,
            )
        if resp.status >= 400:
            body = _upstream_error_body(resp.status, body)
            ctype = JSON_CT
            if resp.status >= 500:
                rt.metrics.upstream_errors.labels(up.name, f"http_{resp.status}").inc()
        headers["Content-Type"] = ctype
        out = web.Response(status=resp.status, body=body, headers=headers)
        now = loop.time()
        rt.metrics.overhead.observe(overhead_pre + (now - t_upstream))
        _finish(rt, endpoint, rid, up.name, resp.status, t0, now, stream=False, outcome="complete")
        return out

    headers["Content-Type"] = ctype
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    pol = rt.policy
    client, result = await relay_stream(
        request,
        resp,
        headers,
        heartbeat_s=pol.server.heartbeat_s,
        first_byte_deadline=deadline,
        idle_s=up.policy.timeouts.idle_s,
    )
    _finish_stream(rt, endpoint, rid, up.name, t0, overhead_pre, result)
    return client


def _finish_stream(
    rt: Runtime,
    endpoint: str,
    rid: str,
    backend: str,
    t0: float,
    overhead_pre: float,
    result: StreamResult,
) -> None:
    now = asyncio.get_running_loop().time()
    if result.first_event_at is not None and result.headers_sent_at is not None:
        rt.metrics.overhead.observe(
            overhead_pre + max(0.0, result.headers_sent_at - result.first_event_at)
        )
    if result.outcome == "client_disconnect":
        rt.metrics.client_disconnects.labels(backend).inc()
    elif result.outcome != "complete" and result.headers_sent_at is not None:
        rt.metrics.stream_errors.labels(backend, result.outcome).inc()
    _finish(
        rt,
        endpoint,
        rid,
        backend,
        result.status,
        t0,
        now,
        stream=True,
        outcome=result.outcome,
        ttft=(result.headers_sent_at - t0) if result.headers_sent_at is not None else None,
        events=result.events,
        detail=result.detail,
    )


def _finish(
    rt: Runtime,
    endpoint: str,
    rid: str,
    backend: str,
    status: int,
    t0: float,
    now: float,
    *,
    stream: bool,
    outcome: str,
    ttft: float | None = None,
    events: int | None = None,
    detail: str = "",
) -> None:
    rt.count_request(backend, endpoint, status)
    bm = rt.backend_metrics.get(backend)
    if bm is not None:
        bm.duration.observe(now - t0)
        bm.ttft.observe(ttft if ttft is not None else now - t0)
    log.info(
        "request",
        request_id=rid,
        endpoint=endpoint,
        backend=backend,
        status=status,
        stream=stream,
        outcome=outcome,
        duration_ms=round((now - t0) * 1000, 2),
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
        events=events,
        **({"detail": detail} if detail else {}),
    )


def _finish_error(
    rt: Runtime,
    endpoint: str,
    rid: str,
    backend: str,
    status: int,
    message: str,
    code: str,
    t0: float,
) -> web.Response:
    _finish(
        rt,
        endpoint,
        rid,
        backend,
        status,
        t0,
        asyncio.get_running_loop().time(),
        stream=False,
        outcome="error",
        detail=message,
    )
    headers = _response_headers(rt, rid, backend)
    if status == 502 and code == "upstream_unreachable":
        headers.update(_NO_RETRY)
    return error_response(status, message, type_="server_error", code=code, headers=headers)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await forward_completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await forward_completion(request, "completions")


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other /v1/* call (models, embeddings, ...): relayed as is, to the
    first backend that can be reached."""
    rt = request.app[RUNTIME]
    rid = request_id(request.headers.get("X-Request-Id"))
    base = {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier}
    try:
        _check_api_key(rt, request)
        raw = (
            await _read_body(request, rt.policy.server.max_body_bytes)
            if request.can_read_body
            else b""
        )
    except RequestRejected as rej:
        return rej.response(base)
    last_error = "no backend configured"
    for up in rt.candidates():
        headers = upstream_headers(request, up, rid)
        try:
            async with asyncio.timeout(up.policy.timeouts.first_byte_s):
                resp = await up.session.request(
                    request.method,
                    up.url_for(request.rel_url.raw_path_qs),
                    data=raw or None,
                    headers=headers,
                )
        except aiohttp.ClientConnectorError as exc:
            last_error = f"{up.name} backend unreachable: {exc.os_error.strerror or exc}"
            continue
        except (TimeoutError, aiohttp.ClientError) as exc:
            return error_response(
                504 if isinstance(exc, TimeoutError) else 502,
                f"backend request failed: {type(exc).__name__}",
                type_="server_error",
                code="upstream_error",
                headers=_response_headers(rt, rid, up.name),
            )
        try:
            out = web.StreamResponse(
                status=resp.status, headers=_response_headers(rt, rid, up.name)
            )
            for k in ("Content-Type", "Content-Encoding"):
                if k in resp.headers:
                    out.headers[k] = resp.headers[k]
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            rt.count_request(up.name, "passthrough", resp.status)
            return out
        finally:
            resp.close()
    return error_response(
        502, last_error, type_="server_error", code="upstream_unreachable", headers=base
    )


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process and its event loop answer."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: at least one backend passed its last probe (maintenance
    answers would still work, but a load balancer should prefer a replica
    that can reach a model)."""
    rt = request.app[RUNTIME]
    ready = any(u.health.healthy for u in rt.upstreams.values())
    body = {
        "ready": ready,
        "backends": {n: bool(u.health.healthy) for n, u in rt.upstreams.items()},
    }
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    for name, up in rt.upstreams.items():
        rt.metrics.backend_up.labels(name).set(1 if up.health.healthy else 0)
    return web.Response(
        body=rt.metrics.exposition(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def status(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    pol = rt.policy
    backends = {}
    for name, up in rt.upstreams.items():
        h = up.health
        backends[name] = {
            "url": up.policy.url,
            "kind": up.policy.kind,
            "healthy": h.healthy,
            "last_error": h.last_error,
            "last_probe_at": h.last_probe_at,
            "consecutive_failures": h.consecutive_failures,
            "breaker": "closed",
        }
    inflight = rt.inflight
    body = {
        "tier": rt.tier,
        "backends": backends,
        "concurrency": {"limit": pol.ladder.throttle.max_inflight, "inflight": inflight},
        "policy": {"source": pol.source},
        "uptime_s": round(time.time() - rt.started_at, 1),
        "version": _version(),
    }
    return web.json_response(body)


def _version() -> str:
    from proxy import __version__

    return __version__
