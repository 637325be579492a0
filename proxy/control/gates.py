"""The gates of a gray release: the candidate arm judged against the primary.

Pure: samples and the clock come in, verdicts go out (`GateReport`); no I/O,
standard library only. The rollout state machine (`proxy.control.rollout`)
advances a step only on `GateReport.ready` and rolls back on `failed`.

Samples. `observe()` takes one finished request of an arm: its end-to-end
latency, its TTFT (streams only), whether it failed by the backend's own
fault, whether it was an out-of-memory error. Each arm keeps deques of
(at, value) over the sliding `window_s`: the requests' deque (the hard gates'
counts) is pruned on every `observe()`, the latency and TTFT series when
`evaluate()` reads them; a sample is a few deque appends on the request path.
`evaluate()` reads the series in ascending order, sorted then (`_Series`:
only new samples since the last look are merged in; the window is sorted
again when any left it — 10,000 floats in ~1 ms). Kept in order on every
add and pop instead, the series cost ~45,000 instructions per request at the
cap (~4 % of a 16-chunk stream, `bench/rollout_ab.py`); sorted per window
they cost a few ms per second whatever the request rate
(`bench/gates_bench.py`).
Memory is capped at `CAP` = 10,000 samples per arm and series (requests,
latencies, TTFTs); past it the oldest go first, so at more than ~33 requests/s
per arm over the default 300 s window the gates judge the last 10,000.
`at` is the runtime's monotonic clock; an `at` earlier than one already seen
is taken as the latest seen (the deques stay in time order). A failed
request's latency and TTFT are not sampled (a fast 500 is not a fast answer;
`error_rate` judges it). A non-finite or negative latency or TTFT, or a
non-finite `at`, is dropped and counted (`GateReport.dropped`).

Hard gates, candidate only, judged from the first event (no `min_samples`):
- `oom`: the candidate's OOM errors in the window; fails when > `oom_max`
  (default 0: the first one). `oom` and `failed` are independent flags: an
  OOM that failed a request is passed with both.
- `error_rate`: candidate failures / candidate requests in the window; fails
  when > `error_rate_max` (default 0: the first failure). With a non-zero
  limit the rate is coarse on few requests (one failure among the first n is
  1/n) — that is the brief's rule, a hard gate does not wait.
`observe()` returns the failing hard gate on each candidate failure or OOM
that leaves it over its limit (the runtime rolls back on the first; a second
`rollback()` is a no-op). A primary failure never fails anything. With no
candidate request in the window both gates "wait" (nothing to judge yet).

Ratio gates: `ttft_ratio` = candidate TTFT p50 / primary TTFT p50 ≤
`ttft_ratio_max`; `p99_ratio` = candidate latency p99 / primary latency p99 ≤
`p99_ratio_max` + `p99_tolerance`. The statistics, honest about small
samples and free of any assumption on the latency distribution:
- Point estimate: each arm's sample quantile (linear interpolation between
  order statistics, numpy's default), then their ratio.
- Each arm's quantile gets a distribution-free order-statistic interval
  [X_(j), X_(k)]: B = #{X_i ≤ true quantile} is Binomial(n, q), so
  P(X_(j) ≤ ξ_q ≤ X_(k)) ≥ P(j ≤ B ≤ k-1), whatever the distribution (ties
  only widen it). j is the largest rank with P(B ≤ j-1) ≤ α/2, k the smallest
  with P(B ≥ k) ≤ α/2, α = 2.5 % per arm (`ARM_TAIL` = 1.25 % per tail). The
  binomial tails are exact: the pmf at the rank from `math.lgamma`, then the
  pmf recurrence summed away from the mode until the terms are negligible
  (1e-17 of the sum), the normal approximation with continuity correction
  serving only as the first guess of the rank — so O(√n) terms, and no
  approximation error, up to the cap.
- The ratio's interval is [cand_low / prim_high, cand_high / prim_low]. By
  Bonferroni (the four one-sided misses each ≤ 1.25 %) it covers the true
  ratio with ≥ 95 % probability, and its low end alone is a ≥ 97.5 % lower
  bound: a candidate truly at or under the limit fails a single evaluation
  with probability ≤ 2.5 %.
- An interval end needs its rank to exist: k ≤ n needs q^n ≤ 1.25 %, i.e.
  n ≥ 7 for p50 and n ≥ `min_n(0.99)` = 437 for p99 (a p99 of fewer samples
  is in effect the maximum, which proves nothing); j ≥ 1 needs (1-q)^n ≤
  1.25 % (7 for p50, 1 for p99).
- Verdicts, both arms having at least `min_samples` samples of the series:
  "fail" when the ratio's low end exists and is above the limit — confidently
  worse, the only thing a rollback may act on; "pass" when both arms' whole
  intervals exist and the point estimate is at or under the limit (and it
  does not fail); otherwise "wait". Why asymmetric: rolling back needs
  confidence (a rollback on noise throws away a good candidate), advancing
  needs at least the best estimate and a quantile that means something (the
  interval existing), and a step that never gets enough traffic to judge
  simply holds. Rolling back on a p99 needs only the candidate's low end
  (small n) and the primary's high end (437 primary samples, which the
  primary's larger share gets first); advancing on it needs 437 candidate
  samples in the window — at a 5 % step with the default 300 s window, about
  29 requests/s overall. Below that the p99 gate waits and the step holds,
  by design. A zero denominator (a quantile of 0 s) leaves the value or that
  end unset ("wait" unless the other conditions fail it).
- TTFT exists for streams only: with no streamed request in an arm the TTFT
  gate waits, and steps hold (the eval runner's streamed questions feed it).
- Repeated looks: the 2.5 % is per evaluation. `evaluate()` runs every few
  seconds on overlapping windows, so over a whole step the chance of a false
  rollback grows — but little, the looks being strongly correlated and the
  bounds conservative. Simulated 900 s steps, lognormal TTFT (σ 0.5), looks
  every 5 s (180 per step): a candidate exactly at the limit was rolled back
  in 3 of 100 steps (candidate 1 req/s, primary 4) and 2 of 100 (4 and 16);
  one 10 % under the limit in 0 of 100; one 25 % over it in 50 of 50, within
  10-60 s at 4 req/s and 40-230 s at 1 req/s (`test_repeated_looks_over_a_step`
  keeps a smaller version of this).

Quality gate (only with `quality_required`): each arm's score is passed/total
of its latest eval run since `reset()` (not windowed: evals run once per
step); value = primary score - candidate score; fails when above
`quality_drop_max` (1e-9 of float slack: 0.90 vs 0.88 is a drop of exactly
0.02); waits until both arms have a result. Invalid results (total ≤ 0,
passed outside [0, total]) are dropped and counted.

Health: `unhealthy()` (the candidate's /health failed, its breaker opened)
returns a failing "health" gate and every `evaluate()` reports it failed
until `reset()`.

`GateReport.failed` is the first failing gate in the order health, oom,
error_rate, quality, p99_ratio, ttft_ratio (the gates tuple has that order);
`ready` is every gate passing.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

from proxy.policy.rollout import GatesPolicy

Arm = Literal["primary", "candidate"]
Verdict = Literal["pass", "fail", "wait"]
ARMS: tuple[Arm, ...] = ("primary", "candidate")
GATE_ORDER = ("health", "oom", "error_rate", "quality", "p99_ratio", "ttft_ratio")

CAP = 10_000  # samples per arm and series
ARM_TAIL = 0.0125  # per tail and arm: 97.5 % per arm, ≥ 95 % for the ratio (Bonferroni)
SLACK = 1e-9  # float slack on the quality comparison
_NEGLIGIBLE = 1e-17
_INF = math.inf


# -- the statistics (pure functions) ----------------------------------------------


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted, non-empty `xs` (linear interpolation, numpy's default)."""
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    if lo + 1 >= len(xs):
        return xs[-1]
    frac = h - lo
    return xs[lo] * (1.0 - frac) + xs[lo + 1] * frac


