"""Stateful property test of the breaker on the injected clock.

Random policies and random schedules of admissions, outcomes (in any order,
late ones included), released trials, other replicas' opens and clock steps.
After every step: an open breaker admits nothing before `reset_timeout_s` has
passed on the clock; half-open admits at most `half_open_max_calls` trials at
a time; only a trial's success closes it; a stale outcome never moves it; and
with nothing but successes after the timeout it ends closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proxy.control.breaker import BackendBreaker, Permit
from proxy.policy import BreakerPolicy

EDGES = {
    ("closed", "open"),
    ("open", "half-open"),
    ("half-open", "open"),
    ("half-open", "closed"),
}


@dataclass
class Issued:
    permit: Permit
    at: float
    period: int  # the model's count of epochs when it was issued
    trial: bool  # issued while half-open


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.changes: list[tuple[str, str, str]] = []
        self.out: list[Issued] = []
        self.period = 0
        self.opened_at = 0.0

    @initialize(
        fail_max=st.integers(1, 4),
        failure_rate=st.sampled_from([0.0, 0.5]),
        min_calls=st.integers(2, 5),
        window_s=st.sampled_from([1.0, 5.0]),
        reset_timeout_s=st.sampled_from([0.5, 1.0, 3.0]),
        half_open_max_calls=st.integers(1, 3),
    )
    def setup(
        self,
        fail_max: int,
        failure_rate: float,
        min_calls: int,
        window_s: float,
        reset_timeout_s: float,
        half_open_max_calls: int,
    ) -> None:
        self.policy = BreakerPolicy(
            fail_max=fail_max,
            failure_rate=failure_rate,
            min_calls=min_calls,
            window_s=window_s,
            reset_timeout_s=reset_timeout_s,
            half_open_max_calls=half_open_max_calls,
        )
        self.b = BackendBreaker("primary", self.policy, lambda: self.t, self._changed)

    def _changed(self, name: str, old: str, new: str, reason: str) -> None:
        assert name == "primary"
        self.changes.append((old, new, reason))
        self.period += 1
        if new == "open":
            self.opened_at = self.t

    def _trials_out(self) -> int:
        """Trials of this half-open period still out and not yet expired."""
        horizon = self.t - self.policy.reset_timeout_s
        return sum(1 for i in self.out if i.trial and i.period == self.period and i.at > horizon)

    # -- rules -------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.1, 0.4, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        self.t += dt

    @rule()
    def admit(self) -> None:
        before = self.b.state
        opened_early = before == "open" and self.t < self.opened_at + self.policy.reset_timeout_s
        trials_before = self._trials_out() if before == "half-open" else 0
        permit = self.b.allow()
        if before == "closed":
            assert permit is not None and self.b.state == "closed"
        if opened_early:
            # Open stays open until reset_timeout_s on the injected clock.
            assert permit is None and self.b.state == "open"
            return
        if before == "open":
            assert self.b.state == "half-open" and permit is not None
        if self.b.state == "half-open":
            assert (permit is not None) == (trials_before < self.policy.half_open_max_calls)
        if permit is not None:
            trial = self.b.state == "half-open"
            self.out.append(Issued(permit, self.t, self.period, trial))
            if trial:
                assert self._trials_out() <= self.policy.half_open_max_calls

    @precondition(lambda self: bool(self.out))
    @rule(index=st.integers(0, 50), ok=st.booleans())
    def finish(self, index: int, ok: bool) -> None:
        issued = self.out.pop(index % len(self.out))
        before, n = self.b.state, len(self.changes)
        stale = issued.period != self.period
        live_trial = issued.trial and not stale
        if ok:
            self.b.record_success(issued.permit)
        else:
            self.b.record_failure(issued.permit, "http_500")
        moved = self.changes[n:]
        if stale:
            assert not moved, "a stale outcome moved the breaker"
        if before == "open":
            assert not moved and self.b.state == "open"
        if self.b.state == "closed" and before != "closed":
            # Only a trial's success closes it.
            assert ok and live_trial
        if before == "half-open" and live_trial:
            assert self.b.state == ("closed" if ok else "open")
        if before == "half-open" and not live_trial:
            assert not moved

    @precondition(lambda self: bool(self.out))
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        issued = self.out.pop(index % len(self.out))
        before = self.b.state
        self.b.release_trial(issued.permit)
        assert self.b.state == before

    @rule()
    def opened_elsewhere(self) -> None:
        was_open = self.b.state == "open"
        self.b.force_open("opened by replica b")
        assert self.b.state == "open"
        if was_open:  # no callback, but the timer restarts and permits go stale
            self.period += 1
            self.opened_at = self.t

    @rule()
    def recovers(self) -> None:
        """Liveness: once the timeout has passed, successes alone close it."""
        self.t += self.policy.reset_timeout_s
        for _ in range(2):
            permit = self.b.allow()
            assert permit is not None
            self.b.record_success(permit)
        assert self.b.state == "closed"

    # -- invariants --------------------------------------------------------------

    @invariant()
    def edges_are_legal(self) -> None:
        for old, new, _ in self.changes:
            assert (old, new) in EDGES, (old, new)

    @invariant()
    def open_until_the_timeout(self) -> None:
        if self.b.state == "open":
            assert self.b.retry_at() == self.opened_at + self.policy.reset_timeout_s

    @invariant()
    def status_matches(self) -> None:
        snap = self.b.snapshot()
        assert snap["state"] == self.b.state
        assert 0.0 <= snap["failure_rate"] <= 1.0


BreakerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBreakerMachine = BreakerMachine.TestCase
