"""One replay: a trace's arrivals through the real control code on a virtual clock.

The decisions are Brownout's own objects, unchanged: the `Ladder`, one
`BackendBreaker` and `RetryBudget` per backend, the `Admission` limiter
(its synchronous steps, with the replay's own `Slot`s), the
`PressureMonitor` and `next_limit`, and the pipeline's retry rule
`next_step`. What `Runtime` and the pipeline do around them — route a
request (tier, ramp, breaker permits, candidates in order), evaluate every
`window_s` (recovery probes of open breakers first), re-evaluate when a
breaker moves, probe health every `health.interval_s`, read vLLM's gauges
every `scrape_interval_s`, retry or fail over, rescue a stream cut
mid-answer on the fallback, answer from maintenance — is repeated here in
a few lines each, on events in a heap instead of coroutines. Backends are
`proxy.replay.world`'s models.

Attribution: a refused connection counts against its breaker at once; any
other backend fault is suspect, and one that would open the breaker is
corroborated as `Runtime.report_failure` does it (the control code's
`Ledger`): the backend's recovery probe goes out, answered by the world
model at that instant (a hung backend keeps it until the hang ends or its
`first_byte_s` runs out), and a probe that passes charges the failures to
their requests. Limits: the world model does not know which recorded
failures were client-shaped (a poison request's 5xx is evidence of an
erroring backend there, drawn by any request at its share), and every
fault the replay sees is suspect but a refused connection (the proxy also
takes an engine's death or out-of-memory in an error body as definitive:
there the replay's probe of the dead backend fails at once all the same).

A request whose first recorded attempt a backend refused before sending it
(its context past the backend's window) is refused there again and goes
on to the next candidate. A stream whose first recorded attempt ended in a
first-byte timeout after the proxy had begun the client's answer (headers,
heartbeats), not rescued, ends so again if the replay times it out there:
a client error, not a failover.

Not replayed (documented limits): per-model breakers, a gray release (the
candidate's requests are replayed on the primary), sessions and trimming
(context-length refusals are the recorded ones; the proxy's own time before
the backend call is in the replayed TTFT as recorded), the output guard,
and policy reloads inside the trace that change the ladder (a replay of the
recorded policy takes those that change only the backends' settings —
timeouts, health probes — at their instants; a candidate runs its own
throughout). Operator actions (a forced tier, a release) are replayed at
their times.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from proxy.control.admission import Admission, Rejected, Waiter
from proxy.control.attribution import DEFINITIVE, Held, Ledger
from proxy.control.breaker import BackendBreaker, Permit
from proxy.control.ladder import RANK, TIERS, Destination, Ladder, Signals, Transition
from proxy.control.pressure import EngineGauges, PressureMonitor, next_limit
from proxy.control.retrybudget import RetryBudget
from proxy.pipeline.attempts import next_step
from proxy.pipeline.record import AttemptResult
from proxy.policy import BackendPolicy, Policy, PolicyError
from proxy.replay.observed import ObservedWaits, RecordedBaseline
from proxy.replay.trace import Request, Trace, policy_from_knobs
from proxy.replay.world import RESUME_S, BackendWorld, Outcome, World

TAIL_S = 5.0  # the replay runs this long past the last record
EXACT_SLACK = 4.0  # with records lost: a recorded turn this many periods late is still the next one
SERIES_S = 1.0  # resolution of the time series in the report


@dataclass(slots=True)
class Health:
    healthy: bool | None = None
    definitive: bool = False
    failures: int = 0
    error: str | None = None


class Backend:
    """A backend of the replay: its breaker, budget and health (as `Upstream`)."""

    def __init__(self, name: str, bp: BackendPolicy, pol: Policy, sim: Sim, world: BackendWorld):
        self.name = name
        self.policy = bp
        self.world = world
        self.breaker = BackendBreaker(name, pol.ladder.breaker, sim.clock, sim.on_breaker)
        self.budget = RetryBudget()
        self.health = Health()
        self.probe_failures = pol.ladder.failover.probe_failures
        self.first_byte_s = bp.timeouts.first_byte_s
        self.idle_s = bp.timeouts.idle_s
        self.inflight = 0
        self.probing = False
        bk = pol.ladder.breaker
        self.corroborate = bk.corroborate
        self.ledger = Ledger(bk.reset_timeout_s, bk.min_clients)

    @property
    def down(self) -> bool:
        h = self.health
        if h.healthy is None or h.healthy:
            return False
        return h.definitive or h.failures >= self.probe_failures

    @property
    def available(self) -> bool:
        return not self.down and self.breaker.state == "closed"


class _Slot:
    """An admission waiter's wake-up on the virtual clock (`admission.Slot`)."""

    __slots__ = ("_done", "_exc", "flight", "sim")

    def __init__(self, sim: Sim, flight: Flight) -> None:
        self.sim, self.flight = sim, flight
        self._done = False
        self._exc: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._exc

    def set_result(self, result: None, /) -> None:
        self._done = True
        self.sim.at(self.sim.now, self.sim.admitted, self.flight)

    def set_exception(self, exception: BaseException, /) -> None:
        self._done = True
        self._exc = exception
        reason = exception.reason if isinstance(exception, Rejected) else "evicted"
        self.sim.at(self.sim.now, self.sim.shed_waiter, self.flight, reason)


