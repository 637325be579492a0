"""The breaker: consecutive failures, failure rate, half-open trials, permits."""

from __future__ import annotations

from proxy.control.breaker import BackendBreaker, Permit
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


def admit(b: BackendBreaker) -> Permit:
    permit = b.allow()
    assert permit is not None
    return permit


def fail(b: BackendBreaker, reason: str = "http_500") -> None:
    b.record_failure(admit(b), reason)


def succeed(b: BackendBreaker) -> None:
    b.record_success(admit(b))


def test_consecutive_failures_open() -> None:
    b, _, changes = make(fail_max=3, failure_rate=0)
    fail(b)
    fail(b)
    succeed(b)  # resets the streak
    fail(b)
    fail(b)
    assert b.state == "closed"
    fail(b, "connect")
    assert b.state == "open"
    assert changes[-1] == ("closed", "open", "connect")
    assert b.allow() is None
    assert b.snapshot()["consecutive_failures"] == 3


def test_failure_rate_trips_without_consecutive_failures() -> None:
    b, clock, changes = make(fail_max=5, failure_rate=0.3, min_calls=10, window_s=30)
    # 40 % failures, never two in a row: trips at the first failure once
    # min_calls outcomes are in the window.
    calls = 0
    for i in range(20):
        clock.t += 1
        calls += 1
        if i % 5 in (1, 3):
            fail(b)
        else:
            succeed(b)
        if b.state == "open":
            break
    assert b.state == "open"
    assert calls == 12
    assert "failure rate 42%" in changes[-1][2]


def test_failure_rate_needs_min_calls_and_forgets_old_outcomes() -> None:
    b, clock, _ = make(fail_max=100, failure_rate=0.3, min_calls=10, window_s=5)
    for _ in range(4):
        fail(b, "x")
        succeed(b)
    assert b.state == "closed"  # 8 calls < min_calls
    clock.t += 10  # all of them leave the window
    for _ in range(10):
        succeed(b)
    fail(b, "x")
    assert b.state == "closed"
    assert b.failure_rate() < 0.3


def test_half_open_after_reset_timeout_and_trial_outcomes() -> None:
    b, clock, changes = make(fail_max=1, reset_timeout_s=10, half_open_max_calls=1)
    fail(b, "connect")
    assert b.state == "open"
    clock.t += 9.9
    assert b.allow() is None
    clock.t += 0.2
    trial = b.allow()  # the trial call
    assert trial is not None
    assert b.state == "half-open"
    assert b.allow() is None  # only one trial at a time
    b.record_failure(trial, "connect")  # trial failed: open again, timer restarts
    assert b.state == "open"
    clock.t += 5
    assert b.allow() is None
    clock.t += 6
    b.record_success(admit(b))
    assert b.state == "closed"
    assert [c[1] for c in changes] == ["open", "half-open", "open", "half-open", "closed"]
    assert changes[-1][2] == "trial call succeeded"


def test_snapshot() -> None:
    b, _, _ = make(fail_max=2)
    fail(b, "http_503")
    snap = b.snapshot()
    assert snap == {
        "state": "closed",
        "consecutive_failures": 1,
        "failure_rate": 1.0,
        "window_calls": 1,
        "last_failure": "http_503",
    }


def test_a_trial_without_outcome_does_not_wedge_the_breaker() -> None:
    b, clock, _ = make(fail_max=1, reset_timeout_s=10, half_open_max_calls=1)
    fail(b, "connect")
    clock.t += 10
    trial = admit(b)
    assert b.allow() is None
    b.release_trial(trial)  # the trial's client left: no outcome, slot back
    leaked = admit(b)
    # A trial that never reports at all expires after reset_timeout_s.
    assert b.allow() is None
    clock.t += 10
    trial = admit(b)
    assert b.allow() is None
    # The slow trial lost its slot, not its say: its success closes the breaker.
    b.record_success(leaked)
    assert b.state == "closed"
    b.record_failure(trial, "connect")  # from the half-open epoch: stale now
    assert b.state == "closed"


def test_release_after_an_outcome_is_a_no_op() -> None:
    b, clock, _ = make(fail_max=1, reset_timeout_s=10, half_open_max_calls=1)
    fail(b, "connect")
    clock.t += 10
    trial = admit(b)
    b.record_failure(trial, "connect")
    b.release_trial(trial)  # callers release in a `finally`
    assert b.state == "open"
    assert b.allow() is None


def test_late_success_does_not_close_an_open_breaker() -> None:
    """Defect 15: a request admitted while closed that succeeds after the
    breaker opened closed it (closed → open → half-open → closed, driven by
    pybreaker's wall-clock timer while the injected clock stood still)."""
    b, clock, changes = make(fail_max=2, reset_timeout_s=0.001)
    slow = admit(b)  # a long stream, admitted while closed
    fail(b, "connect")
    fail(b, "connect")
    assert b.state == "open"
    b.record_success(slow)  # it finishes: the clock has not moved at all
    assert b.state == "open"
    assert b.allow() is None
    assert [c[:2] for c in changes] == [("closed", "open")]
    clock.t += 0.001  # even once the timeout has passed, only a trial closes it
    b.record_success(slow)
    assert b.state == "open"
    trial = admit(b)
    assert b.state == "half-open"
    b.record_success(slow)
    assert b.state == "half-open"
    b.record_success(trial)
    assert b.state == "closed"


def test_late_failure_from_before_a_recovery_does_not_reopen() -> None:
    b, clock, _ = make(fail_max=1, reset_timeout_s=10)
    stuck = admit(b)
    fail(b, "connect")
    clock.t += 10
    b.record_success(admit(b))
    assert b.state == "closed"
    b.record_failure(stuck, "first_byte_timeout")  # sent during the outage
    assert b.state == "closed"
    assert b.snapshot()["consecutive_failures"] == 0


def test_a_permit_of_another_breaker_does_not_count() -> None:
    b, _, _ = make(fail_max=1)
    other, _, _ = make(fail_max=1)
    b.record_failure(admit(other), "connect")
    assert b.state == "closed"


def test_force_open_restarts_the_timer_and_voids_trials() -> None:
    b, clock, changes = make(fail_max=1, reset_timeout_s=10)
    fail(b, "connect")
    clock.t += 10
    trial = admit(b)
    b.force_open("opened by replica b: connect")
    b.record_success(trial)
    assert b.state == "open"
    assert b.retry_at() == 20
    assert changes[-1] == ("half-open", "open", "opened by replica b: connect")
    b.reset("admin")
    assert b.state == "closed"
    assert changes[-1] == ("open", "closed", "admin")
