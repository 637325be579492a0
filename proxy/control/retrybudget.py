"""Same-backend retries within a budget (Envoy-style), and their backoff.

A backend may be retried at most `ratio × requests + floor` times per window:
one flaky request is retried at once, but a backend failing half its traffic
does not get its load multiplied by retries (the budget runs out and the
requests fail over). Two buckets approximate a sliding window: the current
one and the one before it. Everything takes `now` from the caller (the
event loop's clock), so tests drive it without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable


class RetryBudget:
    __slots__ = ("_prev_requests", "_prev_retries", "_requests", "_retries", "_start")

    def __init__(self) -> None:
        self._start = 0.0
        self._requests = 0
        self._retries = 0
        self._prev_requests = 0
        self._prev_retries = 0

    def _roll(self, now: float, window_s: float) -> None:
        if now - self._start < window_s:
            return
        if now - self._start < 2 * window_s:
            self._prev_requests, self._prev_retries = self._requests, self._retries
        else:
            self._prev_requests = self._prev_retries = 0
        self._start = now
        self._requests = self._retries = 0

    def request(self, now: float, window_s: float) -> None:
        """A first attempt on this backend (retries are not counted here)."""
        if now - self._start >= window_s:  # (`_roll`'s own test, first: every request)
            self._roll(now, window_s)
        self._requests += 1

    def take(self, now: float, window_s: float, ratio: float, floor: int) -> bool:
        """Spend one retry if the budget has one left."""
        self._roll(now, window_s)
        allowed = ratio * (self._requests + self._prev_requests) + floor
        if self._retries + self._prev_retries + 1 > allowed:
            return False
        self._retries += 1
        return True

    @property
    def retries(self) -> int:
        return self._retries + self._prev_retries


def backoff(retry: int, base_s: float, max_s: float, rand: Callable[[], float]) -> float:
    """Delay before the `retry`-th retry (1-based): exponential, capped, with
    jitter to 50–100 % of it (so retries of one burst do not arrive together)."""
    d: float = min(max_s, base_s * 2.0 ** (retry - 1))
    return d * (0.5 + 0.5 * rand())


def retry_after_s(value: str | None) -> float | None:
    """`Retry-After` in seconds (delta-seconds only; an HTTP date reads as None)."""
    if not value:
        return None
    try:
        v = float(value.strip())
    except ValueError:
        return None
    return v if v >= 0 else None
