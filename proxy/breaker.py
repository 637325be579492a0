"""Per-backend circuit breakers: pybreaker state, asyncio-safe use, failure rate.

pybreaker counts consecutive failures and keeps the state and listeners; we
never `call()` it around an awaitable (it would count success before the
coroutine ran, and hold its threading lock across awaits). Instead the
request awaits the backend first and then *reports* the outcome through a
trivial synchronous `call`, so pybreaker's lock is held for microseconds and
the event loop never blocks.

pybreaker has no failure-rate window, so a backend failing 40 % of requests
(never five in a row) would never trip. `BackendBreaker` adds one: over the
last `window_s` seconds, once at least `min_calls` outcomes were seen, a
failure share at or above `failure_rate` opens the breaker.

Open → half-open is decided here on the injectable clock (`allow()`), so the
ladder's tests can drive time; half-open admits `half_open_max_calls` trial
requests, and their outcome closes or re-opens the breaker.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any, Literal

import pybreaker

from proxy.policy import BreakerPolicy

State = Literal["closed", "open", "half-open"]
STATE_VALUES: dict[str, int] = {"closed": 0, "half-open": 1, "open": 2}


class BackendFailure(Exception):
    """An outcome reported to pybreaker as a failure."""


def _ok() -> None:
    return None


def _fail(reason: str) -> None:
    raise BackendFailure(reason)


class _Listener(pybreaker.CircuitBreakerListener):
    def __init__(self, owner: BackendBreaker) -> None:
        self.owner = owner

    def state_change(self, cb: Any, old_state: Any, new_state: Any) -> None:
        self.owner._on_state_change(
            str(old_state.name) if old_state else "closed", str(new_state.name)
        )


class BackendBreaker:
    def __init__(
        self,
        name: str,
        policy: BreakerPolicy,
        clock: Callable[[], float],
        on_change: Callable[[str, State, State, str], None] | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.clock = clock
        self.on_change = on_change
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()
        self._failures_in_window = 0
        self._opened_at = 0.0
        self._half_open_inflight = 0
        self._trial_started = 0.0
        self.outcomes = 0  # outcomes reported so far (lets callers see if one was)
        self._pending_reason = ""
        self.last_reason = ""
        self._cb = pybreaker.CircuitBreaker(
            fail_max=policy.fail_max,
            # pybreaker's own timer uses wall time; ours (allow) decides first.
            reset_timeout=policy.reset_timeout_s,
            listeners=[_Listener(self)],
            name=name,
        )

    # -- state -------------------------------------------------------------------

    @property
    def state(self) -> State:
        s = str(self._cb.current_state)
        return s if s in ("closed", "open", "half-open") else "closed"  # type: ignore[return-value]

    def allow(self) -> bool:
        """May a request go to this backend now? Moves open → half-open after
        the reset timeout and then admits a bounded number of trial calls."""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            if self.clock() - self._opened_at < self.policy.reset_timeout_s:
                return False
            self._pending_reason = "reset timeout elapsed"
            self._cb.half_open()
        now = self.clock()
        if (
            self._half_open_inflight >= self.policy.half_open_max_calls
            and now - self._trial_started < self.policy.reset_timeout_s
        ):
            return False
        # A trial that never reported (a leak would wedge the breaker) expires
        # after reset_timeout_s; its slot goes to this call.
        if self._half_open_inflight >= self.policy.half_open_max_calls:
            self._half_open_inflight = self.policy.half_open_max_calls - 1
        self._half_open_inflight += 1
        self._trial_started = now
        return True

    def release_trial(self) -> None:
        """A trial call ended without an outcome (client left, 429): free its slot."""
        if self.state == "half-open" and self._half_open_inflight > 0:
            self._half_open_inflight -= 1

    def retry_at(self) -> float:
        """Clock time when an open breaker will admit a trial call."""
        return self._opened_at + self.policy.reset_timeout_s

    # -- outcomes ----------------------------------------------------------------

    def record_success(self) -> None:
        self._observe(True)
        cb = self._cb
        if cb.fail_counter == 0 and cb.current_state == "closed":
            return  # nothing for pybreaker to reset: skip its locked call path
        self._report(_ok)

    def record_failure(self, reason: str) -> None:
        self.last_reason = reason
        self._observe(False)
        if self.state == "closed" and self._rate_exceeded():
            rate = self._failures_in_window / len(self._outcomes)
            self.force_open(f"failure rate {rate:.0%} over {len(self._outcomes)} calls: {reason}")
            return
        self._pending_reason = reason
        self._report(_fail, reason)

    def force_open(self, reason: str) -> None:
        self.last_reason = reason
        self._pending_reason = reason
        self._cb.open()

    def reset(self, reason: str = "reset") -> None:
        self._pending_reason = reason
        self._cb.close()

    def _report(self, fn: Callable[..., None], *args: Any) -> None:
        if self.state == "half-open":
            self._half_open_inflight = max(0, self._half_open_inflight - 1)
        with contextlib.suppress(BackendFailure, pybreaker.CircuitBreakerError):
            self._cb.call(fn, *args)

    def _observe(self, ok: bool) -> None:
        self.outcomes += 1
        now = self.clock()
        q = self._outcomes
        q.append((now, ok))
        if not ok:
            self._failures_in_window += 1
        horizon = now - self.policy.window_s
        while q and q[0][0] < horizon:
            _, was_ok = q.popleft()
            if not was_ok:
                self._failures_in_window -= 1

    def _rate_exceeded(self) -> bool:
        p = self.policy
        n = len(self._outcomes)
        return (
            p.failure_rate > 0
            and n >= p.min_calls
            and self._failures_in_window / n >= p.failure_rate
        )

    def failure_rate(self) -> float:
        n = len(self._outcomes)
        return self._failures_in_window / n if n else 0.0

    def _on_state_change(self, old: str, new: str) -> None:
        if new == "open":
            self._opened_at = self.clock()
            self._half_open_inflight = 0
        if new == "closed":
            self._outcomes.clear()
            self._failures_in_window = 0
            self._half_open_inflight = 0
        reason = self._pending_reason or new
        self._pending_reason = ""
        if self.on_change is not None and old != new:
            self.on_change(self.name, old, new, reason)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "consecutive_failures": int(self._cb.fail_counter),
            "failure_rate": round(self.failure_rate(), 3),
            "window_calls": len(self._outcomes),
            "last_failure": self.last_reason or None,
        }
