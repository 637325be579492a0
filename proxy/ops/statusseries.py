"""The status page's time series: one point per interval (requests/s,
errors/s, TTFT p50/p95 over a window, in-flight, limit, queue, tier),
computed from the Prometheus metrics and the proxy's state. No I/O; the
sampler in `proxy.ops.statuspage` takes the points and streams them."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.runtime.state import ProxyState
from proxy.telemetry.metrics import Metrics

__all__ = ["Series", "histogram_quantile", "request_totals", "ttft_buckets"]


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' `histogram_quantile` on cumulative `(upper_bound, count)` pairs
    sorted by bound (the last one +Inf): linear interpolation inside the bucket
    holding the rank; the highest finite bound when the rank falls in +Inf.
    None when there are no observations."""
    pairs = list(buckets)
    if not pairs or pairs[-1][1] <= 0:
        return None
    rank = q * pairs[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in pairs:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = (upper if not math.isinf(upper) else lower), count
    return lower


def ttft_buckets(metrics: Metrics) -> tuple[tuple[float, float], ...]:
    """The TTFT histogram's cumulative buckets, summed over backends."""
    sums: dict[float, float] = {}
    for fam in metrics.ttft.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                sums[le] = sums.get(le, 0.0) + s.value
    return tuple(sorted(sums.items()))


def request_totals(metrics: Metrics) -> tuple[float, float]:
    """(all requests, those answered with status >= 500 or 429) so far."""
    total = errors = 0.0
    for fam in metrics.requests.collect():
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            total += s.value
            status = s.labels.get("status", "")
            if status == "429" or status.startswith("5"):
                errors += s.value
    return total, errors


@dataclass(slots=True)
class _Cumulative:
    t: float
    requests: float
    errors: float
    ttft: tuple[tuple[float, float], ...]


def _delta(
    new: tuple[tuple[float, float], ...], old: tuple[tuple[float, float], ...]
) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, max(0.0, count - before.get(le, 0.0))) for le, count in new]


@dataclass
class Series:
    """A bounded ring of one point per interval, computed from the metrics."""

    interval_s: float = 1.0
    window_s: float = 600.0
    ttft_window_s: float = 10.0
    points: deque[dict[str, Any]] = field(init=False)
    total: int = field(init=False, default=0)  # points ever taken (a cursor for streams)
    _history: deque[_Cumulative] = field(init=False)

    def __post_init__(self) -> None:
        self.points = deque(maxlen=max(2, math.ceil(self.window_s / self.interval_s)))
        self._history = deque(maxlen=max(2, math.ceil(self.ttft_window_s / self.interval_s) + 1))

    def sample(self, metrics: Metrics, state: ProxyState, now: float) -> dict[str, Any] | None:
        """Take one sample (wall time `now`); returns the new point, or None for
        the very first sample (rates need two)."""
        requests, errors = request_totals(metrics)
        cur = _Cumulative(now, requests, errors, ttft_buckets(metrics))
        self._history.append(cur)
        if len(self._history) < 2:
            return None
        prev, oldest = self._history[-2], self._history[0]
        dt = max(1e-6, now - prev.t)
        window = _delta(cur.ttft, oldest.ttft)
        rt = state.current
        adm = rt.admission
        point = {
            "t": round(now, 3),
            "rps": round(max(0.0, cur.requests - prev.requests) / dt, 3),
            "err_rps": round(max(0.0, cur.errors - prev.errors) / dt, 3),
            "ttft_p50": _round(histogram_quantile(0.5, window)),
            "ttft_p95": _round(histogram_quantile(0.95, window)),
            "inflight": sum(r.inflight for r in state.live),
            "limit": adm.limit,
            "queued": adm.queued,
            "tier": rt.tier,
        }
        self.points.append(point)
        self.total += 1
        return point

    def since(self, cursor: int | None) -> list[dict[str, Any]]:
        """Points taken after `cursor` (a past `total`; None = all kept), oldest
        first. A cursor, not a time: a wall-clock step must not hide points."""
        new = len(self.points) if cursor is None else min(len(self.points), self.total - cursor)
        if new <= 0:
            return []
        return list(itertools.islice(self.points, len(self.points) - new, None))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