class Flight:
    """One request on its way (the replay's `RequestRecord`). One per
    request: slots, each set once in `__init__` (a class's defaults read
    through an instance are looked up generically on every read; a
    dataclass's `__init__` costs its arguments)."""

    __slots__ = (
        "arrived",
        "backend",
        "cut",
        "deadline",
        "done",
        "failed",
        "idx",
        "order",
        "permit",
        "pre_paid",
        "prepared",
        "q",
        "retries",
        "sent_at",
        "slot",
        "started",
        "waiter",
    )

    def __init__(self, q: Request, order: list[Backend], arrived: float = 0.0) -> None:
        self.q, self.order, self.arrived = q, order, arrived
        self.idx = self.retries = 0
        self.permit: Permit | None = None
        self.backend: Backend | None = None
        self.waiter: Waiter | None = None
        self.slot = False  # holds an admission slot
        self.done = False
        self.failed = False  # some attempt failed before the first byte (the last result)
        self.cut = False
        self.prepared = False  # its own time before the first call is spent (or under way)
        self.pre_paid = False  # ... and that was its recorded `pre` (not again in its TTFT)
        self.sent_at = 0.0
        self.started = 0.0  # the current candidate's first admission
        self.deadline = 0.0  # the current attempt's first-byte deadline


@dataclass
class Run:
    """What one replay did, for the report."""

    policy: Policy
    duration: float
    tiers: list[tuple[float, str]] = field(default_factory=list)  # (t, tier) at each change
    transitions: list[tuple[float, str, str, str]] = field(default_factory=list)
    requests: int = 0
    answered: dict[str, int] = field(default_factory=lambda: {"primary": 0, "fallback": 0})
    client_errors: int = 0
    maintenance_answers: int = 0
    shed: dict[str, int] = field(
        default_factory=lambda: {"critical": 0, "normal": 0, "sheddable": 0}
    )
    failovers: int = 0
    rescues: int = 0
    intrinsic: int = 0
    client_gone: int = 0
    ttfts: list[float] = field(default_factory=list)
    # Per-second series for the HTML report.
    series: dict[str, list[float]] = field(default_factory=dict)
    ttft_t: list[float] = field(default_factory=list)  # arrival of each answered request


