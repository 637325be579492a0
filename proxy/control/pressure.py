"""Tier 1 signals and the throttle controller.

Pressure is read from vLLM itself (its `/metrics`: requests waiting, KV-cache
usage — summed over `engine` labels, old metric names accepted), from the
proxy's own time to first token against a rolling baseline (the seed rule:
pressure when the short-window P95 exceeds `ttft_factor` × the baseline P95),
and from the admission queue's wait times — only while the limit is the
configured `max_inflight`: once the throttle has cut the limit, its queue is
the throttle's own doing, and counting it would hold the tier in place (and,
adaptive, shrink the limit further) with the engine idle.

Hysteresis: pressure turns on when any signal reaches its high mark and
turns off only when every signal is below `clear_ratio` × its mark; the
ladder adds its own dwell and healthy windows on top.

Throttle controller, evaluated once per ladder window:
- `fixed`: in the throttle tier the limit is `throttled_limit`.
- `adaptive` (AIMD): each window under pressure,
  `limit ← max(min_limit, ⌊limit × decrease_factor⌋)`; each window without,
  `limit ← min(max_inflight, limit + increase_step)`. Multiplicative decrease
  backs off fast when the engine saturates, additive increase probes back
  up, so the limit settles around what the engine can serve well.
Out of the throttle tier the limit climbs back to `max_inflight` the same way.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

from proxy.policy import ThrottlePolicy

# vLLM gauge names, current first; older releases used the second.
WAITING = ("vllm:num_requests_waiting",)
RUNNING = ("vllm:num_requests_running",)
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
REJECTIONS = ("vllm:admission_rejections_total",)
# vLLM's histogram of the time requests waited in its own queue: its sum and
# count, re-exported (brownout_upstream_request_queue_time_seconds) for the
# engine queue-wait alert.
QUEUE_TIME_SUM = ("vllm:request_queue_time_seconds_sum",)
QUEUE_TIME_COUNT = ("vllm:request_queue_time_seconds_count",)


class Window:
    """Samples over a sliding time window; P95 on demand (once per ladder window).

    Times and values live in two deques of the same bound (they drop their
    oldest together). For the P95 only the top of the window matters: past
    the first call, the values at or above a threshold `_thr` are kept
    sorted (`_hi`, a few times the top 5 %) and the others only counted
    (`_below`); a value that comes or goes costs a comparison, and one in
    the top an insertion into a short list. The P95 is `_hi`'s element at
    its rank less `_below`, exactly what a full sort gives; the window is
    sorted again (a new threshold) only when the rank falls below the
    threshold or the top grows large. That is what lets `brownout replay`
    evaluate a day of windows in seconds."""

    def __init__(self, span_s: float, cap: int = 8192) -> None:
        self.span_s = span_s
        self.cap = cap
        self._t: collections.deque[float] = collections.deque(maxlen=cap)
        self._v: collections.deque[float] = collections.deque(maxlen=cap)
        self._thr: float | None = None  # None: not tracked (no P95 asked yet)
        self._hi: list[float] = []  # the values >= _thr, sorted
        self._below = 0  # how many are < _thr

    def add(self, t: float, v: float) -> None:
        vs = self._v
        thr = self._thr
        if thr is not None:
            if len(vs) == self.cap:
                # The deque drops its oldest (`_drop`, inline: every sample
                # of a full window).
                old = vs[0]
                if old >= thr:
                    hi = self._hi
                    del hi[bisect.bisect_left(hi, old)]
                else:
                    self._below -= 1
            if v >= thr:
                bisect.insort(self._hi, v)
            else:
                self._below += 1
        self._t.append(t)
        vs.append(v)

    def _drop(self, v: float) -> None:
        thr = self._thr
        assert thr is not None
        if v >= thr:
            hi = self._hi
            del hi[bisect.bisect_left(hi, v)]
        else:
            self._below -= 1

    def _prune(self, now: float) -> None:
        horizon = now - self.span_s
        ts, vs = self._t, self._v
        track = self._thr is not None
        while ts and ts[0] < horizon:
            ts.popleft()
            v = vs.popleft()
            if track:
                self._drop(v)

    def values(self, now: float) -> list[float]:
        self._prune(now)
        return list(self._v)

    def p95(self, now: float) -> tuple[float, int]:
        self._prune(now)
        n = len(self._v)
        if not n:
            return 0.0, 0
        k = min(n - 1, math.ceil(0.95 * n) - 1)  # the P95's rank in the sorted window
        top = n - k
        if self._thr is None or k < self._below or len(self._hi) > 4 * top + 64:
            s = sorted(self._v)
            thr = s[max(0, k - top - 16)]  # room for the rank to move down
            lo = bisect.bisect_left(s, thr)
            self._thr, self._hi, self._below = thr, s[lo:], lo
        return self._hi[k - self._below], n


@dataclass(slots=True)
class EngineGauges:
    waiting: float = 0.0
    running: float = 0.0
    kv_cache: float = 0.0
    rejections: float = 0.0
    # (count, sum) of vLLM's request queue time histogram; None: not exported.
    queue_time: tuple[float, float] | None = None
    scraped_at: float | None = None
    error: str | None = None


def parse_vllm_metrics(text: str) -> EngineGauges:
    """The gauges the ladder needs, summed over label sets (one per engine).

    A line scan, not a full exposition parse: vLLM's page is tens of KB and
    this runs on the event loop every second.
    """
    sums: dict[str, float] = {}
    wanted = WAITING + RUNNING + KV_CACHE + REJECTIONS + QUEUE_TIME_SUM + QUEUE_TIME_COUNT
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        name = line[:brace] if brace > 0 else line[:space]
        if name not in wanted:
            continue
        try:
            value = float(line[space + 1 :])
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + value
    g = EngineGauges()
    g.waiting = sum(sums.get(n, 0.0) for n in WAITING)
    g.running = sum(sums.get(n, 0.0) for n in RUNNING)
    kv = [sums[n] for n in KV_CACHE if n in sums]
    # Several engines: the fullest one is what saturates first.
    g.kv_cache = kv[0] if kv else 0.0
    g.rejections = sum(sums.get(n, 0.0) for n in REJECTIONS)
    if any(n in sums for n in QUEUE_TIME_COUNT):
        g.queue_time = (
            sum(sums.get(n, 0.0) for n in QUEUE_TIME_COUNT),
            sum(sums.get(n, 0.0) for n in QUEUE_TIME_SUM),
        )
    return g


@dataclass
class Verdict:
    pressure: bool
    reason: str


class PressureMonitor:
    def __init__(self, policy: ThrottlePolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.engine = EngineGauges()
        self._prev_rejections: float | None = None
        self._rejecting = False
        self.ttft_short = Window(policy.ttft_window_s)
        self.ttft_base = Window(policy.baseline_window_s)
        self.queue_wait = Window(policy.queue_wait_window_s)
        self.active = False
        self.reason = ""

    def set_policy(self, policy: ThrottlePolicy) -> None:
        """A reloaded policy keeps the samples; only the windows' spans change."""
        self.policy = policy
        self.ttft_short.span_s = policy.ttft_window_s
        self.ttft_base.span_s = policy.baseline_window_s
        self.queue_wait.span_s = policy.queue_wait_window_s

    def record_ttft(self, seconds: float) -> None:
        now = self.clock()
        self.ttft_short.add(now, seconds)
        self.ttft_base.add(now, seconds)

    def record_queue_wait(self, seconds: float, limit: int, counts: bool = True) -> None:
        # Not counted: a wait the throttle causes itself (the limit is cut), or
        # one client's demand beyond its fair share (`Admission`, fair share).
        if counts and limit >= self.policy.max_inflight:
            self.queue_wait.add(self.clock(), seconds)

    def update_engine(self, g: EngineGauges) -> None:
        g.scraped_at = self.clock()
        if self._prev_rejections is not None:
            # vLLM ≥ 0.32 with a bounded queue: new rejections are load, not failure.
            self._rejecting = g.rejections > self._prev_rejections
        self._prev_rejections = g.rejections
        self.engine = g

    def ratios(self) -> dict[str, float]:
        """Each signal as a share of its high mark (≥ 1 = pressure)."""
        p = self.policy
        now = self.clock()
        out = {
            "waiting": self.engine.waiting / p.waiting_high if p.waiting_high else 0.0,
            "kv_cache": self.engine.kv_cache / p.kv_cache_high if p.kv_cache_high else 0.0,
            "queue_full_rejections": 1.0 if self._rejecting else 0.0,
        }
        short, n_short = self.ttft_short.p95(now)
        base, n_base = self.ttft_base.p95(now)
        if n_short >= p.min_samples and n_base >= p.min_samples and base > 0:
            out["ttft"] = short / (base * p.ttft_factor)
        wait, n_wait = self.queue_wait.p95(now)
        if n_wait and p.queue_wait_high_s:
            out["queue_wait"] = wait / p.queue_wait_high_s
        return out

    def evaluate(self) -> Verdict:
        ratios = self.ratios()
        high = [k for k, v in ratios.items() if v >= 1.0]
        if high:
            self.active = True
            self.reason = ", ".join(f"{k} at {ratios[k]:.0%} of its mark" for k in high)
        elif self.active and all(v < self.policy.clear_ratio for v in ratios.values()):
            self.active = False
            self.reason = "pressure cleared"
        return Verdict(self.active, self.reason)


def next_limit(policy: ThrottlePolicy, current: int, *, throttled: bool, pressure: bool) -> int:
    """The admission limit for the next window (see the module docstring)."""
    top = policy.max_inflight
    if throttled and policy.mode == "fixed":
        return max(1, min(top, policy.throttled_limit))
    if throttled and pressure:
        return max(policy.min_limit, min(current - 1, math.floor(current * policy.decrease_factor)))
    return min(top, current + policy.increase_step)
