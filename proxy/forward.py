"""The request flow for completions: route → attempts → relay → rescue.

    validate ─► ladder.route() ─► maintenance answer
                     │
                     ▼
        candidates (breaker allows) ─► attempt ─► non-stream: relay bytes
                     ▲                   │        stream: relay events
                     └── retry ◄─────────┤ failed before the first byte
                                         │ (refused, 5xx, timeout, error event;
                                         │  never a 4xx)
                                         ▼
                          died mid-answer ─► rescue on the fallback
                                             (continue the partial answer)
                                             or end with an error event

Every outcome is reported to the backend's breaker and the ladder; every
request ends with one metric update and one log line.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from proxy.admission import Rejected
from proxy.breaker import Permit
from proxy.conversation import (
    SessionContext,
    answer_from_body,
    make_turn,
    merge_history,
    surely_fits,
)
from proxy.errors import JSON_CT, RequestRejected, error_body, error_response
from proxy.guard import StreamGuard, Trip
from proxy.ingress.headers import forward_headers
from proxy.maintenance import render_json, render_stream
from proxy.openai.errors import upstream_error_body
from proxy.openai.headers import SSE_CONTENT_TYPE, STREAM_HEADERS
from proxy.openai.messages import question_text
from proxy.policy import Priority
from proxy.relay import StreamResult, end_with_error, has_finish_reason, relay_stream
from proxy.rescue import continuation_body, partial_text
from proxy.runtime import Runtime
from proxy.sessions import SessionStoreUnavailable
from proxy.trim import ContextTooLong, EstimateTokenCounter, TokenCountError, budget_tokens, trim
from proxy.upstream import Upstream
from proxy.validate import Endpoint

log = structlog.get_logger("brownout.request")

_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


def upstream_headers(request: web.Request, up: Upstream, rid: str) -> CIMultiDict[str]:
    # Entity headers describe the forwarded bytes, not the client's (proxy.ingress.headers).
    return forward_headers(request.headers, rid, up.auth_header)


class Flow:
    """One completion request on its way through the ladder."""

    def __init__(
        self,
        request: web.Request,
        rt: Runtime,
        endpoint: Endpoint,
        raw: bytes,
        body: dict[str, Any],
        stream: bool,
        rid: str,
        t0: float,
        priority: Priority = "normal",
        session: SessionContext | None = None,
    ) -> None:
        self.request = request
        self.priority = priority
        self.session = session
        self.rt = rt
        self.endpoint = endpoint
        self.raw = raw
        self.body = body
        self.stream = stream
        self.rid = rid
        self.t0 = t0
        self.loop = asyncio.get_running_loop()
        self.last_error: tuple[int, bytes, str] | None = None  # status, body, backend
        self.rescued = False
        self.overhead_pre = 0.0
        self._adapted: dict[str, dict[str, Any]] = {}
        self.body_changed = False
        # Each backend's breaker permit for the attempt in progress.
        self.permits: dict[str, Permit] = {}

    # -- the flow ----------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except RequestRejected as rej:
            self.rt.metrics.bad_requests.labels(rej.code).inc()
            self.finish(
                "none", rej.status, self.loop.time(), outcome="rejected", detail=rej.message
            )
            return rej.response(self.response_headers("none"))

    async def _run(self) -> web.StreamResponse:
        rt = self.rt
        if self.session is not None:
            await self.load_history(self.session)
        dest, candidates = rt.route()
        if dest == "maintenance":
            return self.maintenance(f"tier {rt.tier}")
        prev: Upstream | None = None
        for up in candidates:
            permit = up.breaker.allow()
            if permit is None:
                continue
            if prev is not None:
                rt.metrics.retries.labels(prev.name, up.name).inc()
                log.info("retry", request_id=self.rid, from_backend=prev.name, to_backend=up.name)
            prev = up
            self.permits[up.name] = permit
            try:
                response = await self.attempt(up)
            finally:
                # No outcome (shed, client gone): a half-open trial slot goes back.
                up.breaker.release_trial(permit)
            if response is not None:
                return response
        return self.all_failed()

    def all_failed(self) -> web.StreamResponse:
        if self.rt.policy.ladder.maintenance.enabled:
            return self.maintenance("no backend could answer")
        if self.last_error is not None:
            status, body, backend = self.last_error
            return self._error_passthrough(status, body, backend)
        return self.error(502, "no backend could be reached", "upstream_unreachable", "none")

    async def attempt(self, up: Upstream) -> web.StreamResponse | None:
        """Try one backend; None means "failed before the first byte, retry"."""
        rt = self.rt
        if up.name != "primary" or not rt.policy.ladder.throttle.enabled:
            return await self._attempt(up)
        # The proxy holds the line in front of the engine (vLLM never says 429).
        try:
            await rt.admission.acquire(self.priority)
        except Rejected as r:
            return self.shed(r)
        try:
            return await self._attempt(up)
        finally:
            rt.admission.release()

    def shed(self, r: Rejected) -> web.Response:
        rt = self.rt
        rt.metrics.shed.labels(self.priority, r.reason).inc()
        headers = self.response_headers("primary")
        headers["Retry-After"] = str(r.retry_after)
        message = {
            "shed": "the service is under load and sheddable requests are refused for now",
            "queue_full": "the service is under load and its wait queue is full",
            "deadline": "the service is under load: the expected wait exceeds the queue deadline",
            "queue_timeout": "the service is under load: no slot freed up before the deadline",
            "evicted": "the service is under load: a higher-priority request took this slot",
        }.get(r.reason, "the service is under load")
        self.finish("primary", 429, self.loop.time(), outcome=f"shed_{r.reason}")
        return error_response(
            429,
            f"{message}; retry after {r.retry_after} s",
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            headers=headers,
        )

    async def _attempt(self, up: Upstream) -> web.StreamResponse | None:
        rt = self.rt
        payload = await self.payload_for(up)
        url = up.chat_url if self.endpoint == "chat" else up.completions_url
        headers = upstream_headers(self.request, up, self.rid)
        t_call = self.loop.time()
        self.overhead_pre = t_call - self.t0
        deadline = t_call + up.policy.timeouts.first_byte_s
        try:
            async with asyncio.timeout_at(deadline):
                resp = await up.session.post(url, data=payload, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            reason = exc.os_error.strerror or str(exc)
            rt.report_failure(up, "connect", reason, permit=self.permits[up.name])
            self.last_error = (
                502,
                error_body(
                    f"{up.name} backend unreachable: {reason}",
                    "server_error",
                    "upstream_unreachable",
                ),
                up.name,
            )
            return None
        except TimeoutError:
            rt.report_failure(up, "first_byte_timeout", permit=self.permits[up.name])
            self.last_error = (
                504,
                error_body(
                    "backend did not answer before the deadline", "server_error", "upstream_timeout"
                ),
                up.name,
            )
            return None
        except aiohttp.ClientError as exc:
            rt.report_failure(up, "request", type(exc).__name__, permit=self.permits[up.name])
            self.last_error = (
                502,
                error_body(
                    f"backend request failed: {type(exc).__name__}",
                    "server_error",
                    "upstream_error",
                ),
                up.name,
            )
            return None
        try:
            ctype = resp.headers.get("Content-Type", JSON_CT)
            if not self.stream or resp.status != 200 or not ctype.startswith("text/event-stream"):
                return await self.relay_body(up, resp, ctype)
            return await self.relay_events(up, resp, ctype, deadline, t_call)
        finally:
            if resp.content.is_eof():
                resp.release()
            else:
                # Not fully read (client left, error, timeout): closing the
                # connection makes vLLM abort the request and free its KV cache.
                resp.close()

    async def relay_body(
        self, up: Upstream, resp: aiohttp.ClientResponse, ctype: str
    ) -> web.StreamResponse | None:
        rt = self.rt
        t_upstream = self.loop.time()
        try:
            async with asyncio.timeout(up.policy.timeouts.idle_s):
                body = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            rt.report_failure(up, "body", type(exc).__name__, permit=self.permits[up.name])
            self.last_error = (
                502,
                error_body(
                    f"backend answer could not be read: {type(exc).__name__}",
                    "server_error",
                    "upstream_error",
                ),
                up.name,
            )
            return None
        if resp.status in _RETRYABLE_STATUS:
            if resp.status != 429:  # 429 is load, not a broken backend
                rt.report_failure(up, f"http_{resp.status}", permit=self.permits[up.name])
            self.last_error = (resp.status, upstream_error_body(resp.status, body), up.name)
            return None
        if resp.status == 200 and rt.guard is not None:
            trip = rt.guard.check_body(body)
            if trip is not None:
                self.guard_tripped(up, trip)
                headers = self.response_headers(up.name)
                self.finish(up.name, 502, self.loop.time(), outcome="guard_trip", detail=trip.rule)
                return error_response(
                    502, trip.message, type_="server_error", code="invalid_output", headers=headers
                )
        rt.report_success(
            up, permit=self.permits[up.name]
        )  # a 4xx is the request's fault, not the backend's
        headers = self.response_headers(up.name)
        if resp.status >= 400:
            body = upstream_error_body(resp.status, body)
            ctype = JSON_CT
        headers["Content-Type"] = ctype
        if resp.status == 200 and self.session is not None and self.endpoint == "chat":
            await self.save_turn(answer_from_body(body))
        out = web.Response(status=resp.status, body=body, headers=headers)
        now = self.loop.time()
        rt.metrics.overhead.observe(self.overhead_pre + (now - t_upstream))
        self.finish(up.name, resp.status, now, outcome="complete")
        return out

    async def relay_events(
        self,
        up: Upstream,
        resp: aiohttp.ClientResponse,
        ctype: str,
        deadline: float,
        t_call: float,
    ) -> web.StreamResponse | None:
        rt = self.rt
        headers = self.response_headers(up.name)
        headers["Content-Type"] = ctype
        headers.update(STREAM_HEADERS)
        sg = rt.guard.stream() if rt.guard is not None else None
        result = await relay_stream(
            self.request,
            resp,
            headers,
            heartbeat_s=rt.policy.server.heartbeat_s,
            first_byte_deadline=deadline,
            idle_s=up.policy.timeouts.idle_s,
            keep=self.can_rescue(up) or self.session is not None,
            guard=sg,
            end_response=self.session is None,
        )
        if not result.started:
            assert result.response is not None
            if result.status in _RETRYABLE_STATUS:
                if result.status != 429:
                    rt.report_failure(
                        up, result.outcome, result.detail, permit=self.permits[up.name]
                    )
                self.last_error = (result.status, result.response.body or b"", up.name)  # type: ignore[assignment]
                return None
            rt.report_success(up, permit=self.permits[up.name])
            self.finish_stream(up.name, result)
            return result.response
        if result.outcome == "complete":
            limit = rt.policy.ladder.failover.ttft_limit_s
            ttft = (result.first_event_at or t_call) - t_call
            rt.metrics.upstream_ttft.labels(up.name).observe(ttft)
            if up.name == "primary":
                rt.pressure.record_ttft(ttft)
            if limit and ttft > limit:
                rt.report_failure(up, "slow_ttft", f"{ttft:.2f}s", permit=self.permits[up.name])
            else:
                rt.report_success(up, permit=self.permits[up.name])
            if self.session is not None and self.endpoint == "chat":
                await self.save_turn(self.streamed_answer(result))
        elif result.outcome == "guard_trip":
            self.guard_tripped(up, result.trip)
            await end_with_error(result)
        elif result.outcome != "client_disconnect":
            rt.report_failure(up, result.outcome, result.detail, permit=self.permits[up.name])
            if not await self.rescue(up, result, sg):
                await end_with_error(result)
            elif self.rescued and self.session is not None:
                await self.save_turn(self.streamed_answer(result))
        if sg is not None and sg.notes:
            # Rules in `log` mode and dropped malformed events (rescue included).
            for note in sg.notes:
                rt.metrics.guard_notes.labels(note.rule, up.name).inc()
                log.info("guard_note", request_id=self.rid, rule=note.rule, excerpt=note.excerpt)
        self.finish_stream(up.name, result)
        assert result.client is not None
        return result.client

    def guard_tripped(self, up: Upstream, trip: Trip | None) -> None:
        """Invalid output is a backend failure: counted, logged (a short
        excerpt only), fed to the breaker — and never saved to a session."""
        rt = self.rt
        rule = trip.rule if trip is not None else "unknown"
        rt.metrics.guard_trips.labels(rule, up.name).inc()
        log.warning(
            "guard_trip",
            request_id=self.rid,
            backend=up.name,
            rule=rule,
            excerpt=trip.excerpt if trip is not None else "",
        )
        rt.report_failure(up, "invalid_output", rule, permit=self.permits[up.name])

    # -- rescue ------------------------------------------------------------------

    def can_rescue(self, up: Upstream) -> bool:
        fb = self.rt.upstreams.get("fallback")
        return (
            self.rt.policy.ladder.failover.rescue_streams
            and fb is not None
            and fb is not up
            and fb.supports_continuation
        )

    async def rescue(
        self, up: Upstream, result: StreamResult, guard: StreamGuard | None = None
    ) -> bool:
        """Continue a dead stream on the fallback. True when the stream was
        ended here (rescued, or failed with its own error event)."""
        rt = self.rt
        fb = rt.upstreams.get("fallback")
        if fb is None or not self.can_rescue(up) or result.regions is None:
            return False
        permit = fb.breaker.allow()
        if permit is None:
            rt.metrics.rescues.labels("fallback_unavailable").inc()
            return False
        self.permits[fb.name] = permit
        try:
            return await self._rescue_on(fb, up, result, guard)
        finally:
            fb.breaker.release_trial(permit)

    async def _rescue_on(
        self, fb: Upstream, up: Upstream, result: StreamResult, guard: StreamGuard | None
    ) -> bool:
        rt = self.rt
        partial, produced = partial_text(result.regions or [], self.endpoint)
        body = continuation_body(await self.adapted(fb), partial, produced, self.endpoint)
        client = result.client
        assert client is not None
        log.warning(
            "stream_rescue",
            request_id=self.rid,
            from_backend=up.name,
            to_backend=fb.name,
            reason=result.outcome,
            partial_chars=len(partial),
        )
        url = fb.chat_url if self.endpoint == "chat" else fb.completions_url
        deadline = self.loop.time() + fb.policy.timeouts.first_byte_s
        try:
            # An SSE comment: invisible to OpenAI clients, visible on the wire.
            note = f": brownout-rescue from={up.name} to={fb.name} reason={result.outcome}\n\n"
            await client.write(note.encode())
            async with asyncio.timeout_at(deadline):
                resp = await fb.session.post(
                    url, json=body, headers=upstream_headers(self.request, fb, self.rid)
                )
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return True  # the client left; nothing more to say
        except (aiohttp.ClientError, TimeoutError) as exc:
            rt.report_failure(fb, "rescue", type(exc).__name__, permit=self.permits[fb.name])
            rt.metrics.rescues.labels("failed").inc()
            return False
        try:
            if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith(
                "text/event-stream"
            ):
                await resp.read()
                if resp.status >= 500:
                    rt.report_failure(fb, f"http_{resp.status}", permit=self.permits[fb.name])
                rt.metrics.rescues.labels("failed").inc()
                return False
            more = await relay_stream(
                self.request,
                resp,
                {},
                heartbeat_s=rt.policy.server.heartbeat_s,
                first_byte_deadline=deadline,
                idle_s=fb.policy.timeouts.idle_s,
                client=client,
                keep=True,
                guard=guard,
                end_response=self.session is None,
            )
        finally:
            if resp.content.is_eof():
                resp.release()
            else:
                resp.close()
        result.events += more.events
        if result.regions is not None and more.regions:
            result.regions.extend(more.regions)
        if more.outcome == "complete":
            rt.report_success(fb, permit=self.permits[fb.name])
            rt.metrics.rescues.labels("rescued").inc()
            result.outcome = "complete"
            result.detail = f"rescued on {fb.name} after {result.detail or up.name + ' failed'}"
            self.rescued = True
            return True
        if more.outcome == "client_disconnect":
            result.outcome = "client_disconnect"
            return True
        if more.outcome == "guard_trip":
            self.guard_tripped(fb, more.trip)
        else:
            rt.report_failure(fb, more.outcome, more.detail, permit=self.permits[fb.name])
        rt.metrics.rescues.labels("failed").inc()
        await end_with_error(more)
        result.outcome = more.outcome
        result.detail = f"rescue on {fb.name} failed: {more.detail}"
        return True

    # -- request adaptation ------------------------------------------------------

    async def adapted(self, up: Upstream) -> dict[str, Any]:
        """The body as this backend should get it: model name, parameters it
        lacks removed, max_tokens within its window, messages trimmed to it."""
        cached = self._adapted.get(up.name)
        if cached is not None:
            return cached
        body = self.body
        out: dict[str, Any] | None = None
        model = up.policy.model
        if model is not None and body.get("model") != model:
            out = dict(body)
            out["model"] = model
        drop = [k for k in up.drop_params if k in body]
        if drop:
            out = dict(out or body)
            for k in drop:
                del out[k]
        window = up.max_model_len
        if window:
            for key in ("max_tokens", "max_completion_tokens"):
                v = body.get(key)
                if isinstance(v, int) and v >= window:
                    out = dict(out or body)
                    out[key] = max(1, window // 2)
            if self.endpoint == "chat":
                trimmed = await self.trimmed_messages(up, out or body, window)
                if trimmed is not None:
                    out = dict(out or body)
                    out["messages"] = trimmed
        result = out if out is not None else body
        self._adapted[up.name] = result
        return result

    async def trimmed_messages(
        self, up: Upstream, body: dict[str, Any], window: int
    ) -> list[dict[str, Any]] | None:
        """Messages fitted to `window` (None: nothing to drop)."""
        rt = self.rt
        tp = rt.policy.sessions.trimming
        if self.session is None and not tp.trim_stateless:
            return None
        messages = body["messages"]
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        budget = budget_tokens(
            window,
            mt if isinstance(mt, int) else None,
            margin_tokens=tp.margin_tokens,
            default_max_tokens=tp.default_max_tokens,
        )
        if budget > 0 and surely_fits(messages, int(budget * tp.high_water)):
            return None  # the common case: no tokenizer call at all
        counter = rt.counter_for(up)
        try:
            res = await trim(
                messages, budget, counter, high_water=tp.high_water, low_water=tp.low_water
            )
        except TokenCountError as exc:
            rt.metrics.token_estimates.labels(up.name).inc()
            log.warning("token_count_failed", backend=up.name, error=str(exc))
            res = await trim(
                messages,
                budget,
                EstimateTokenCounter(),
                high_water=tp.high_water,
                low_water=tp.low_water,
            )
        except ContextTooLong as exc:
            answer = mt if isinstance(mt, int) else tp.default_max_tokens
            if exc.prompt_tokens + answer <= window:
                # What cannot be dropped fits without our safety margin: send
                # that (all history dropped) and let the backend judge.
                if not exc.messages or len(exc.messages) == len(messages):
                    return None
                rt.metrics.trimmed.labels(up.name).inc()
                return [dict(m) for m in exc.messages]
            raise RequestRejected(
                400,
                f"{exc} (backend {up.name}, max_model_len {window})",
                "context_length_exceeded",
                "messages",
            ) from None
        if res.estimated:
            rt.metrics.token_estimates.labels(up.name).inc()
        if not res.trimmed:
            return None
        rt.metrics.trimmed.labels(up.name).inc()
        rt.metrics.trimmed_turns.labels(up.name).inc(res.dropped_turns)
        return [dict(m) for m in res.messages]

    async def payload_for(self, up: Upstream) -> bytes:
        adapted = await self.adapted(up)
        # Unchanged bodies go upstream as the client sent them.
        return (
            self.raw
            if adapted is self.body and not self.body_changed
            else json.dumps(adapted).encode()
        )

    # -- sessions ----------------------------------------------------------------

    async def load_history(self, ctx: SessionContext) -> None:
        rt = self.rt
        try:
            history = await rt.store.load(ctx.key)
        except SessionStoreUnavailable as exc:
            ctx.status = "unavailable"
            rt.metrics.session_ops.labels("load", "unavailable").inc()
            log.warning("session_store_unavailable", request_id=self.rid, op="load", error=str(exc))
            return
        rt.metrics.session_ops.labels("load", "ok").inc()
        ctx.history_messages = len(history)
        if history:
            self.body = merge_history(self.body, history)
            self.body_changed = True

    async def save_turn(self, assistant: str | None) -> None:
        ctx = self.session
        if ctx is None or ctx.status == "unavailable" or assistant is None:
            return
        rt = self.rt
        # A store outage queues the turn (in order) instead of losing it.
        if await rt.pending_saves.save(
            rt.store, ctx.key, make_turn(ctx, assistant, rt.turn_ids.next())
        ):
            ctx.saved = True
            rt.metrics.session_ops.labels("save", "ok").inc()
        else:
            rt.metrics.session_ops.labels("save", "queued").inc()
            log.warning("session_save_queued", request_id=self.rid, waiting=len(rt.pending_saves))

    # -- answers -----------------------------------------------------------------

    def response_headers(self, backend: str) -> dict[str, str]:
        h = {
            "X-Request-Id": self.rid,
            "X-Brownout-Tier": self.rt.tier,
            "X-Brownout-Backend": backend,
        }
        if self.session is not None:
            h["X-Brownout-Session"] = self.session.status
        return h

    def streamed_answer(self, result: StreamResult) -> str | None:
        """The full text of a finished stream (decoded once, at the end)."""
        if not result.regions or not has_finish_reason(b"".join(result.regions[-3:])):
            return None
        text, _ = partial_text(result.regions, self.endpoint)
        return text

    def maintenance(self, why: str) -> web.Response:
        rt = self.rt
        pol = rt.policy.ladder.maintenance
        ans = rt.maintenance.answer(question_text(self.body))
        rt.metrics.maintenance_answers.labels(ans.kind).inc()
        model = self.body.get("model") or "brownout-maintenance"
        headers = self.response_headers("maintenance")
        headers["Retry-After"] = str(pol.retry_after_s)
        if pol.status_code == 503:
            headers["x-should-retry"] = "false"
        if self.stream:
            opts = self.body.get("stream_options") or {}
            body = render_stream(ans.text, model, self.endpoint, bool(opts.get("include_usage")))
            headers["Content-Type"] = SSE_CONTENT_TYPE
            headers.update(STREAM_HEADERS)
        else:
            body = render_json(ans.text, model, self.endpoint)
            headers["Content-Type"] = JSON_CT
        now = self.loop.time()
        self.finish(
            "maintenance", pol.status_code, now, outcome=f"maintenance_{ans.kind}", detail=why
        )
        return web.Response(status=pol.status_code, body=body, headers=headers)

    def _error_passthrough(self, status: int, body: bytes, backend: str) -> web.Response:
        headers = self.response_headers(backend)
        headers["Content-Type"] = JSON_CT
        self.finish(backend, status, self.loop.time(), outcome="error")
        return web.Response(status=status, body=body, headers=headers)

    def error(self, status: int, message: str, code: str, backend: str) -> web.Response:
        self.finish(backend, status, self.loop.time(), outcome="error", detail=message)
        headers = self.response_headers(backend)
        headers["x-should-retry"] = "false"
        return error_response(status, message, type_="server_error", code=code, headers=headers)

    # -- bookkeeping -------------------------------------------------------------

    def finish_stream(self, backend: str, result: StreamResult) -> None:
        rt = self.rt
        now = self.loop.time()
        if result.first_event_at is not None and result.headers_sent_at is not None:
            rt.metrics.overhead.observe(
                self.overhead_pre + max(0.0, result.headers_sent_at - result.first_event_at)
            )
        if result.outcome == "client_disconnect":
            rt.metrics.client_disconnects.labels(backend).inc()
        elif result.outcome != "complete" and result.started:
            rt.metrics.stream_errors.labels(backend, result.outcome).inc()
        self.finish(
            backend,
            result.status,
            now,
            outcome=result.outcome,
            ttft=(result.headers_sent_at - self.t0) if result.headers_sent_at else None,
            events=result.events,
            detail=result.detail,
        )

    def finish(
        self,
        backend: str,
        status: int,
        now: float,
        *,
        outcome: str,
        ttft: float | None = None,
        events: int | None = None,
        detail: str = "",
    ) -> None:
        rt = self.rt
        rt.count_request(backend, self.endpoint, status)
        bm = rt.backend_metrics.get(backend)
        if bm is not None:
            bm.duration.observe(now - self.t0)
            bm.ttft.observe(ttft if ttft is not None else now - self.t0)
        log.info(
            "request",
            request_id=self.rid,
            endpoint=self.endpoint,
            backend=backend,
            tier=rt.tier,
            status=status,
            stream=self.stream,
            outcome=outcome,
            duration_ms=round((now - self.t0) * 1000, 2),
            ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
            events=events,
            **({"rescued": True} if self.rescued else {}),
            **({"detail": detail} if detail else {}),
        )
