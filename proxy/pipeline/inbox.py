"""The outcome inbox: the one place request outcomes reach shared state.

Stages return values; the attempt loop hands each attempt's result here, and
this feeds the backend's breaker, the ladder, the pressure monitor and the
outcome metrics. (The finish step writes the per-request metrics and the
access log line; nothing else in the pipeline writes shared state.)
"""

from __future__ import annotations

import structlog

from proxy.backends.upstream import Upstream
from proxy.control.breaker import Permit
from proxy.pipeline.record import AttemptResult
from proxy.runtime.generation import Runtime

log = structlog.get_logger("brownout.request")


class Inbox:
    __slots__ = ("rid", "rt")

    def __init__(self, rt: Runtime, rid: str) -> None:
        self.rt = rt
        self.rid = rid

    def attempt(self, up: Upstream, result: AttemptResult, permit: Permit) -> None:
        """An attempt on `up` (admitted by the breaker's `permit`) ended: the
        breaker's verdict, TTFT and guard trips."""
        rt = self.rt
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
        if result.fault:
            self.failure(up, permit, result.fault, result.detail)
            return
        if not result.healthy:
            return  # load (429), shed, client gone: says nothing about the backend
        ttft = result.ttft
        if ttft is not None:
            rt.metrics.upstream_ttft.labels(up.name).observe(ttft)
            if up.name == "primary":
                rt.pressure.record_ttft(ttft)
            limit = rt.policy.ladder.failover.ttft_limit_s
            if limit and ttft > limit:
                self.failure(up, permit, "slow_ttft", f"{ttft:.2f}s")
                return
        rt.report_success(up, permit=permit)

    def settle(self, up: Upstream, permit: Permit) -> None:
        """An attempt on `up` is over: if it reported nothing (shed, client
        gone, an exception), a half-open breaker's trial slot goes back (a
        no-op once the permit's outcome was recorded)."""
        up.release_trial(permit)

    def failure(self, up: Upstream, permit: Permit, kind: str, detail: str = "") -> None:
        self.rt.report_failure(up, kind, detail, permit=permit)

    def retry(self, prev: Upstream, up: Upstream, reason: str) -> None:
        """Another attempt: on the same backend (a retry within its budget) or the next."""
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