class Sim:
    def __init__(self, policy: Policy, trace: Trace, world: World, seed: int = 0) -> None:
        self.policy = policy
        self.trace = trace
        self.now = 0.0
        # The control code's clock: `self.now`, read without a Python frame.
        self.clock: Callable[[], float] = functools.partial(getattr, self, "now")
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.run = Run(policy, trace.end)
        lad = policy.ladder
        self.ladder = Ladder(lad.recovery, self.clock, self.on_transition)
        self.ladder.tier = trace.initial_tier  # type: ignore[assignment]
        self.pressure = PressureMonitor(lad.throttle, self.clock)
        base = RecordedBaseline.of(trace, policy)
        if base is not None:  # (the recorded proxy's TTFT history: `RecordedBaseline`)
            self.pressure.ttft_base = base
        self.admission = Admission(lad.throttle, self.clock, self.on_wait)
        self._observed = ObservedWaits(trace, policy)
        self._pre = self._observed.pre  # the proxy's own time before the call
        self._gap = self._observed.gap  # ... after a queued request's slot came
        self.backends: dict[str, Backend] = {}
        for name in ("primary", "fallback"):
            bp = getattr(policy.backends, name)
            if bp is not None:
                self.backends[name] = Backend(name, bp, policy, self, world.backends[name])
        self.primary = self.backends["primary"]
        self.fallback = self.backends.get("fallback")
        self._fo = lad.failover
        self._throttle = lad.throttle
        self._orders()
        self._attempt_end = self.attempt_end  # (bound once: one per attempt otherwise)
        self._eval_soon = False
        self._next_of: dict[int, Request] = {}
        self._overlaps: dict[int, Request] = {}
        self.run.tiers.append((0.0, self.ladder.tier))
        knobs = trace.recorded_policy or {}
        self._recorded_window = knobs.get("ladder.recovery.window_s")
        self._recorded_scrape = knobs.get("ladder.throttle.scrape_interval_s")
        self._stalls = trace.stalls()
        self._stall_starts = [a for a, _ in self._stalls]
        self._scrapes = sorted([e.t for e in trace.engine] + trace.scrape_failures)
        self._probe_times: dict[str, list[float]] = {}
        self._recorded_probe: dict[str, object] = {}
        for p in trace.probes:
            self._probe_times.setdefault(p.backend, []).append(p.t)
        for name in self._probe_times:
            self._recorded_probe[name] = knobs.get(f"backends.{name}.health.interval_s")
        self._scrape_fails = sorted(trace.scrape_failures)

    # -- the clock ------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def periodic(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Schedule a loop's next turn; one due while the recorded proxy's
        event loop stood still runs when it moved again."""
        stalls = self._stalls
        if stalls:
            i = bisect.bisect_right(self._stall_starts, t) - 1
            if i >= 0 and stalls[i][0] < t < stalls[i][1]:
                t = stalls[i][1]
        self.at(t, fn, *args)

    def replay(self) -> Run:
        end = self.trace.end + TAIL_S
        lad = self.policy.ladder
        self.at(self._next_tick(), self.tick)  # (at 0: the first recorded one, else window_s)
        for b in self.backends.values():
            first = (self._probe_times.get(b.name) or [0.0])[0]
            anchored = self._anchored_probes(b) and first < b.policy.health.interval_s
            self.at(first if anchored else 0.0, self.health_probe, b)
        if self.primary.policy.kind == "vllm" and lad.throttle.scrape_interval_s > 0:
            first = self._scrapes[0] if self._scrapes else 0.0
            self.at(first if first < lad.throttle.scrape_interval_s else 0.0, self.scrape)
        self.at(0.0, self.sample)
        for t, seconds, counts in self._observed.waits:
            self.at(t, self.observed_wait, seconds, counts)
        for t, tier in self.trace.forces:
            self.at(t, self.force, tier)
        for t, p in _reloads(self.trace, self.policy):
            self.at(t, self.reload, p)
        reqs = self._sessions()
        heap = self._heap
        pop = heapq.heappop
        arrive = self.arrive
        # The arrivals, each after the events due before it (at the same
        # instant an arrival comes first)...
        for q in reqs:
            ta = q.t
            while heap and heap[0][0] < ta:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(*args)
            self.now = ta
            arrive(q)
        # ... then the events left (the loops' turns past the end dropped).
        loops = (self.tick, self.health_probe, self.scrape, self.sample)
        while heap:
            t, _, fn, args = pop(heap)
            if t > end and fn in loops:
                continue
            self.now = t
            fn(*args)
        self.run.duration = self.trace.end
        return self.run

    # -- periodic work -----------------------------------------------------------------

    def tick(self) -> None:
        """`Evaluator.tick`: recovery probes due, then one window's evaluation."""
        if self.policy.ladder.failover.recovery_probe:
            for b in self.backends.values():
                br = b.breaker
                if b.probing or br.state == "closed":
                    continue
                if br.state == "open" and self.now < br.retry_at():
                    continue
                permit = br.allow()
                if permit is not None:
                    b.probing = True
                    ok, definitive, err, took = self._recovery(b)
                    self.at(
                        self.now + took, self.recovery_probe_done, b, permit, ok, definitive, err
                    )
        self.evaluate(window=True)
        self.periodic(self._next_tick(), self.tick)

    def _recovery(self, b: Backend) -> tuple[bool, bool, str | None, float]:
        """(ok, definitive, error, seconds it takes) of the backend's recovery
        probe (a 1-token chat) sent now: a hung backend keeps it until the
        hang ends, up to its `first_byte_s`."""
        w = b.world
        ok, definitive, err, took = w.probe(self.now)
        seg = w.segment(self.now)
        if seg.state == "hung":
            wait = w._hang_end(self.now) - self.now + RESUME_S
            if wait < b.first_byte_s:
                return True, False, None, wait
            return False, False, "TimeoutError", b.first_byte_s
        if ok and seg.state == "down":
            ok = False
        took += w.ttft(1) if ok else 0.0
        return ok, definitive, err, took

    def _next_tick(self) -> float:
        w = self.policy.ladder.recovery.window_s
        return self._aligned(w, self.trace.ticks, self._recorded_window, self.trace.exact_ticks)

    def _aligned(
        self, w: float, anchors: list[float], recorded_w: object, exact: bool = True
    ) -> float:
        """When a loop's next turn comes: with the recorded period, at the
        recorded turn — the next one when every turn was recorded (`exact`:
        the recorded loop's own pace, lags of a busy host included), else a
        known one near `now + w` (its phase); otherwise `now + w`."""
        nxt = self.now + w
        if anchors and w == recorded_w:
            if exact:
                # Every turn was recorded: the next recorded one is the next
                # turn, however late the recorded loop ran it (a busy host) —
                # unless the recorder lost records (then a turn may be missing).
                i = bisect.bisect_right(anchors, self.now)
                if i < len(anchors) and (
                    not self.trace.gaps or anchors[i] <= self.now + EXACT_SLACK * w
                ):
                    return anchors[i]
                return nxt
            i = bisect.bisect_left(anchors, nxt - w / 2)
            if i < len(anchors) and anchors[i] <= nxt + w / 2 and anchors[i] > self.now:
                return anchors[i]
        return nxt

    def recovery_probe_done(
        self, b: Backend, permit: Permit, ok: bool, definitive: bool, err: str | None
    ) -> None:
        b.probing = False
        self._set_health(b, ok, definitive, err)
        if ok:
            b.breaker.record_success(permit)
        else:
            b.breaker.record_failure(permit, f"recovery probe: {err}")
        b.breaker.release_trial(permit)

    def health_probe(self, b: Backend) -> None:
        ok, definitive, err, took = b.world.probe(self.now)
        if self._anchored_probes(b):
            took = 0.0  # the recorded instants are the probes' ends
        took = min(took, b.policy.health.timeout_s)
        self.at(self.now + took, self._probed, b, ok, definitive, err)

    def _anchored_probes(self, b: Backend) -> bool:
        return bool(self._probe_times.get(b.name)) and (
            b.policy.health.interval_s == self._recorded_probe.get(b.name)
        )

    def _probed(self, b: Backend, ok: bool, definitive: bool, err: str | None) -> None:
        self._set_health(b, ok, definitive, err)
        anchors = self._probe_times.get(b.name, [])
        recorded = self._recorded_probe.get(b.name)
        nxt = self._aligned(b.policy.health.interval_s, anchors, recorded)
        self.periodic(nxt, self.health_probe, b)

    def _set_health(self, b: Backend, ok: bool, definitive: bool, err: str | None) -> None:
        h = b.health
        h.healthy, h.definitive, h.error = ok, definitive, err
        h.failures = 0 if ok else h.failures + 1

    def scrape(self) -> None:
        p = self.primary
        interval = self.policy.ladder.throttle.scrape_interval_s
        fails = self._scrape_fails
        i = bisect.bisect_left(fails, self.now - interval / 2)
        if i < len(fails) and fails[i] <= self.now + interval / 2:
            # The recorded scrape near this instant failed (vLLM's /metrics did
            # not answer): the gauges stay what they were, as in `scrape_forever`.
            pass
        else:
            w, r, kv = p.world.gauges(self.now, p.inflight)
            self.pressure.update_engine(EngineGauges(waiting=w, running=r, kv_cache=kv))
            self._gauges = (w, r, kv)
        interval = self.policy.ladder.throttle.scrape_interval_s
        self.periodic(self._aligned(interval, self._scrapes, self._recorded_scrape), self.scrape)

    _gauges: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def sample(self) -> None:
        s = self.run.series
        for key, value in (
            ("t", self.now),
            ("tier", float(RANK[self.ladder.tier])),
            ("limit", float(self.admission.limit)),
            ("inflight_primary", float(self.primary.inflight)),
            ("inflight_fallback", float(self.fallback.inflight if self.fallback else 0)),
            ("queued", float(self.admission.queued)),
            ("waiting", self._gauges[0]),
            ("kv", self._gauges[2]),
        ):
            s.setdefault(key, []).append(value)
        self.at(self.now + SERIES_S, self.sample)

    def reload(self, policy: Policy) -> None:
        """A recorded reload that changed only the backends' settings (their
        timeouts, health probes): taken by a replay of the recorded policy."""
        for name, b in self.backends.items():
            bp = getattr(policy.backends, name)
            if bp is not None:
                b.policy = bp
                b.first_byte_s = bp.timeouts.first_byte_s
                b.idle_s = bp.timeouts.idle_s

    def force(self, tier: str | None) -> None:
        self.ladder.force(tier if tier in TIERS else None)  # type: ignore[arg-type,unused-ignore]
        if tier is None:
            self.evaluate()

    # -- the ladder (as Runtime.signals / evaluate / route) -----------------------------

    def signals(self, pressure: bool) -> Signals:
        p, f = self.primary, self.fallback
        primary_ok = p.available or not self.policy.ladder.failover.enabled
        return Signals(primary_ok, f is not None and f.available, pressure)

    def evaluate(self, window: bool = False) -> None:
        throttle = self.policy.ladder.throttle
        if window and throttle.enabled:
            self.pressure.evaluate()
        self.ladder.evaluate(self.signals(throttle.enabled and self.pressure.active))
        throttled = self.ladder.tier == "throttle"
        self.admission.shed_sheddable = throttled
        if window:
            self.admission.set_limit(
                next_limit(
                    throttle,
                    self.admission.limit,
                    throttled=throttled,
                    pressure=self.pressure.active,
                )
            )

    def on_breaker(self, name: str, old: str, new: str, reason: str) -> None:
        if not self._eval_soon:
            self._eval_soon = True
            self.at(self.now, self._evaluate_soon)

    def _evaluate_soon(self) -> None:
        self._eval_soon = False
        self.evaluate()

    def on_transition(self, t: Transition) -> None:
        self.run.transitions.append((t.at, t.from_tier, t.to_tier, t.reason))
        self.run.tiers.append((t.at, t.to_tier))

    def on_wait(self, seconds: float, counts: bool) -> None:
        """A wait the replay's own admission modelled: the pressure signal,
        unless the recorded waits stand in for it now (`ObservedWaits`)."""
        if not self._follows_recording():
            self.pressure.record_queue_wait(seconds, self.admission.limit, counts)

    def observed_wait(self, seconds: float, counts: bool) -> None:
        """A wait the recorded proxy's admission queue saw, at the instant it
        ended (`counts`: the proxy took it as engine pressure when it queued):
        the pressure signal while the replay is where the recording was."""
        if self._follows_recording():
            self.pressure.record_queue_wait(seconds, self.admission.limit, counts)

    def _follows_recording(self) -> bool:
        o = self._observed
        return o.usable and o.agrees(self.now, self.ladder.tier, self.admission.limit)

    def route(self) -> tuple[Destination, list[Backend]]:
        """Where a request goes and its candidates in order (lists shared by
        the requests: never changed in place)."""
        dest = self.ladder.route()
        return dest, self._order_of(dest)

    def _order_of(self, dest: Destination) -> list[Backend]:
        if dest == "maintenance":
            return []
        p, f = self.primary, self.fallback
        if dest == "primary" or f is None:
            return self._order_p
        fo = self._fo
        if (
            not fo.recovery_probe
            and p.breaker.state != "closed"
            and (p.breaker.state == "half-open" or self.now >= p.breaker.retry_at())
            and self.ladder.forced is None
        ):
            return self._order_pf
        return self._order_fp

    def _orders(self) -> None:
        p, f = self.primary, self.fallback
        fo = self._fo

        def cut(order: list[Backend]) -> list[Backend]:
            if not fo.on_connect_error:
                order = order[:1]
            return order[: fo.max_attempts]

        self._order_p = cut([p] if f is None else [p, f])
        self._order_pf = cut([p] if f is None else [p, f])
        self._order_fp = cut([p] if f is None else [f, p])

    # -- a request ------------------------------------------------------------------

    def arrive(self, q: Request) -> None:
        run = self.run
        run.requests += 1
        if self._overlaps:
            self._overlap(q)
        # `route`, inline for the primary (every request of a normal tier).
        dest = self.ladder.route()
        order = self._order_p if dest == "primary" else self._order_of(dest)
        if dest == "maintenance":
            self.finish_maintenance(q)
            self._ended(q)
            return
        outcome, status = q.outcome, q.status
        if outcome == "rejected" or (  # `q.intrinsic`, inline
            400 <= status < 500 and status != 429 and not outcome.startswith("shed")
        ):
            run.intrinsic += 1  # the same refusal under any policy
            self._ended(q)
            return
        f = Flight(q, order, self.now)
        if outcome == "client_disconnect":  # `q.client_gone`
            self.at(self.now + q.duration, self.client_left, f)
        self.next_candidate(f)

    # -- sessions: a client's next question waits for its previous answer ------------

    def _done(self, f: Flight) -> None:
        if not f.done:
            f.done = True
            self._ended(f.q)

    def _ended(self, q: Request) -> None:
        """`q` is over: its session's next request follows after the recorded
        pause (see `sessions`)."""
        nxt = self._next_of.pop(id(q), None)
        if nxt is None:
            return
        recorded_end = q.t + q.duration
        if nxt.t >= recorded_end:
            # Never before its recorded time (a replay invents no load: a
            # client whose answers come sooner is not taken to ask more).
            self.at(max(nxt.t, self.now + (nxt.t - recorded_end)), self.arrive, nxt)
        # (an overlapping one was scheduled when `q` arrived)

    def _sessions(self) -> list[Request]:
        """Arrivals: requests without a session (and each session's first) at
        their recorded times; a session's later request at the recorded pause
        after its previous one ended in this replay, but never before its
        recorded time — or, if the two overlapped in the recording, at the
        recorded offset from its arrival (scheduled by `_overlap`)."""
        by: dict[str, list[Request]] = {}
        free: list[Request] = []
        for q in self.trace.requests:
            (by.setdefault(q.session, []) if q.session else free).append(q)
        for reqs in by.values():
            free.append(reqs[0])
            for a, b in itertools.pairwise(reqs):
                if b.t >= a.t + a.duration:
                    self._next_of[id(a)] = b
                else:
                    self._overlaps[id(a)] = b
        free.sort(key=_ARRIVAL)
        return free

    def _overlap(self, q: Request) -> None:
        b = self._overlaps.pop(id(q), None)
        if b is not None:
            self.at(self.now + (b.t - q.t), self.arrive, b)

    def next_candidate(self, f: Flight) -> None:
        order = f.order
        first = f.q.attempts[0] if f.q.attempts else None
        while f.idx < len(order):
            b = order[f.idx]
            if first is not None and first.kind == "refused" and first.backend == b.name:
                # Refused there for its own sake (its context past the
                # backend's window: it was never sent): the same now.
                f.idx += 1
                continue
            permit = b.breaker.allow()
            if permit is None:
                f.idx += 1
                continue
            f.permit, f.backend = permit, b
            if f.retries == 0:
                f.started = self.now
            throttle = self._throttle
            if b is self.primary and throttle.enabled:
                q = f.q
                try:
                    if not self.admission.admit(q.priority, q.client):  # type: ignore[arg-type]
                        f.waiter = self.admission.enqueue(
                            q.priority,  # type: ignore[arg-type]
                            q.client,
                            _Slot(self, f),
                        )
                        self.at(self.now + throttle.queue_timeout_s, self.queue_timeout, f)
                        return
                except Rejected as r:
                    self.shed(f, r.reason)
                    return
                f.slot = True
            if not f.prepared:
                # The proxy's own time before its first backend call (the
                # request's payload), its slot held: as recorded.
                f.prepared = True
                pre = self._pre.get(id(f.q), 0.0) if self._pre else 0.0
                if pre > 0.0:
                    f.pre_paid = True
                    self.at(self.now + pre, self._send_prepared, f, b)
                    return
            self.send(f, b)
            return
        self.unanswered(f)

    def _send_prepared(self, f: Flight, b: Backend) -> None:
        if f.done:  # the client left meanwhile: the slot and the permit go back
            if f.slot:
                f.slot = False
                self.admission.release(f.q.client)
            b.breaker.release_trial(f.permit)
            return
        self.send(f, b)

    def admitted(self, f: Flight) -> None:
        w = f.waiter
        f.waiter = None
        if f.done:  # the client left meanwhile: the slot goes back
            self.admission.release(f.q.client)
            return
        f.slot = True
        if w is not None:
            self.admission.waited(w)
        assert f.backend is not None
        if not f.prepared:
            # A queued request's own time from its slot to the call (`ObservedWaits.gap`).
            f.prepared = True
            gap = self._gap.get(id(f.q), 0.0) if self._gap else 0.0
            if gap > 0.0:
                self.at(self.now + gap, self._send_prepared, f, f.backend)
                return
        self.send(f, f.backend)

    def queue_timeout(self, f: Flight) -> None:
        w = f.waiter
        if w is None or w.future.done():
            return
        self.admission.abandon(w)
        f.waiter = None
        self.shed(f, "queue_timeout")

    def shed_waiter(self, f: Flight, reason: str) -> None:
        f.waiter = None
        self.shed(f, reason)

    def shed(self, f: Flight, reason: str) -> None:
        b = f.backend
        if b is not None:
            b.breaker.release_trial(f.permit)
        if f.done:
            return
        if f.retries:
            # A retry's slot went to another request: the next backend (`next_step`).
            f.idx += 1
            f.retries = 0
            self.next_candidate(f)
            return
        self._done(f)
        self.run.shed[f.q.priority] = self.run.shed.get(f.q.priority, 0) + 1

    def send(self, f: Flight, b: Backend) -> None:
        # The first attempt's first-byte deadline starts after admission; a
        # retry keeps the candidate's, from before its first admission
        # (`run_attempts`).
        now = self.now
        fb = b.first_byte_s
        if f.retries == 0:
            deadline = f.deadline = now + fb
            b.budget.request(now, self._fo.retry_budget_window_s)
        else:
            deadline = f.deadline = f.started + fb
        b.inflight += 1
        f.sent_at = now
        first_byte = deadline - now
        if first_byte < 0.0:  # (max(0.0, ...), inline)
            first_byte = 0.0
        out = b.world.call(f.q, now, b.inflight, first_byte, b.idle_s, self.rng)
        self._seq += 1  # (`at`, inline)
        heapq.heappush(self._heap, (out.end, self._seq, self._attempt_end, (f, b, out)))

    def _release(self, f: Flight, b: Backend) -> None:
        b.inflight -= 1
        if f.slot:
            f.slot = False
            self.admission.release(f.q.client)

    def attempt_end(self, f: Flight, b: Backend, out: Outcome) -> None:
        b.inflight -= 1  # (`_release`, inline)
        if f.slot:
            f.slot = False
            self.admission.release(f.q.client)
        permit = f.permit
        assert permit is not None
        if f.done:  # the client left: no outcome
            b.breaker.release_trial(permit)
            return
        if out.kind == "ok":
            first = out.first
            assert first is not None
            ttft = first - f.sent_at
            fo = self._fo
            q = f.q
            stream = q.stream
            if stream and b is self.primary:
                self.pressure.record_ttft(ttft)
            if stream and fo.ttft_limit_s and ttft > fo.ttft_limit_s:
                self.failure(b, permit, "slow_ttft", q.client)
            else:
                b.breaker.record_success(permit)
                if b.ledger.streak:  # a success ends a failure streak (`report_success`)
                    b.ledger.streak_over()
            # `answer`, inline: done, the session's next, the counts, the TTFT.
            f.done = True
            if self._next_of:
                self._ended(q)
            run = self.run
            name = b.name
            run.answered[name] = run.answered.get(name, 0) + 1
            if b is self.fallback:
                run.failovers += 1
            if stream:  # a non-streaming answer's first byte is its last
                pre = self._pre.get(id(q), 0.0) if self._pre and not f.pre_paid else 0.0
                run.ttfts.append(first - f.arrived + q.overhead + pre)
                run.ttft_t.append(f.arrived)
            return
        if out.kind == "cut":
            self.failure(b, permit, out.fault, f.q.client)
            self.rescue(f, b, out)
            return
        if out.fault == "first_byte_timeout" and not f.retries and _stream_begun(f.q, b.name):
            # The recorded proxy had begun this client's stream (headers and
            # heartbeats) before the backend's first byte and ended it with an
            # error event, not rescued: so does a first-byte timeout here.
            self.failure(b, permit, out.fault, f.q.client)
            self._done(f)
            self.run.client_errors += 1
            return
        # Failed before the first byte: retry, the next candidate, or the end.
        result = AttemptResult(
            "failed", b.name, out.status, "error", fault=out.fault, retry=_retry_kind(out)
        )
        fo = self.policy.ladder.failover
        d = next_step(
            result,
            fo,
            retries=f.retries,
            remaining_s=f.deadline - self.now,
            larger_window_next=False,
            rand=self.rng.random,
        )
        if d.step == "retry" and b.budget.take(
            self.now, fo.retry_budget_window_s, fo.retry_budget_ratio, fo.retry_budget_min
        ):
            f.retries += 1
            self.at(self.now + d.delay, self._retry, f, b)
            return
        self.failure(b, permit, out.fault, f.q.client)
        f.failed = True
        f.idx += 1
        f.retries = 0
        self.next_candidate(f)

    def _retry(self, f: Flight, b: Backend) -> None:
        if f.done:
            return
        # Same backend: a new permit (the breaker may have moved meanwhile).
        f.order = [*f.order[: f.idx], b, *f.order[f.idx + 1 :]]
        self.next_candidate(f)

    def failure(self, b: Backend, permit: Permit, fault: str, client: str = "") -> None:
        br = b.breaker
        if b.corroborate and fault not in DEFINITIVE:
            self._suspect(b, permit, fault, client)
            return
        counted = br.outcomes
        br.record_failure(permit, fault)
        if br.outcomes != counted:
            self.ladder.report_failure(b.name)

    # -- attribution: a suspect failure that would open a breaker is corroborated --

    def _suspect(self, b: Backend, permit: Permit, fault: str, client: str) -> None:
        """`Runtime.report_failure` of a suspect failure (`Ledger.decide`)."""
        br, led = b.breaker, b.ledger
        held = Held(fault, "", client, "")
        decision = led.decide(self.now, client, br.would_open(permit))
        if decision in ("hold", "probe"):
            led.held.append(held)
            if decision == "probe":
                self._corroborate(b)
            return
        if decision == "absolve":
            led.absolve(held)
            br.absolve()
            return
        led.suspect(held)
        counted = br.outcomes
        br.record_failure(permit, fault)
        if br.outcomes != counted:
            self.ladder.report_failure(b.name)
        if br.state != "closed":
            led.streak_over()

    def _corroborate(self, b: Backend) -> None:
        b.ledger.start_probe(self.now)
        ok, definitive, _err, took = self._recovery(b)
        if definitive:  # refused, or the health check says so: at once
            took = 0.0
        self.at(self.now + took, self._corroborated, b, ok)

    def _corroborated(self, b: Backend, ok: bool) -> None:
        br, led = b.breaker, b.ledger
        held = led.probe_done(ok)
        if ok:
            br.absolve()
            return
        if held and br.state != "open":
            counted = br.outcomes
            br.force_open("corroborated")
            if br.outcomes != counted:
                self.ladder.report_failure(b.name)
        if led.held:
            self._corroborate(b)

    def rescue(self, f: Flight, b: Backend, out: Outcome) -> None:
        fb = self.fallback
        pol = self.policy.ladder.failover
        if (
            pol.rescue_streams
            and f.q.stream
            and f.q.endpoint in ("chat", "completions")
            and fb is not None
            and fb is not b
        ):
            permit = fb.breaker.allow()
            if permit is not None:
                fb.inflight += 1
                f.sent_at = self.now
                done = 0.5  # the continuation: about half an answer
                rest = f.q.tokens_out
                cont = f.q._replace(tokens_out=max(1, int(rest * done)))
                o2 = fb.world.call(
                    cont,
                    self.now,
                    fb.inflight,
                    fb.policy.timeouts.first_byte_s,
                    fb.policy.timeouts.idle_s,
                    self.rng,
                )
                self.at(o2.end, self.rescue_end, f, fb, permit, o2, out)
                return
        self._done(f)
        self.run.client_errors += 1  # an in-band error event ends the stream

    def rescue_end(self, f: Flight, fb: Backend, permit: Permit, o2: Outcome, cut: Outcome) -> None:
        fb.inflight -= 1
        if f.done:
            fb.breaker.release_trial(permit)
            return
        self._done(f)
        if o2.kind == "ok":
            fb.breaker.record_success(permit)
            self.run.rescues += 1
            self._ttft(f, cut.first if cut.first is not None else self.now)
            return
        self.failure(fb, permit, "rescue")
        self.run.client_errors += 1

    def unanswered(self, f: Flight) -> None:
        if f.done:
            return
        if self.policy.ladder.maintenance.enabled:
            self.finish_maintenance(f.q)
        else:
            self.run.client_errors += 1
        self._done(f)

    def answer(self, f: Flight, b: Backend, first: float) -> None:
        self._done(f)
        self.run.answered[b.name] = self.run.answered.get(b.name, 0) + 1
        if b is self.fallback:
            self.run.failovers += 1
        self._ttft(f, first)

    def _ttft(self, f: Flight, first: float) -> None:
        if f.q.stream:  # a non-streaming answer's first byte is its last
            pre = self._pre.get(id(f.q), 0.0) if self._pre and not f.pre_paid else 0.0
            self.run.ttfts.append(first - f.arrived + f.q.overhead + pre)
            self.run.ttft_t.append(f.arrived)

    def finish_maintenance(self, q: Request) -> None:
        self.run.maintenance_answers += 1

    def client_left(self, f: Flight) -> None:
        if f.done:
            return
        self._done(f)
        self.run.client_gone += 1
        if f.waiter is not None and not f.waiter.future.done():
            self.admission.abandon(f.waiter)
            f.waiter = None