def _pmf(n: int, q: float, i: int) -> float:
    log_p = (
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(q)
        + (n - i) * math.log1p(-q)
    )
    return math.exp(log_p) if log_p > -745.0 else 0.0


def binom_cdf(n: int, q: float, m: int) -> float:
    """P(B ≤ m) for B ~ Binomial(n, q), 0 < q < 1."""
    if m < 0:
        return 0.0
    if m >= n:
        return 1.0
    if m > math.floor((n + 1) * q):  # above the mode: from the upper tail
        return max(0.0, 1.0 - binom_sf(n, q, m + 1))
    t = s = _pmf(n, q, m)
    r = (1.0 - q) / q
    i = m
    while i > 0 and t > s * _NEGLIGIBLE:  # terms fall away from the mode
        t *= i / (n - i + 1) * r
        i -= 1
        s += t
    return min(1.0, s)


def binom_sf(n: int, q: float, k: int) -> float:
    """P(B ≥ k) for B ~ Binomial(n, q), 0 < q < 1."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if k < math.floor((n + 1) * q):  # below the mode: from the lower tail
        return max(0.0, 1.0 - binom_cdf(n, q, k - 1))
    t = s = _pmf(n, q, k)
    r = q / (1.0 - q)
    i = k
    while i < n and t > s * _NEGLIGIBLE:
        t *= (n - i) / (i + 1) * r
        i += 1
        s += t
    return min(1.0, s)


def order_ranks(n: int, q: float, tail: float = ARM_TAIL) -> tuple[int | None, int | None]:
    """1-based ranks (j, k) of the order statistics bounding the q-quantile of
    n samples: j the largest with P(B ≤ j-1) ≤ tail, k the smallest with
    P(B ≥ k) ≤ tail, so P(X_(j) ≤ ξ_q ≤ X_(k)) ≥ 1 - 2·tail; None where no
    rank in [1, n] qualifies."""
    if n < 1:
        return None, None
    z = NormalDist().inv_cdf(1.0 - tail)
    mean, sd = n * q, math.sqrt(n * q * (1.0 - q))
    # Normal approximation with continuity correction: the first guess only.
    j = min(n, max(0, math.floor(mean + 0.5 - z * sd)))
    while j >= 1 and binom_cdf(n, q, j - 1) > tail:
        j -= 1
    while j < n and binom_cdf(n, q, j) <= tail:
        j += 1
    k = min(n + 1, max(1, math.ceil(mean + 0.5 + z * sd)))
    while k <= n and binom_sf(n, q, k) > tail:
        k += 1
    while k > 1 and binom_sf(n, q, k - 1) <= tail:
        k -= 1
    return (j if j >= 1 else None), (k if k <= n else None)


def min_n(q: float, tail: float = ARM_TAIL) -> int:
    """The fewest samples for which both ends of the q-quantile's interval exist."""
    n = max(1, math.ceil(math.log(tail) / math.log(max(q, 1.0 - q))) - 1)
    while None in order_ranks(n, q, tail):
        n += 1
    return n


