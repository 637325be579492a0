"""Per-backend circuit breakers: a small state machine on the injectable clock.

    closed ──(fail_max in a row, or failure rate)──► open
    open ──(reset_timeout_s on the clock, at the next allow())──► half-open
    half-open ──(a trial succeeds)──► closed
    half-open ──(a trial fails)──► open (the timer restarts)

A request asks `allow()` before it goes to the backend and gets a `Permit`
(or None: not now). Its outcome is reported *with that permit*, after the
await, so nothing is held across I/O. The permit carries the breaker's epoch
(bumped on every state change) and, in half-open, a trial number, so:

- an outcome counts only in the epoch that admitted it: a late success (a
  request admitted while closed that finishes after the breaker opened) never
  closes an open breaker, and a failure from before a recovery never reopens it;
- in half-open only the trials' outcomes count, and only a trial's success
  closes the breaker;
- at most `half_open_max_calls` trials are out at once; a trial that has not
  reported after `reset_timeout_s` (a leaked permit, a long stream) loses its
  slot to the next call, though its outcome still counts when it comes; and
  `release_trial(permit)` hands a slot back at once (no outcome: the client
  left, the request was shed). Releasing a permit that already reported is a
  no-op, so callers release in a `finally`.

Open → half-open happens only on the injected clock (inside `allow()`), so
tests drive time and no wall-clock timer moves the breaker behind anyone's
back. Besides consecutive failures there is a failure-rate window: over the
last `window_s` seconds, once at least `min_calls` outcomes are in, a failure
share at or above `failure_rate` opens the breaker (a backend failing 40 % of
requests, never five in a row, would otherwise never trip).

Decisions only: time comes from the clock, side effects (metrics, logs,
shared state) from the `on_change` callback.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.policy import BreakerPolicy

State = Literal["closed", "open", "half-open"]
STATE_VALUES: dict[str, int] = {"closed": 0, "half-open": 1, "open": 2}


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to send one request; hand it back with the outcome."""

    epoch: int
    trial: int = 0  # 0: admitted while closed; else the half-open trial's number
    owner: object = field(default=None, compare=False, repr=False)


