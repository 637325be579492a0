"""The outcome inbox: the one place request outcomes reach shared state.

Stages return values; the attempt loop hands each attempt's result here, and
this feeds the backend's breaker, the ladder, the pressure monitor and the
outcome metrics. (The finish step writes the per-request metrics and the
access log line; nothing else in the pipeline writes shared state.)
"""

from __future__ import annotations

import hashlib

import structlog
from aiohttp import web

from proxy.backends.upstream import Upstream
from proxy.control.attribution import Held, classify
from proxy.control.breaker import Permit
from proxy.ingress.identity import client_identity
from proxy.openai.auth import bearer_token
from proxy.pipeline.record import AttemptResult
from proxy.runtime.generation import Runtime

log = structlog.get_logger("brownout.request")


class Inbox:
    __slots__ = (
        "_who",
        "attempts",
        "body",
        "call_at",
        "candidate_fault",
        "request",
        "retries",
        "rid",
        "rt",
    )

    def __init__(
        self,
        rt: Runtime,
        rid: str,
        request: web.Request | None = None,
        body: dict[str, object] | None = None,
    ) -> None:
        self.rt = rt
        self.rid = rid
        self.request = request
        self.body = body  # the request's JSON (its `model`, on a failure's path)
        self.candidate_fault = ""  # the gray release's candidate failed it (by its fault)
        self._who: str | None = None
        # For the flight recorder (only while it records): each attempt as
        # (backend, kind, status, fault, ttft, end offset), and the retries.
        self.attempts: list[tuple[str, str, int, str, float | None, float, float | None]] | None = (
            None
        )
        self.retries = 0
        # When the current attempt's backend call began (after admission); None
        # before it (a shed, a refusal): the recorder's attempt start.
        self.call_at: float | None = None

    @property
    def who(self) -> str:
        """The client's identity as it is (`client_identity`, unhashed: kept
        only in memory, for the admission's fair share); computed once."""
        who = self._who
        if who is None:
            req = self.request
            if req is None:
                who = ""
            else:
                keyed = bool(self.rt.policy.server.api_keys)
                key = bearer_token(req.headers.get("Authorization")) if keyed else None
                who = client_identity(
                    req.remote, key, req.headers.get("X-Forwarded-For"), keyed=keyed
                )
            self._who = who
        return who

    @property
    def identity(self) -> str | None:
        """The client's identity if it was needed (the fair share, a cap): the
        recorder hashes it; never computed for the recorder alone."""
        return self._who or None

    def note(self, up: Upstream, result: AttemptResult) -> None:
        """The flight recorder's note of an attempt (a no-op unless it records)."""
        if self.rt.recorder is None:
            return
        t0 = self.rt.clock()
        if self.attempts is None:
            self.attempts = []
        self.attempts.append(
            (up.name, result.kind, result.status, result.fault, result.ttft, t0, self.call_at)
        )
        self.call_at = None

    @property
    def client(self) -> str:
        """Who sent the request, as far as a breaker may believe it
        (`client_identity`; computed only on a failure's path)."""
        if self.request is None:
            return ""
        who = self.who
        # Hashed: an API key is never kept (nor shown in status) as it is.
        kind, _, value = who.partition(":")
        digest = hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return f"{kind}:{digest}"

    def attempt(self, up: Upstream, result: AttemptResult, permit: Permit) -> None:
        """An attempt on `up` (admitted by the breaker's `permit`) ended: its
        attribution (`proxy.control.attribution`) and the breaker's verdict,
        TTFT and guard trips."""
        rt = self.rt
        if rt.recorder is not None:
            self.note(up, result)
        trip = result.trip
        if trip is not None:
            rt.metrics.guard_trips.labels(trip.rule, up.name).inc()
            log.warning(
                "guard_trip",
                request_id=self.rid,
                backend=up.name,
                rule=trip.rule,
                excerpt=trip.excerpt,
            )
        if result.fault or (result.kind == "failed" and not result.healthy):
            self.charge(up, permit, result)
            return
        if not result.healthy:
            return  # shed, client gone: says nothing about the backend
        if result.status >= 400:
            rt.report_charged(up, "request", f"http_{result.status}")
        ttft = result.ttft
        if ttft is not None:
            rt.metrics.upstream_ttft.labels(up.name).observe(ttft)
            if up.name == "primary":
                rt.pressure.record_ttft(ttft)
            limit = rt.policy.ladder.failover.ttft_limit_s
            if limit and ttft > limit:
                self.failure(up, permit, "slow_ttft", f"{ttft:.2f}s", suspect=True)
                return
        rt.report_success(up, permit=permit)

    def settle(self, up: Upstream, permit: Permit) -> None:
        """An attempt on `up` is over: if it reported nothing (shed, client
        gone, an exception), a half-open breaker's trial slot goes back (a
        no-op once the permit's outcome was recorded)."""
        up.release_trial(permit)

    def charge(self, up: Upstream, permit: Permit, result: AttemptResult) -> None:
        """A failed attempt: to the backend (its breaker, the ladder), or
        counted as the request's own or as load."""
        stream = result.stream
        text = stream.error_event if stream is not None and stream.error_event else result.body
        model = self.body.get("model") if self.body is not None else None
        if isinstance(model, str) and model in up.served_models:
            up.traffic_model = model  # what the recovery probe asks for
        v = classify(result.fault, result.status, text, result.retry_after is not None)
        canary = self.rt.canary
        if canary is not None and (v.attribution == "backend" or result.status >= 500):
            # A gray release's error log has it now, before the request ends
            # (its rollback bundle may be written first: the health gate).
            # Its detail, else what the backend said (its error body or event).
            detail = result.detail or text[:300].decode("utf-8", "replace")
            canary.attempt_failed(self.rid, up.name, result.status, v.fault, detail, v.attribution)
        if v.fault == "total_timeout" and self.rt.check_engine(
            up, permit, Held(v.fault, result.detail, self.client, self.rid)
        ):
            return  # a hung engine looks the same: the probe's verdict counts it
        if up.name == "candidate" and v.attribution == "backend":
            self.candidate_fault = v.fault
        if v.attribution != "backend":
            self.rt.report_charged(up, v.attribution, v.fault)
            log.info(
                "failure_charged",
                request_id=self.rid,
                backend=up.name,
                attribution=v.attribution,
                fault=v.fault,
            )
            return
        self.failure(up, permit, v.fault, result.detail, suspect=v.suspect)

    def forgive(self, up: Upstream, permit: Permit) -> None:
        """This request's failure on `up` was its own (it failed everywhere)."""
        self.rt.forgive(up, permit, self.rid)

    def failure(
        self, up: Upstream, permit: Permit, kind: str, detail: str = "", *, suspect: bool = False
    ) -> None:
        rt = self.rt
        client = self.client if suspect else ""
        rt.report_failure(
            up, kind, detail, permit=permit, suspect=suspect, client=client, rid=self.rid
        )

    def retry(self, prev: Upstream, up: Upstream, reason: str) -> None:
        """Another attempt: on the same backend (a retry within its budget) or the next."""
        self.retries += 1
        self.rt.metrics.retries.labels(prev.name, up.name, reason or "error").inc()
        log.info(
            "retry",
            request_id=self.rid,
            from_backend=prev.name,
            to_backend=up.name,
            reason=reason,
        )

    def budget_exhausted(self, up: Upstream, reason: str) -> None:
        self.rt.metrics.retry_budget_exhausted.labels(up.name).inc()
        log.info("retry_budget_exhausted", request_id=self.rid, backend=up.name, reason=reason)

    def shed(self, priority: str, reason: str) -> None:
        self.rt.metrics.shed.labels(priority, reason).inc()

    def rescue(self, result: str) -> None:
        self.rt.metrics.rescues.labels(result).inc()

    def trimmed(self, up: Upstream, dropped_turns: int) -> None:
        self.rt.metrics.trimmed.labels(up.name).inc()
        if dropped_turns:
            self.rt.metrics.trimmed_turns.labels(up.name).inc(dropped_turns)

    def token_estimate(self, up: Upstream, error: str = "") -> None:
        self.rt.metrics.token_estimates.labels(up.name).inc()
        if error:
            log.warning("token_count_failed", request_id=self.rid, backend=up.name, error=error)

    def session_op(self, op: str, result: str) -> None:
        self.rt.metrics.session_ops.labels(op, result).inc()

    def maintenance_answer(self, kind: str) -> None:
        self.rt.metrics.maintenance_answers.labels(kind).inc()