_ARRIVAL = itemgetter(0)  # a Request's `t`


def _stream_begun(q: Request, backend: str) -> bool:
    """`q`'s recorded first attempt, on `backend`, was a stream the proxy had
    begun for the client (its headers and heartbeats went out) that ended
    with a first-byte timeout, and was not rescued (chaos drill 8: the
    hostile client's stream; the replay failed it over to the fallback and
    answered it, one client error short and one TTFT too many)."""
    a = q.attempts[0] if q.attempts else None
    return (
        a is not None
        and not q.rescued
        and a.backend == backend
        and a.kind == "ended"
        and a.fault == "first_byte_timeout"
    )


def _retry_kind(out: Outcome) -> str:
    """Whether a failure before the first byte is worth a retry on the same
    backend: a sporadic 5xx or a reset; not a refused connection, a timeout
    or an engine that died (the pipeline's own rule, `proxy.pipeline.call`)."""
    return f"http_{out.status}" if out.fault.startswith("http_5") else ""


def _reloads(trace: Trace, policy: Policy) -> list[tuple[float, Policy]]:
    """The recorded reloads a replay of `policy` takes: when `policy` is the
    one recorded at the trace's start (its backends and ladder), each later
    recorded policy with the same ladder (its backends' settings, replayed
    at its instant), up to the first that changed the ladder (not replayed:
    the replay runs that ladder throughout)."""
    if len(trace.policies) < 2:
        return []
    try:
        first = policy_from_knobs(trace.policies[0][2])
        if first.ladder != policy.ladder or first.backends != policy.backends:
            return []
        out = []
        for t, _hash, knobs in trace.policies[1:]:
            p = policy_from_knobs(knobs)
            if p.ladder != first.ladder:
                break
            out.append((t, p))
    except PolicyError:
        return []
    return out


def replay(policy: Policy, trace: Trace, world: World, seed: int = 0) -> Run:
    return Sim(policy, trace, world, seed).replay()


def tier_at(tiers: list[tuple[float, str]], t: float) -> str:
    cur = tiers[0][1] if tiers else "normal"
    for at, tier in tiers:
        if at > t:
            break
        cur = tier
    return cur


def tier_seconds(tiers: list[tuple[float, str]], end: float) -> dict[str, float]:
    out: dict[str, float] = {t: 0.0 for t in TIERS}
    for i, (at, tier) in enumerate(tiers):
        nxt = tiers[i + 1][0] if i + 1 < len(tiers) else end
        out[tier] += max(0.0, min(nxt, end) - max(at, 0.0))
    return out
