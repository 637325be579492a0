"""What a running proxy holds: policy, upstreams, ladder, metrics.

One `Runtime` per app, stored under an `AppKey`; handlers read it, nothing
lives at module level. Outcomes of requests come back here (`report_*`) and
feed the breakers and the ladder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from proxy.backends.upstream import ProbeMisconfigured, Upstream
from proxy.control.admission import Admission
from proxy.control.attribution import Held, Ledger
from proxy.control.breaker import STATE_VALUES, BackendBreaker, Permit
from proxy.control.clientslots import ClientSlots
from proxy.control.ladder import TIERS, Destination, Ladder, Signals, Tier, Transition
from proxy.control.maintenance import Maintenance
from proxy.control.pressure import PressureMonitor, next_limit
from proxy.control.shared import BreakerId, SharedState
from proxy.guard.compiled import Guard
from proxy.policy import Grant, Policy, Priority, parse_key_priorities, policy_hash
from proxy.runtime.canary import Canary
from proxy.runtime.status import status_of
from proxy.runtime.supervise import Supervisor
from proxy.sessions.conversation import TurnIds
from proxy.sessions.counters import EstimateTokenCounter, RemoteTokenCounter, TokenCounter
from proxy.sessions.saves import PendingSaves
from proxy.sessions.store import MemorySessionStore, SessionStore
from proxy.telemetry.metrics import BackendMetrics, CounterChild, Metrics
from proxy.telemetry.recorder import Recorder

if TYPE_CHECKING:
    from proxy.telemetry.tracing import Tracing

log = structlog.get_logger("brownout.ladder")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


@dataclass
class Runtime:
    policy: Policy
    metrics: Metrics
    clock: Callable[[], float] = time.monotonic
    # Jitter of retry backoffs (injectable: tests make it deterministic).
    rand: Callable[[], float] = random.random
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    backend_metrics: dict[str, BackendMetrics] = field(default_factory=dict)
    inflight: int = 0
    started_at: float = field(default_factory=time.time)
    _request_counters: dict[tuple[str, str, int], CounterChild] = field(default_factory=dict)
    # The app's background work (shared by generations); a private one if None.
    supervisor: Supervisor | None = None
    # The flight recorder (one per process, `ProxyState`); None: not recording.
    recorder: Recorder | None = None

    def __post_init__(self) -> None:
        pol = self.policy
        self.ladder = Ladder(pol.ladder.recovery, self.clock, self._on_transition)
        self.maintenance = Maintenance(pol.faq, pol.ladder.maintenance)
        throttle = pol.ladder.throttle
        self.pressure = PressureMonitor(throttle, self.clock)
        self.admission = Admission(throttle, self.clock, self._on_queue_wait)
        self.client_slots = ClientSlots()
        self.key_grants = parse_key_priorities(throttle.key_priorities)
        self.default_grant = Grant(throttle.default_priority, throttle.default_priority)
        m = self.metrics
        self.tasks: Supervisor = self.supervisor or Supervisor(m.loop_errors)
        self._wall_offset = time.time() - self.clock()
        self._evaluate_soon: asyncio.Handle | None = None
        # Sessions and token counters: set up in the app's cleanup context.
        self.store: SessionStore = MemorySessionStore(
            max_sessions=pol.sessions.max_sessions,
            ttl_s=pol.sessions.ttl_s,
            max_turns=pol.sessions.max_turns,
        )
        self.counters: dict[str, TokenCounter] = {}
        self.turn_ids = TurnIds()
        self.pending_saves = PendingSaves(
            pol.sessions.pending_saves,
            on_saved=lambda: m.session_ops.labels("save", "late").inc(),
            on_dropped=m.session_turns_dropped.inc,
            on_rejected=lambda: m.session_ops.labels("save", "rejected").inc(),
            on_limited=lambda: m.session_ops.labels("save", "limit").inc(),
        )
        self._estimate = EstimateTokenCounter()
        self.guard: Guard | None = Guard(pol.guard) if pol.guard.enabled else None
        self.policy_hash = policy_hash(pol)
        self.shared: SharedState | None = None
        # Traces (`telemetry.otlp_endpoint`): set up with the backends, else None.
        self.tracing: Tracing | None = None
        self._applying_remote = False
        # The gray release of backends.candidate (proxy.runtime.canary).
        self.canary: Canary | None = (
            Canary(pol, self.clock, m, self.spawn, self._publish_rollout)
            if pol.backends.candidate is not None
            else None
        )

    def bind_gauges(self) -> None:
        """Point the app's gauges at this generation: called when it goes
        live, never for one that is still being built (a failed reload
        must not leave them reading what it threw away)."""
        m, pol = self.metrics, self.policy
        m.admission_limit.set_function(lambda: self.admission.limit)
        m.admission_inflight.set_function(lambda: self.admission.inflight)
        m.queue_depth.set_function(lambda: self.admission.queued)
        m.pressure.set_function(lambda: 1 if self.pressure.active else 0)
        m.upstream_waiting.set_function(lambda: self.pressure.engine.waiting)
        m.upstream_running.set_function(lambda: self.pressure.engine.running)
        m.upstream_kv_cache.set_function(lambda: self.pressure.engine.kv_cache)
        m.engine_queue.source = lambda: self.pressure.engine.queue_time
        m.set_policy_hash(self.policy_hash)
        m.session_saves_waiting.set_function(lambda: len(self.pending_saves))
        m.session_store_up.set_function(lambda: 1 if self.store.healthy else 0)
        m.shared_up.set_function(
            lambda: 1 if self.shared is not None and self.shared.healthy else 0
        )
        m.shared_configured.set_function(lambda: 1 if pol.ladder.shared.redis else 0)
        for up in self.upstreams.values():
            m.breaker_state.labels(up.name).set_function(_breaker_gauge(up))

    def adopt(self, prev: Runtime) -> None:
        """Carry what the previous generation learnt across a policy reload."""
        new, old = self.ladder, prev.ladder
        new.tier, new.forced, new.entered_at = old.tier, old.forced, old.entered_at
        new.healthy_streak, new.last_detail, new.history = (
            old.healthy_streak,
            old.last_detail,
            old.history,
        )
        if old.ramp is not None and old.ramp.step < len(new.policy.ramp):
            new.ramp = old.ramp
        throttle = self.policy.ladder.throttle
        self.admission = prev.admission
        self.client_slots = prev.client_slots
        self.admission.policy = throttle
        if prev.policy.ladder.throttle.max_inflight != throttle.max_inflight:
            self.admission.set_limit(throttle.max_inflight)
        self.pressure = prev.pressure
        self.pressure.set_policy(throttle)
        # One queue per process: turns that wait out an outage are written by
        # whichever generation is current when the store answers again.
        self.pending_saves = prev.pending_saves
        self.pending_saves.limit = self.policy.sessions.pending_saves
        if self.canary is not None and prev.canary is not None:
            a, b = self.policy.backends.candidate, prev.policy.backends.candidate
            same = a is not None and b is not None and a.url == b.url
            self.canary.adopt(prev.canary, same)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str = "spawn") -> None:
        """Fire-and-forget work (shared-state writes) that must not delay a
        request; referenced until done, its failure logged and counted."""
        self.tasks.spawn(name, coro)

    def _publish_rollout(self, state: dict[str, Any]) -> None:
        """A rollout change here: the other replicas follow it (`ladder.shared`)."""
        if self.shared is not None:
            self.spawn(self.shared.publish_rollout(state), "shared_publish")

    def force_tier(self, tier: Tier | None) -> None:
        if self.recorder is not None:
            self.recorder.put(("force", self.clock(), tier))
        self.ladder.force(tier)
        if tier is None:
            self.evaluate()
        if self.shared is not None and not self._applying_remote:
            self.spawn(self.shared.publish_forced(tier), "shared_publish")

    async def sync_shared(self) -> None:
        """Apply what other replicas decided (breakers opened, a forced tier)."""
        shared = self.shared
        if shared is None:
            return
        breakers: list[BreakerId] = []
        for name, up in self.upstreams.items():
            breakers.append((name, None))
            if up.per_model:
                breakers.extend((name, m) for m in up.served_models)
        opened, forced, ok = await shared.read(breakers)
        self._applying_remote = True
        try:
            for (name, model), info in opened.items():
                target = self.upstreams.get(name)
                if target is None:
                    continue
                b = target.breaker if model is None else target.breaker_for(model)
                if model is not None and b is target.breaker:
                    continue  # the backend's own breaker is not closed: it gates the model
                if b.state == "closed":
                    b.force_open(f"opened by replica {info.get('by')}: {info.get('reason', '')}")
            if ok and shared.forced_changed(forced):
                self.force_tier(forced if forced in TIERS else None)
        finally:
            self._applying_remote = False
        canary = self.canary
        if canary is not None:
            remote = await shared.read_rollout()
            if remote is not None:
                canary.follow(remote)

    def counter_for(self, up: Upstream) -> TokenCounter:
        """The backend's own tokenizer when the policy names one, else its
        /tokenize endpoint (once its served model is known), else an estimate."""
        c = self.counters.get(up.name)
        if c is not None:
            return c
        model = up.policy.model or up.served_model
        if up.policy.kind in ("vllm", "transformers") and model:
            c = RemoteTokenCounter(up.session, str(up.base), model)
            self.counters[up.name] = c
            return c
        return self._estimate

    def _on_queue_wait(self, seconds: float, counts: bool) -> None:
        self.metrics.queue_wait.observe(seconds)
        self.pressure.record_queue_wait(seconds, self.admission.limit, counts)

    def priority_for(self, header: str | None, api_key: str | None) -> Priority:
        """`X-Priority` may lower the client's priority (its key's entry, else
        `default_priority`), and raise it only up to the ceiling its entry names."""
        return self.key_grants.get(api_key or "", self.default_grant).for_header(header)

    @property
    def tier(self) -> str:
        return self.ladder.tier

    def add_upstream(self, upstream: Upstream) -> None:
        self.upstreams[upstream.name] = upstream
        self.backend_metrics[upstream.name] = self.metrics.for_backend(upstream.name)

    # -- routing -----------------------------------------------------------------

    def route(self) -> tuple[Destination, list[Upstream]]:
        """Where a request goes: the ladder's destination and, for a backend,
        the candidates to try in order before the first byte."""
        dest = self.ladder.route()
        if dest == "maintenance":
            # A forced maintenance sends nothing to any backend, trials included.
            trial = None if self.ladder.forced is not None else self._real_trial()
            if trial is None:
                return dest, []
            return ("primary" if trial.name == "primary" else "fallback"), [trial]
        primary = self.upstreams["primary"]
        fallback = self.upstreams.get("fallback")
        if dest == "primary" or fallback is None:
            order = [primary] if fallback is None else [primary, fallback]
        elif (
            (not self.policy.ladder.failover.recovery_probe or primary.probe_misconfigured)
            and primary.trial_due(self.clock())
            and self.ladder.forced is None
        ):
            # No (working) recovery probe: a real request is the primary's
            # trial (never while an operator holds the traffic elsewhere).
            order = [primary, fallback]
        else:
            order = [fallback, primary]
        if not self.policy.ladder.failover.on_connect_error:
            order = order[:1]
        return dest, order[: self.policy.ladder.failover.max_attempts]

    def _real_trial(self) -> Upstream | None:
        """A backend whose half-open trial only real traffic can make (no
        working recovery probe): in maintenance it gets the request (the
        maintenance answer follows if it fails), or it would never recover."""
        probing = self.policy.ladder.failover.recovery_probe
        now = self.clock()
        for up in self.upstreams.values():
            if (not probing or up.probe_misconfigured) and not up.down and up.trial_due(now):
                return up
        return None

    # -- signals -----------------------------------------------------------------

    def signals(self, pressure: bool = False) -> Signals:
        p = self.upstreams["primary"]
        f = self.upstreams.get("fallback")
        failover_on = self.policy.ladder.failover.enabled
        primary_ok = p.available or not failover_on
        fallback_ok = f is not None and f.available
        reasons = [_why(u) for u in (p, f) if u is not None and not u.available]
        detail = "; ".join(reasons)
        if pressure and not detail:
            detail = self.pressure.reason
        return Signals(
            primary_ok=primary_ok, fallback_ok=fallback_ok, pressure=pressure, detail=detail
        )

    def evaluate(self, window: bool = False) -> Transition | None:
        """Feed the ladder. On window ticks also advance the pressure
        hysteresis and the throttle controller (once per window, by design)."""
        throttle = self.policy.ladder.throttle
        if window and throttle.enabled:
            self.pressure.evaluate()
        t = self.ladder.evaluate(self.signals(throttle.enabled and self.pressure.active))
        throttled = self.ladder.tier == "throttle"
        self.admission.shed_sheddable = throttled
        if window:
            before = self.admission.limit
            self.admission.set_limit(
                next_limit(
                    throttle,
                    self.admission.limit,
                    throttled=throttled,
                    pressure=self.pressure.active,
                )
            )
            if self.recorder is not None and self.admission.limit != before:
                self.recorder.put(("limit", self.clock(), before, self.admission.limit))
        return t

    def evaluate_soon(self) -> None:
        """Re-evaluate right after the current callback (a breaker just moved):
        detection should not wait for the next window."""
        if self._evaluate_soon is None:
            loop = asyncio.get_running_loop()
            self._evaluate_soon = loop.call_soon(self._evaluate_now)

    def _evaluate_now(self) -> None:
        self._evaluate_soon = None
        try:
            self.evaluate()
        except Exception as exc:  # a loop callback: asyncio would only print it
            self.tasks.failed("evaluate_soon", exc)

    def report_success(self, up: Upstream, *, permit: Permit) -> None:
        b = up.breaker_of(permit)
        b.record_success(permit)
        if up.judge.ledgers:
            led = up.judge.ledgers.get(id(b))
            if led is not None and led.streak:
                # A success ended the streak: a streak several clients saw was
                # the backend's (transient); one client's alone, that client's.
                streak = led.streak_over()
                if len({h.client for h in streak}) > 1:
                    for h in streak:
                        self._charge_backend(up, h.fault)
                else:
                    self._absolved(up, streak, "a success ended one client's failure streak")

    def report_failure(
        self,
        up: Upstream,
        kind: str,
        detail: str = "",
        *,
        permit: Permit,
        suspect: bool = False,
        client: str = "",
        rid: str = "",
    ) -> None:
        """A failure charged to the backend (`proxy.control.attribution`).
        `permit` is what `up.breaker_for(model).allow()` gave this call: the
        outcome goes to the breaker that issued it and counts only in the
        epoch that admitted it. A `suspect` failure that would open a closed
        breaker is first corroborated by the backend's recovery probe (the
        ledger decides). Only a failure the backend's own breaker counted can
        roll back a ramp towards it: not one admitted before it recovered,
        nor one model's failure (per-model breakers keep it from the
        backend's other models)."""
        self.metrics.upstream_errors.labels(up.name, kind).inc()  # what it showed
        b = up.breaker_of(permit)
        if suspect and b.policy.corroborate:
            led = up.judge.ledger(b)
            decision = led.decide(self.clock(), client, b.would_open(permit))
            if decision in ("hold", "probe"):
                led.held.append(Held(kind, detail, client, rid))
                if decision == "probe":
                    led.start_probe(self.clock())
                    self.spawn(self._corroborate(up, b, led), f"corroborate_{up.name}")
                return
            if decision == "absolve":
                held = led.absolve(Held(kind, detail, client, rid))
                self._absolved(up, held, "a recent probe succeeded; one client's failures")
                b.absolve()
                return
            # Counted by the breaker now; charged when its streak is judged.
            led.suspect(Held(kind, detail, client, rid))
            self._count_failure(up, b, permit, kind, detail)
            if b.state != "closed":  # it opened: the streak was the backend's
                for h in led.streak_over():
                    self._charge_backend(up, h.fault)
            return
        self._charge_backend(up, kind)
        self._count_failure(up, b, permit, kind, detail)

    def _count_failure(
        self, up: Upstream, b: BackendBreaker, permit: Permit | None, kind: str, detail: str
    ) -> None:
        counted = b.outcomes
        reason = f"{kind}: {detail}" if detail else kind
        if permit is None:
            if b.state != "open":  # closed, or half-open with its trial held
                b.force_open(reason)
        else:
            b.record_failure(permit, reason)
        if b.outcomes != counted and b is up.breaker:
            self.ladder.report_failure(up.name)

    def check_engine(self, up: Upstream, permit: Permit, held: Held) -> bool:
        """A non-streaming answer outlived `timeouts.total_s`: the request's
        length, unless the engine hung — so the recovery probe goes out (at
        most one per breaker per `reset_timeout_s`) and its verdict charges
        `held`. False when no probe may go now (then it is the request's)."""
        b = up.breaker_of(permit)
        if b.state != "closed" or not b.policy.corroborate:
            return False
        led = up.judge.ledger(b)
        now = self.clock()
        if led.probing or (
            led.last_probe_at is not None and now - led.last_probe_at < led.window_s
        ):
            return False
        led.held.append(held)
        led.start_probe(now)
        self.spawn(self._corroborate(up, b, led), f"corroborate_{up.name}")
        return True

    def forgive(self, up: Upstream, permit: Permit, rid: str) -> None:
        """Request `rid` failed everywhere while every probe passed: its
        failure on `up` is taken back from the breaker's streak and counted
        as the request's (one the probe out now holds is judged by it)."""
        b = up.breaker_of(permit)
        led = up.judge.ledgers.get(id(b))
        if led is None:
            return
        mine = [h for h in led.streak if h.rid == rid]
        if not mine:
            return
        led.streak = [h for h in led.streak if h.rid != rid]
        b.forgive(permit)
        self._absolved(up, mine, "failed on every backend while their probes passed")

    def _charge_backend(self, up: Upstream, fault: str) -> None:
        """A failure judged the backend's."""
        self.metrics.failures.labels(up.name, "backend", fault).inc()

    def report_charged(self, up: Upstream, attribution: str, fault: str) -> None:
        """A failure charged to the request or to load: counted, never judged."""
        self.metrics.failures.labels(up.name, attribution, fault).inc()

    async def _corroborate(
        self, up: Upstream, b: BackendBreaker, led: Ledger, since: float | None = None
    ) -> None:
        """The ledger held suspect failures that would open `b`: ask the
        backend's recovery probe (for the breaker's model, or the traffic's;
        `since`: one started at or after that loop time)."""
        try:
            why = await up.shared_probe(b.model, since)
        except asyncio.CancelledError:
            # Shutting down (or a reload's cleanup): no verdict, nothing opens.
            for h in led.probe_done(False, all_held=True):
                self._charge_backend(up, h.fault)
            raise
        ok = None if isinstance(why, ProbeMisconfigured) else why is None
        held = led.probe_done(ok is True)
        if ok:
            self.metrics.corroborations.labels(up.name, "absolved").inc()
            self._absolved(up, held, "recovery probe succeeded")
            b.absolve()
            return
        result = "unknown" if ok is None else "confirmed"
        self.metrics.corroborations.labels(up.name, result).inc()
        probe = f"recovery probe: {why}" if ok is not None else "probe misconfigured"
        log.warning(
            "failures_corroborated", backend=up.name, model=b.model, failures=len(held), probe=probe
        )
        for h in held:
            self._charge_backend(up, h.fault)
        if held and b.state != "open":
            h = held[-1]
            self._count_failure(up, b, None, h.fault, f"{h.detail} ({probe})".strip())
        if led.held:
            # Failures held after the failed probe had started: a probe of
            # their own judges them (the backend may have recovered meanwhile).
            led.start_probe(self.clock())
            since = asyncio.get_running_loop().time()
            self.spawn(self._corroborate(up, b, led, since), f"corroborate_{up.name}")

    def _absolved(self, up: Upstream, held: list[Held], why: str) -> None:
        for h in held:
            self.metrics.failures.labels(up.name, "request", h.fault).inc()
        if held:
            log.warning(
                "failures_absolved",
                backend=up.name,
                failures=len(held),
                faults=sorted({h.fault for h in held}),
                request_ids=[h.rid for h in held][:8],
                reason=why,
            )

    def on_model_breaker_change(
        self, name: str, model: str, old: str, new: str, reason: str
    ) -> None:
        self.metrics.model_breaker_state.labels(name, model).set(STATE_VALUES[new])
        if old == new:
            return  # just created
        if self.recorder is not None:
            self.recorder.put(("breaker", self.clock(), name, model, old, new, reason))
        self.metrics.model_breaker_transitions.labels(name, model, old, new).inc()
        log.warning("breaker_changed", backend=name, model=model, old=old, new=new, reason=reason)
        if new == "open" and self.shared is not None and not self._applying_remote:
            ttl = self.policy.ladder.breaker.reset_timeout_s
            publish = self.shared.publish_breaker_open(name, reason, ttl, model=model)
            with contextlib.suppress(RuntimeError):
                self.spawn(publish, "shared_publish")
        # All of a backend's models out makes it unavailable: the ladder looks.
        with contextlib.suppress(RuntimeError):
            self.evaluate_soon()

    def on_breaker_change(self, name: str, old: str, new: str, reason: str) -> None:
        if self.recorder is not None:
            self.recorder.put(("breaker", self.clock(), name, None, old, new, reason))
        self.metrics.breaker_transitions.labels(name, old, new).inc()
        log.warning("breaker_changed", backend=name, old=old, new=new, reason=reason)
        if new == "open" and self.shared is not None and not self._applying_remote:
            ttl = self.policy.ladder.breaker.reset_timeout_s
            with contextlib.suppress(RuntimeError):
                self.spawn(self.shared.publish_breaker_open(name, reason, ttl), "shared_publish")
        # No running loop only in unit tests of the breaker alone.
        with contextlib.suppress(RuntimeError):
            self.evaluate_soon()

    def _on_transition(self, t: Transition) -> None:
        if self.recorder is not None:
            self.recorder.put(("tier", t.at, t.from_tier, t.to_tier, t.reason, t.detail))
        self.metrics.transitions.labels(t.from_tier, t.to_tier, t.reason).inc()
        log.warning(
            "tier_changed",
            from_tier=t.from_tier,
            to_tier=t.to_tier,
            reason=t.reason,
            detail=t.detail,
        )

    def wall(self, clock_time: float) -> float:
        return round(clock_time + self._wall_offset, 3)

    def count_request(self, backend: str, endpoint: str, status: int) -> None:
        key = (backend, endpoint, status)
        child = self._request_counters.get(key)
        if child is None:
            child = self.metrics.requests.labels(backend, endpoint, str(status))
            self._request_counters[key] = child
        child.inc()

    # -- status ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return status_of(self)


def _breaker_gauge(up: Upstream) -> Callable[[], float]:
    return lambda: STATE_VALUES[up.breaker.state]


def _why(up: Upstream) -> str:
    if up.breaker.state != "closed":
        return f"{up.name} breaker {up.breaker.state}: {up.breaker.last_reason}"
    return f"{up.name} health: {up.health.last_error}"


def request_id(incoming: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, a fresh one otherwise."""
    if incoming and _REQUEST_ID_RE.match(incoming):
        return incoming
    # 128 random bits as 32 hex digits, like uuid4().hex without its
    # Python-level UUID object (a fifth of the cost, on every request).
    return os.urandom(16).hex()