# -- the report ------------------------------------------------------------------------


def _num(x: float | None) -> float | None:
    """JSON-safe: a non-finite figure (an overflowed ratio) becomes null."""
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True, slots=True)
class GateValue:
    gate: str  # "ttft_ratio" | "p99_ratio" | "error_rate" | "oom" | "quality" | "health"
    verdict: Verdict
    value: float | None  # the gate's figure; None = not enough data
    limit: float  # the policy's threshold
    arms: dict[str, float | None]  # per-arm figures, keyed "primary" and "candidate"
    low: float | None = None  # the interval of `value` (ratio gates), when computed
    high: float | None = None
    detail: str = ""  # one human sentence

    def as_dict(self) -> dict[str, Any]:
        return {
            "gate": self.gate,
            "verdict": self.verdict,
            "value": _num(self.value),
            "limit": _num(self.limit),
            "arms": {a: _num(v) for a, v in self.arms.items()},
            "low": _num(self.low),
            "high": _num(self.high),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class GateReport:
    at: float
    gates: tuple[GateValue, ...]
    failed: GateValue | None  # the first failing gate (hard gates first), None if none
    ready: bool  # every gate passes: the step may advance
    samples: dict[str, int]  # requests per arm in the window
    dropped: dict[str, int] = field(default_factory=dict)  # invalid samples per arm

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": _num(self.at),
            "ready": self.ready,
            "failed": self.failed.as_dict() if self.failed is not None else None,
            "samples": dict(self.samples),
            "dropped": dict(self.dropped),
            "gates": [g.as_dict() for g in self.gates],
        }