class BackendBreaker:
    def __init__(
        self,
        name: str,
        policy: BreakerPolicy,
        clock: Callable[[], float],
        on_change: Callable[[str, State, State, str], None] | None = None,
    ) -> None:
        self.name = name
        self.model: str | None = None  # set for a per-model breaker (proxy.backends.upstream)
        self.policy = policy
        self.clock = clock
        self.on_change = on_change
        self.state: State = "closed"
        self.last_reason = ""
        self.outcomes = 0  # outcomes that counted so far
        self._epoch = 0
        self._opened_at = 0.0
        self._consecutive = 0
        self._outcomes: collections.deque[tuple[float, bool]] = collections.deque()
        self._failures_in_window = 0
        self._trials: dict[int, float] = {}  # trial number → when admitted
        self._next_trial = 1
        self._closed_permit = Permit(0, 0, self)  # all of a closed epoch's are alike

    # -- admission ---------------------------------------------------------------

    def allow(self) -> Permit | None:
        """May a request go to this backend now? Moves open → half-open once
        `reset_timeout_s` has passed on the clock, then admits a bounded number
        of trial calls."""
        if self.state == "closed":
            return self._closed_permit
        now = self.clock()
        if self.state == "open":
            if now < self.retry_at():
                return None
            self._move("half-open", "reset timeout elapsed")
        # Trials that never reported lose their slot after reset_timeout_s.
        horizon = now - self.policy.reset_timeout_s
        for n in [n for n, at in self._trials.items() if at <= horizon]:
            del self._trials[n]
        if len(self._trials) >= self.policy.half_open_max_calls:
            return None
        n = self._next_trial
        self._next_trial += 1
        self._trials[n] = now
        return Permit(self._epoch, n, self)

    def release_trial(self, permit: Permit | None) -> None:
        """The call ended without an outcome (client left, 429): free its trial
        slot. A no-op for a permit that reported or was not a trial."""
        if permit is not None and self._current(permit) and permit.trial:
            self._trials.pop(permit.trial, None)

    def retry_at(self) -> float:
        """Clock time when an open breaker will admit a trial call."""
        return self._opened_at + self.policy.reset_timeout_s

    def _current(self, permit: Permit) -> bool:
        return permit.owner is self and permit.epoch == self._epoch

    # -- outcomes ----------------------------------------------------------------

    def record_success(self, permit: Permit) -> None:
        if self.state == "closed" and permit.owner is self and permit.epoch == self._epoch:
            # A closed breaker's success (every answer): `_counts` and
            # `_observe`, inline.
            self.outcomes += 1
            self._consecutive = 0
            now = self.clock()
            q = self._outcomes
            q.append((now, True))
            horizon = now - self.policy.window_s
            while q and q[0][0] < horizon:
                if not q.popleft()[1]:
                    self._failures_in_window -= 1
            return
        if not self._counts(permit):
            return
        if self.state == "half-open":
            self._move("closed", "trial call succeeded")
            return
        self._consecutive = 0
        self._observe(True)

    def record_failure(self, permit: Permit, reason: str) -> None:
        if not self._counts(permit):
            return
        self.last_reason = reason
        if self.state == "half-open":
            self._move("open", f"trial call failed: {reason}")
            return
        self._consecutive += 1
        self._observe(False)
        p = self.policy
        n = len(self._outcomes)
        if p.failure_rate > 0 and n >= p.min_calls and self.failure_rate() >= p.failure_rate:
            self._move("open", f"failure rate {self.failure_rate():.0%} over {n} calls: {reason}")
        elif self._consecutive >= p.fail_max:
            self._move("open", reason)

    def would_open(self, permit: Permit | None = None) -> bool:
        """Whether one more counted failure would open this breaker: a closed
        one's at its threshold, or the failure of a half-open one's trial
        (`permit`) — which a client can shape as much as any other."""
        if self.state == "half-open":
            return permit is not None and self._counts(permit)
        if self.state != "closed":
            return False
        p = self.policy
        if self._consecutive + 1 >= p.fail_max:
            return True
        n = len(self._outcomes) + 1
        rate = (self._failures_in_window + 1) / n
        return p.failure_rate > 0 and n >= p.min_calls and rate >= p.failure_rate

    def forgive(self, permit: Permit) -> None:
        """One failure counted with `permit` was not the backend's: taken
        back, if the breaker is still in the epoch that counted it."""
        if not self._current(permit) or self.state != "closed":
            return
        self._consecutive = max(0, self._consecutive - 1)
        for i in range(len(self._outcomes) - 1, -1, -1):
            if not self._outcomes[i][1]:
                del self._outcomes[i]
                self._failures_in_window -= 1
                break

    def absolve(self) -> None:
        """The failures counted so far were the requests' own (a probe that
        succeeded says so): the streak and the window's failures go."""
        self._consecutive = 0
        kept = [(t, ok) for t, ok in self._outcomes if ok]
        self._outcomes = collections.deque(kept)
        self._failures_in_window = 0

    def _counts(self, permit: Permit) -> bool:
        """Does this outcome count? Only in the epoch that admitted it, and in
        half-open only for a trial still out."""
        if not self._current(permit) or self.state == "open":
            return False
        if self.state == "half-open":
            # Every permit of a half-open epoch is a trial; one that outlived
            # its slot (a long stream) still counts: it is this epoch's evidence.
            self._trials.pop(permit.trial, None)
        self.outcomes += 1
        return True

    def force_open(self, reason: str) -> None:
        """Open now (another replica saw the backend fail); restarts the timer."""
        self.last_reason = reason
        self._move("open", reason)

    def reset(self, reason: str = "reset") -> None:
        self._move("closed", reason)

    def _observe(self, ok: bool) -> None:
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

    def failure_rate(self) -> float:
        n = len(self._outcomes)
        return self._failures_in_window / n if n else 0.0

    # -- transitions -------------------------------------------------------------

    def _move(self, new: State, reason: str) -> None:
        old = self.state
        self.state = new
        self._epoch += 1  # every permit handed out so far is now stale
        self._trials.clear()
        self._closed_permit = Permit(self._epoch, 0, self)
        if new == "open":
            self._opened_at = self.clock()
        if new == "closed":  # the counts stay visible in status while open
            self._consecutive = 0
            self._outcomes.clear()
            self._failures_in_window = 0
        if self.on_change is not None and old != new:
            self.on_change(self.name, old, new, reason)

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "consecutive_failures": self._consecutive,
            "failure_rate": round(self.failure_rate(), 3),
            "window_calls": len(self._outcomes),
            "last_failure": self.last_reason or None,
        }
