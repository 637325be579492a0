"""The pybreaker-based breaker: consecutive failures, failure rate, half-open."""

from __future__ import annotations

from proxy.breaker import BackendBreaker
from proxy.policy import BreakerPolicy


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(**kw: float) -> tuple[BackendBreaker, Clock, list[tuple[str, str, str]]]:
    clock = Clock()
    changes: list[tuple[str, str, str]] = []
    policy = BreakerPolicy(**kw)  # type: ignore[arg-type]
    b = BackendBreaker("primary", policy, clock, lambda n, o, new, r: changes.append((o, new, r)))
    return b, clock, changes


def test_consecutive_failures_open() -> None:
    b, _, changes = make(fail_max=3, failure_rate=0)
    b.record_failure("http_500")
    b.record_failure("http_500")
    b.record_success()  # resets the streak
    b.record_failure("http_500")
    b.record_failure("http_500")
    assert b.state == "closed"
    b.record_failure("connect")
    assert b.state == "open"
    assert changes[-1][:2] == ("closed", "open")
    assert not b.allow()


def test_failure_rate_trips_without_consecutive_failures() -> None:
    b, clock, changes = make(fail_max=5, failure_rate=0.3, min_calls=10, window_s=30)
    # 40 % failures, never two in a row: trips at the first failure once
    # min_calls outcomes are in the window.
    calls = 0
    for i in range(20):
        clock.t += 1
        calls += 1
        if i % 5 in (1, 3):
            b.record_failure("http_500")
        else:
            b.record_success()
        if b.state == "open":
            break
    assert b.state == "open"
    assert calls == 12
    assert "failure rate 42%" in changes[-1][2]


def test_failure_rate_needs_min_calls_and_forgets_old_outcomes() -> None:
    b, clock, _ = make(fail_max=100, failure_rate=0.3, min_calls=10, window_s=5)
    for _ in range(4):
        b.record_failure("x")
        b.record_success()
    assert b.state == "closed"  # 8 calls < min_calls
    clock.t += 10  # all of them leave the window
    for _ in range(10):
        b.record_success()
    b.record_failure("x")
    assert b.state == "closed"
    assert b.failure_rate() < 0.3


def test_half_open_after_reset_timeout_and_trial_outcomes() -> None:
    b, clock, changes = make(fail_max=1, reset_timeout_s=10, half_open_max_calls=1)
    b.record_failure("connect")
    assert b.state == "open"
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.2
    assert b.allow()  # the trial call
    assert b.state == "half-open"
    assert not b.allow()  # only one trial at a time
    b.record_failure("connect")  # trial failed: open again, timer restarts
    assert b.state == "open"
    clock.t += 5
    assert not b.allow()
    clock.t += 6
    assert b.allow()
    b.record_success()
    assert b.state == "closed"
    assert [c[1] for c in changes] == ["open", "half-open", "open", "half-open", "closed"]


def test_snapshot() -> None:
    b, _, _ = make(fail_max=2)
    b.record_failure("http_503")
    snap = b.snapshot()
    assert snap["state"] == "closed"
    assert snap["consecutive_failures"] == 1
    assert snap["last_failure"] == "http_503"


def test_a_trial_without_outcome_does_not_wedge_the_breaker() -> None:
    b, clock, _ = make(fail_max=1, reset_timeout_s=10, half_open_max_calls=1)
    b.record_failure("connect")
    clock.t += 10
    assert b.allow()
    assert not b.allow()
    b.release_trial()  # the trial's client left: no outcome, slot back
    assert b.allow()
    # A trial that never reports at all expires after reset_timeout_s.
    assert not b.allow()
    clock.t += 10
    assert b.allow()
    b.record_success()
    assert b.state == "closed"