# -- the evaluator ---------------------------------------------------------------------


class _Series:
    """(at, value) samples over the window, capped, in time order (`at` and
    `v`, two deques side by side); their ascending order is brought up to
    date when it is read (`sorted()`, once per `evaluate()`, i.e. once per
    ladder window), not as samples come and go: on the request path a sample
    is two deque appends (and, at the cap, two pops). The order read last
    (`_flat`) is kept with what changed since: the values of it that left the
    window (`_gone`: popped from the front while they were still among the
    `_old` values the last read saw) and the values appended after it (the
    last len(v) − `_old`). A read takes the gone values out (one bisect each
    and slices copied around them) and merges the new ones in (a sort that
    finds the kept run and merges, O(n) in C); when most of the window
    changed it simply sorts it again. Kept in order on every add and pop
    instead (sorted runs of 256–512 values), a 16-chunk stream paid ~45,000
    instructions per request for the series at the cap."""

    __slots__ = ("_flat", "_gone", "_old", "at", "cap", "v")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.at: collections.deque[float] = collections.deque()
        self.v: collections.deque[float] = collections.deque()
        self._flat: list[float] = []  # the order read last
        self._old = 0  # the window's first `_old` values are in `_flat`
        self._gone: list[float] = []  # values of `_flat` that left the window since

    @property
    def q(self) -> list[tuple[float, float]]:
        """The window's (at, value) pairs in time order (a copy: for reports and tests)."""
        return list(zip(self.at, self.v, strict=True))

    def __len__(self) -> int:
        return len(self.v)

    def add(self, at: float, v: float) -> None:
        if len(self.v) >= self.cap:
            self.at.popleft()
            x = self.v.popleft()
            if self._old:
                self._old -= 1
                self._gone.append(x)
        self.at.append(at)
        self.v.append(v)

    def prune(self, horizon: float) -> None:
        at = self.at
        if at and at[0] < horizon:
            v = self.v
            gone = self._gone
            while at and at[0] < horizon:
                at.popleft()
                x = v.popleft()
                if self._old:
                    self._old -= 1
                    gone.append(x)

    def sorted(self) -> list[float]:
        """The window's values in ascending order (a list the caller only reads)."""
        v = self.v
        flat = self._flat
        gone = self._gone
        n_new = len(v) - self._old
        if not gone and not n_new:
            return flat
        if (len(gone) + n_new) * 2 > len(v):
            flat = sorted(v)  # most of the window changed
        else:
            if gone:
                gone.sort()
                kept: list[float] = []
                start = 0
                lo = 0
                for x in gone:
                    # Ascending, so each at or after the last one taken out.
                    i = bisect.bisect_left(flat, x, lo)
                    kept += flat[start:i]
                    start = lo = i + 1
                kept += flat[start:]
                flat = kept
            if n_new:
                flat = flat + list(itertools.islice(v, self._old, None))
                flat.sort()  # a sorted run and a short tail: merged
        self._flat = flat
        self._old = len(v)
        gone.clear()
        return flat

    @property
    def ordered(self) -> list[float]:
        return self.sorted()


class _ArmState:
    __slots__ = (
        "dropped",
        "latency",
        "n_failed",
        "n_oom",
        "quality",
        "req_at",
        "req_flags",
        "ttft",
    )

    def __init__(self, cap: int) -> None:
        # Requests: their times and flags side by side (bit 1 = failed, bit 2 =
        # oom); the totals kept alongside.
        self.req_at: collections.deque[float] = collections.deque()
        self.req_flags: collections.deque[int] = collections.deque()
        self.n_failed = 0
        self.n_oom = 0
        self.latency = _Series(cap)
        self.ttft = _Series(cap)
        self.dropped = 0
        self.quality: float | None = None

    def _pop(self) -> None:
        self.req_at.popleft()
        flags = self.req_flags.popleft()
        if flags:
            self.n_failed -= flags & 1
            self.n_oom -= (flags >> 1) & 1

    def add(self, at: float, failed: bool, oom: bool, cap: int) -> None:
        if len(self.req_at) >= cap:
            self._pop()
        self.req_at.append(at)
        if failed or oom:
            self.req_flags.append(int(failed) | (int(oom) << 1))
            self.n_failed += failed
            self.n_oom += oom
        else:
            self.req_flags.append(0)

    def prune(self, horizon: float) -> None:
        """Drop the requests that left the window (the hard gates' counts;
        the front checked: nothing to drop costs two comparisons)."""
        q = self.req_at
        if q and q[0] < horizon:
            while q and q[0] < horizon:
                self._pop()

    def prune_all(self, horizon: float) -> None:
        """Also the latency and TTFT series (before they are read)."""
        self.prune(horizon)
        self.latency.prune(horizon)
        self.ttft.prune(horizon)


def _sample(x: float | None) -> float | None:
    """A usable latency: finite and non-negative; None when absent; NaN when invalid."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    # + 0.0: a -0.0 is 0.0 (equal values are interchangeable in `_Series.ordered`).
    return v + 0.0 if math.isfinite(v) and v >= 0.0 else math.nan


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3g}{unit}"


class Gates:
    """The gates of one rollout step; see the module docstring."""

    def __init__(
        self, policy: GatesPolicy, *, quality_required: bool = False, cap: int = CAP
    ) -> None:
        self.policy = policy
        self.quality_required = quality_required
        self.cap = max(1, cap)
        self._arms: dict[str, _ArmState] = {}
        self._unhealthy = 0  # unhealthy() reports since reset()
        self._unhealthy_reason = ""
        self._last_at = -math.inf
        self._ranks: dict[tuple[int, float], tuple[int | None, int | None]] = {}
        self.reset()

    def reset(self) -> None:
        """A new step or a new rollout: forget every sample, result and health report."""
        self._arms = {a: _ArmState(self.cap) for a in ARMS}
        self._unhealthy = 0
        self._unhealthy_reason = ""
        self._last_at = -math.inf

    # -- inputs ----------------------------------------------------------------------

    def _arm(self, arm: str) -> _ArmState:
        st = self._arms.get(arm)
        if st is None:
            raise ValueError(f"unknown arm {arm!r}")
        return st

    def observe(
        self,
        arm: Arm,
        at: float,
        *,
        latency_s: float | None,
        ttft_s: float | None,
        failed: bool = False,
        oom: bool = False,
    ) -> GateValue | None:
        """One finished request of `arm`. Returns the failing hard gate (oom,
        then error_rate) when this candidate failure or OOM leaves it over its
        limit, else None."""
        if not (failed or oom):
            self.answered(arm, at, latency_s, ttft_s)
            return None
        st = self._arms.get(arm)
        if st is None:
            raise ValueError(f"unknown arm {arm!r}")
        if not isinstance(at, int | float) or not math.isfinite(at):
            st.dropped += 1
            return None
        at = self._clock_at(float(at))
        st.prune(at - self.policy.window_s)
        st.add(at, failed, oom, self.cap)
        if not failed:  # an OOM that still answered: its latency counts
            if latency_s is not None:
                self._odd_sample(st, st.latency, at, latency_s)
            if ttft_s is not None:
                self._odd_sample(st, st.ttft, at, ttft_s)
        if arm != "candidate":
            return None
        prim = self._arms["primary"]
        if oom:
            g = self._oom_gate(st, prim)
            if g.verdict == "fail":
                return g
        if failed:
            g = self._error_gate(st, prim)
            if g.verdict == "fail":
                return g
        return None

    def _clock_at(self, at: float) -> float:
        """`at`, or the latest seen when it is earlier (the deques stay in time order)."""
        if at < self._last_at:
            return self._last_at
        self._last_at = at
        return at

    def answered(self, arm: Arm, at: float, latency_s: float | None, ttft_s: float | None) -> None:
        """`observe()` of a request answered (not failed, no OOM), positional:
        the call on every request of a rollout, so the common case (a float
        clock, float latencies) is inline here: a few deque appends."""
        st = self._arms.get(arm)
        if st is None:
            raise ValueError(f"unknown arm {arm!r}")
        # (`type(...) is float` first: the runtime's clock and latencies are
        # floats, and the exact type test is the cheap one on every request;
        # a float is finite when `at - at` is 0.0 — inf and nan give nan —
        # with no call to `math.isfinite` or `float`.)
        if type(at) is float:
            if at - at != 0.0:
                st.dropped += 1
                return
        elif not isinstance(at, int | float) or not math.isfinite(at):
            st.dropped += 1
            return
        else:
            at = float(at)
        if at < self._last_at:
            at = self._last_at
        else:
            self._last_at = at
        # The requests' deques (the hard gates' counts), inline. The series
        # are pruned when read (`evaluate()`).
        q = st.req_at
        if q:
            horizon = at - self.policy.window_s
            if q[0] < horizon:
                st.prune(horizon)
            if len(q) >= self.cap:
                st._pop()
        q.append(at)
        st.req_flags.append(0)
        # A finite, non-negative float is usable as it is (the runtime's case,
        # on every request); anything else goes through `_sample`.
        if latency_s is not None:
            if type(latency_s) is float and 0.0 <= latency_s < _INF:
                s = st.latency
                if len(s.v) >= self.cap:
                    s.add(at, latency_s + 0.0)
                else:
                    s.at.append(at)
                    s.v.append(latency_s + 0.0)  # -0.0 as 0.0
            else:
                self._odd_sample(st, st.latency, at, latency_s)
        if ttft_s is not None:
            if type(ttft_s) is float and 0.0 <= ttft_s < _INF:
                s = st.ttft
                if len(s.v) >= self.cap:
                    s.add(at, ttft_s + 0.0)
                else:
                    s.at.append(at)
                    s.v.append(ttft_s + 0.0)
            else:
                self._odd_sample(st, st.ttft, at, ttft_s)

    @staticmethod
    def _odd_sample(st: _ArmState, series: _Series, at: float, x: object) -> None:
        """A latency or TTFT that is not a plain finite, non-negative float."""
        v = _sample(x)  # type: ignore[arg-type]
        if v is None:
            return
        if math.isnan(v):
            st.dropped += 1
        else:
            series.add(at, v)

    def quality(self, arm: Arm, passed: int, total: int, at: float) -> None:
        """An eval-set run's result for `arm`: `passed` of `total` checks."""
        st = self._arm(arm)
        try:
            p, t = int(passed), int(total)
        except (TypeError, ValueError, OverflowError):
            st.dropped += 1
            return
        if t <= 0 or not 0 <= p <= t:
            st.dropped += 1
            return
        st.quality = p / t

    def unhealthy(self, at: float, reason: str) -> GateValue:
        """The candidate's /health failed or its breaker opened: a failing gate,
        reported by every evaluate() until reset()."""
        self._unhealthy += 1
        self._unhealthy_reason = str(reason)
        return self._health_gate()

    # -- the gates -------------------------------------------------------------------

    def _health_gate(self) -> GateValue:
        n = self._unhealthy
        if not n:
            return GateValue("health", "pass", 0.0, 0.0, {"primary": None, "candidate": 0.0})
        reason = self._unhealthy_reason
        return GateValue(
            "health",
            "fail",
            float(n),
            0.0,
            {"primary": None, "candidate": float(n)},
            detail=f"candidate unhealthy: {reason}",
        )

    def _oom_gate(self, cand: _ArmState, prim: _ArmState) -> GateValue:
        limit = self.policy.oom_max
        arms: dict[str, float | None] = {
            "primary": float(prim.n_oom),
            "candidate": float(cand.n_oom),
        }
        n = len(cand.req_at)
        if cand.n_oom > limit:
            return GateValue(
                "oom",
                "fail",
                float(cand.n_oom),
                float(limit),
                arms,
                detail=f"candidate out-of-memory errors: {cand.n_oom} in {n} requests > {limit}",
            )
        if not n:
            return GateValue(
                "oom", "wait", None, float(limit), arms, detail="no candidate request yet"
            )
        return GateValue(
            "oom",
            "pass",
            float(cand.n_oom),
            float(limit),
            arms,
            detail=f"candidate out-of-memory errors: {cand.n_oom} in {n} requests ≤ {limit}",
        )

    def _error_gate(self, cand: _ArmState, prim: _ArmState) -> GateValue:
        limit = self.policy.error_rate_max
        n, k = len(cand.req_at), cand.n_failed
        np_ = len(prim.req_at)
        arms: dict[str, float | None] = {
            "primary": prim.n_failed / np_ if np_ else None,
            "candidate": k / n if n else None,
        }
        if not n:
            return GateValue(
                "error_rate", "wait", None, limit, arms, detail="no candidate request yet"
            )
        rate = k / n
        verdict: Verdict = "fail" if rate > limit else "pass"
        sign = ">" if verdict == "fail" else "≤"
        return GateValue(
            "error_rate",
            verdict,
            rate,
            limit,
            arms,
            detail=f"candidate failures: {k} of {n} requests ({rate:.2%}) {sign} {limit:.2%}",
        )

    def _quality_gate(self) -> GateValue:
        limit = self.policy.quality_drop_max
        cs, ps = self._arms["candidate"].quality, self._arms["primary"].quality
        arms: dict[str, float | None] = {"primary": ps, "candidate": cs}
        if cs is None or ps is None:
            missing = " and ".join(a for a, s in (("primary", ps), ("candidate", cs)) if s is None)
            return GateValue(
                "quality", "wait", None, limit, arms, detail=f"no eval-set result yet for {missing}"
            )
        drop = ps - cs
        verdict: Verdict = "fail" if drop > limit + SLACK else "pass"
        sign = ">" if verdict == "fail" else "≤"
        return GateValue(
            "quality",
            verdict,
            drop,
            limit,
            arms,
            detail=f"eval-set score {cs:.1%} vs {ps:.1%}: drop {drop:.1%} {sign} {limit:.1%}",
        )

    def _interval(self, xs: list[float], q: float) -> tuple[float | None, float | None]:
        n = len(xs)
        key = (n, q)
        ranks = self._ranks.get(key)
        if ranks is None:
            if len(self._ranks) >= 4096:
                self._ranks.clear()
            ranks = self._ranks[key] = order_ranks(n, q)
        j, k = ranks
        return (xs[j - 1] if j is not None else None), (xs[k - 1] if k is not None else None)

    def _ratio_gate(
        self, gate: str, what: str, q: float, cand: list[float], prim: list[float], limit: float
    ) -> GateValue:
        need = self.policy.min_samples
        nc, np_ = len(cand), len(prim)
        pc = quantile(cand, q) if nc else None
        pp = quantile(prim, q) if np_ else None
        arms: dict[str, float | None] = {"primary": pp, "candidate": pc}
        value = pc / pp if pc is not None and pp is not None and pp > 0 else None
        c_lo, c_hi = self._interval(cand, q)
        p_lo, p_hi = self._interval(prim, q)
        low = c_lo / p_hi if c_lo is not None and p_hi is not None and p_hi > 0 else None
        high = c_hi / p_lo if c_hi is not None and p_lo is not None and p_lo > 0 else None
        whole = None not in (c_lo, c_hi, p_lo, p_hi)
        figures = (
            f"candidate {what} {_fmt(pc, ' s')} vs {_fmt(pp, ' s')}: ratio {_fmt(value)} "
            f"[{_fmt(low)}, {_fmt(high)}]"
        )
        verdict: Verdict = "wait"
        if nc < need or np_ < need:
            detail = (
                f"waiting for {need} samples per arm (candidate {nc}, primary {np_}): {figures}"
            )
        elif low is not None and low > limit:
            verdict = "fail"
            detail = f"{figures}: confidently above {limit:g}"
        elif not whole:
            n_min = min_n(q)
            detail = (
                f"waiting: a {what} interval needs {n_min} samples per arm "
                f"(candidate {nc}, primary {np_}): {figures}"
            )
        elif value is None:
            detail = f"waiting: the primary's {what} is 0: {figures}"
        elif value <= limit:
            verdict = "pass"
            detail = f"{figures} ≤ {limit:g}"
        else:
            detail = f"{figures}: above {limit:g}, not yet confidently"
        return GateValue(gate, verdict, value, limit, arms, low, high, detail)

    def evaluate(self, now: float) -> GateReport:
        """Every gate over the window ending at `now` (old samples pruned first)."""
        p = self.policy
        cand, prim = self._arms["candidate"], self._arms["primary"]
        if isinstance(now, int | float) and math.isfinite(now):
            horizon = float(now) - p.window_s
            cand.prune_all(horizon)
            prim.prune_all(horizon)
        gates: list[GateValue] = [
            self._health_gate(),
            self._oom_gate(cand, prim),
            self._error_gate(cand, prim),
        ]
        if self.quality_required:
            gates.append(self._quality_gate())
        gates.append(
            self._ratio_gate(
                "p99_ratio",
                "latency p99",
                0.99,
                cand.latency.sorted(),
                prim.latency.sorted(),
                p.p99_ratio_max + p.p99_tolerance,
            )
        )
        if not (cand.ttft.v or prim.ttft.v):
            ttft = GateValue(
                "ttft_ratio",
                "wait",
                None,
                p.ttft_ratio_max,
                {"primary": None, "candidate": None},
                detail="no streamed request in the window: TTFT is measured on streams only",
            )
        else:
            ttft = self._ratio_gate(
                "ttft_ratio",
                "TTFT p50",
                0.5,
                cand.ttft.sorted(),
                prim.ttft.sorted(),
                p.ttft_ratio_max,
            )
        gates.append(ttft)
        failed = next((g for g in gates if g.verdict == "fail"), None)
        return GateReport(
            at=now,
            gates=tuple(gates),
            failed=failed,
            ready=all(g.verdict == "pass" for g in gates),
            samples={a: len(self._arms[a].req_at) for a in ARMS},
            dropped={a: self._arms[a].dropped for a in ARMS},
        )

    def held(self) -> dict[str, dict[str, int]]:
        """Samples held in memory per arm and series (bounded by `cap`)."""
        return {
            a: {
                "requests": len(s.req_at),
                "latency": len(s.latency.v),
                "ttft": len(s.ttft.v),
            }
            for a, s in self._arms.items()
        }
