"""The admission queue's waits as the recorded proxy saw them.

The throttle's queue-wait signal is the P95 of the waits of requests that
queued for a slot of the primary. A replay models them (its backends'
latencies decide when slots free up), and near the mark a few hundred
milliseconds decide whether a window is under pressure: the model's small
errors compound through the queue into a throttle that starts or ends a
second or two away from the recorded one (chaos drill 6, a 10x burst on a
host whose event loop ran late). What the proxy measured is in the
recording, so a replay uses it wherever it stands where the recording
stood: the same throttle knobs, the tier and admission limit the recorded
proxy had at that instant. Elsewhere (another policy took the ladder or the
limit elsewhere) the replay's own waits are the signal.

A recording has no wait record of its own: each request's wait is rebuilt
from what it does hold. A request waited if, when it arrived, the slots were
all taken (requests admitted at once hold theirs from their arrival, those
that waited from their backend call, all until their attempt ended) or an
earlier one was still waiting (the queue is served in order); its wait is
the time from its arrival to its backend call, reported at the call. Other
requests called late too (trimming counts tokens, a busy event loop) but
never queued: they report nothing, as in the proxy.

Whether a wait is evidence of engine pressure under the fair share is
decided as the proxy decided it, when the request queued: from the slots
each client held and the clients waiting then, in the recording
(`Admission.enqueue`). Decided at the call instead, the waiter's own new
slot counted against its share, and a wait the proxy counted was dropped.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import marshal
import math
from itertools import compress
from typing import Any

from proxy.control.pressure import Window
from proxy.policy import Policy, PolicyError
from proxy.replay.trace import Trace, policy_from_knobs

PRE_MAX_S = 5.0  # (as `Request.overhead`)
HANDOVER_S = 0.003  # (as `world.HANDOVER_S`)
WAKE_SCAN = 64  # releases looked back at for the one that woke a waiter
# Attempts that made a backend call (the others never left admission).
_CALLED = frozenset({"answered", "failed", "ended"})


class ObservedWaits:
    """The recorded queue waits and when a replay may use them (`policy`:
    the replayed one; None: only the rebuild, kept with the trace)."""

    def __init__(self, trace: Trace, policy: Policy | None) -> None:
        self.waits: list[tuple[float, float, bool]] = []  # (call, seconds, counts)
        # The proxy's own time before the backend call of a request that did
        # not queue (sessions, trimming's token count, a busy event loop), by
        # the request's id: in its recorded TTFT, replayed as recorded (a
        # queued request's is not told apart from its wait: none).
        self.pre: dict[int, float] = {}
        # A queued request's own time from the slot's handover to its backend
        # call (`_woken`), by the request's id: its slot is held meanwhile.
        self.gap: dict[int, float] = {}
        self.usable = False
        self._fair = False
        knobs = trace.recorded_policy
        if knobs is None or not trace.calls or trace.synthetic:
            return
        try:
            recorded = policy_from_knobs(knobs)
        except PolicyError:  # a policy this version cannot parse: the waits are modelled
            return
        same = policy is not None and recorded.ladder.throttle == policy.ladder.throttle
        self._fair = recorded.ladder.throttle.fair_share
        top = recorded.ladder.throttle.max_inflight
        first = trace.samples[0] if trace.samples else None
        start = top
        if first is not None and (not trace.limits or trace.limits[0][0] >= first["t"]):
            start = int(first.get("lim", top))
        self._limit_t = [t for t, _ in trace.limits]
        self._limit_v = [v for _, v in trace.limits]
        self._limit0 = start
        self._tier_t = [0.0, *(t for t, _frm, _to, _why in trace.tiers)]
        self._tier_v = [trace.initial_tier, *(to for _t, _frm, to, _why in trace.tiers)]
        self._queues = recorded.ladder.throttle.enabled
        # The rebuild is a function of the trace (and the policy it
        # recorded): kept with it, made once for every replay of it.
        rebuilt = trace.rebuilt_waits
        if rebuilt is None:
            rebuilt = trace.rebuilt_waits = (self._rebuild(trace), self.pre, self.gap)
        waits, self.pre, self.gap = rebuilt
        if same:
            self.waits, self.usable = waits, True

    def limit(self, t: float) -> int:
        i = bisect.bisect_right(self._limit_t, t) - 1
        return self._limit_v[i] if i >= 0 else self._limit0

    def tier(self, t: float) -> str:
        i = bisect.bisect_right(self._tier_t, t) - 1
        return self._tier_v[max(0, i)]

    def agrees(self, t: float, tier: str, limit: int) -> bool:
        """The replay stands where the recording stood at `t`."""
        return tier == self.tier(t) and limit == self.limit(t)

    def _rebuild(self, trace: Trace) -> list[tuple[float, float, bool]]:
        held: list[tuple[float, str]] = []  # slots taken: (attempt end, client), a heap
        admitted: list[tuple[float, float, str]] = []  # waiters: (call, end, client), by call
        gave_up: list[tuple[float, str]] = []  # waiters that timed out: (then, client)
        holds: dict[str, int] = {}  # slots held per client
        waiting: dict[str, int] = {}  # requests waiting per client
        queue_until = 0.0  # the last waiter so far is served (or gives up) then
        out: list[tuple[float, float, bool]] = []
        push, pop = heapq.heappush, heapq.heappop
        limit_t, limit_v, limit0 = self._limit_t, self._limit_v, self._limit0
        right = bisect.bisect_right
        pre, queues = self.pre, self._queues
        calls = [
            x
            for r in trace.requests
            for x in r.attempts
            if x.backend == "primary" and x.kind in _CALLED
        ]
        self._starts = sorted(x.start for x in calls)
        self._ends = sorted(x.end for x in calls)
        del calls
        self._stalls = trace.stalls()
        # `limit(t)` of the last instant looked up, and from and until when
        # it holds (the limits' instants sorted; the requests come in time
        # order: looked up again only past the next change).
        limit, since, until = limit0, math.inf, -math.inf
        ordered = all(a <= b for a, b in itertools.pairwise(limit_t))
        n_limits = len(limit_t)
        for q in trace.requests:  # (a day of traffic: locals, `limit` inline)
            t = q.t
            atts = q.attempts
            a: Any = atts[0] if atts else None
            while admitted and admitted[0][0] <= t:
                _call, end, who = pop(admitted)
                _add(waiting, who, -1)
                push(held, (end, who))
                _add(holds, who, 1)
            while held and held[0][0] <= t:
                who = pop(held)[1]
                n = holds.get(who, 0) - 1  # (`_add`, inline: once a request)
                if n > 0:
                    holds[who] = n
                else:
                    holds.pop(who, None)
            while gave_up and gave_up[0][0] <= t:
                _add(waiting, pop(gave_up)[1], -1)
            called = a is not None and a.backend == "primary" and a.kind in _CALLED
            queued = q.outcome == "shed_queue_timeout"
            if not called and not queued:
                if a is not None and len(atts) == 1 and a.kind in _CALLED:
                    pre[id(q)] = min(PRE_MAX_S, a.start - t)  # (no admission there)
                continue
            client = q.client
            if not since <= t < until:
                i = right(limit_t, t) - 1
                limit = limit_v[i] if i >= 0 else limit0
                if ordered:
                    since = limit_t[i] if i >= 0 else -math.inf
                    until = limit_t[i + 1] if i + 1 < n_limits else math.inf
            full = queues and (len(held) >= limit or queue_until > t)
            if not full:
                if called and len(atts) == 1:
                    pre[id(q)] = min(PRE_MAX_S, a.start - t)
                if called:
                    push(held, (a.end, client))
                    holds[client] = holds.get(client, 0) + 1  # (`_add`, inline)
                continue
            counts = self._counts(t, client, holds, waiting)
            _add(waiting, client, 1)
            if called:
                self.gap[id(q)] = min(PRE_MAX_S, a.start - self._woken(t, a.start))
                push(admitted, (a.start, a.end, client))
                queue_until = max(queue_until, a.start)
                out.append((a.start, max(0.0, a.start - t), counts))
            else:
                push(gave_up, (t + q.duration, client))
                queue_until = max(queue_until, t + q.duration)
        out.sort()
        return out

    def _woken(self, t: float, call: float) -> float:
        """When a request that queued at `t` and called the backend at `call`
        got its slot: the last release before the call that freed one (the
        backend had the limit in flight just before it) or the last raise of
        the limit, whichever came later — else its arrival; the recorded
        proxy's stalls in between do not count (nothing moved). From then to
        the call is the proxy's own time (its payload: the session, trimming's
        token count, a busy event loop), the slot held (chaos drill 6: 0.9 to
        1.4 s in the second burst, the engine half idle)."""
        ends, starts, right = self._ends, self._starts, bisect.bisect_right
        woken = t
        i = right(self._limit_t, call) - 1
        while i >= 0 and self._limit_t[i] > t:
            if self._limit_v[i] > (self._limit_v[i - 1] if i > 0 else self._limit0):
                woken = self._limit_t[i]
                break
            i -= 1
        j = right(ends, call + HANDOVER_S) - 1
        for _ in range(WAKE_SCAN):
            if j < 0 or ends[j] <= woken:
                break
            e = ends[j]
            if right(starts, e - 1e-9) - right(ends, e - 1e-9) >= self.limit(e - 1e-9):
                woken = e
                break
            j -= 1
        for a, b in self._stalls:  # (a few)
            lo, hi = max(a, woken), min(b, call)
            if hi > lo:
                woken += hi - lo
        return min(woken, call)

    def _counts(
        self, t: float, client: str, holds: dict[str, int], waiting: dict[str, int]
    ) -> bool:
        """Whether the proxy took a wait queued at `t` as engine pressure
        (`Admission.enqueue`: nobody past the fair share, the waiter under it)."""
        if not self._fair:
            return True
        n = len({*holds, *waiting, client})
        if n < 2:
            return True
        share = max(1, -(-self.limit(t) // n))
        return holds.get(client, 0) < share and max(holds.values(), default=0) <= share


def _add(counts: dict[str, int], key: str, by: int) -> None:
    n = counts.get(key, 0) + by
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def pack_waits(trace: Trace) -> bytes:
    """`trace.rebuilt_waits` (made by an `ObservedWaits` of it) as bytes for
    another process that holds the same trace: the waits, which requests
    the proxy's own time is known for (a byte each) and those times in the
    requests' order (the rebuild takes them in order); the same for a queued
    request's own time after its slot came (`gap`). `unpack_waits` puts
    them back."""
    rebuilt = trace.rebuilt_waits
    if rebuilt is None:
        return marshal.dumps(None)
    waits, pre, gap = rebuilt
    mask = bytes(map(pre.__contains__, map(id, trace.requests)))
    gap_mask = bytes(map(gap.__contains__, map(id, trace.requests)))
    gaps = [gap[id(q)] for q in compress(trace.requests, gap_mask)]
    return marshal.dumps((waits, mask, list(pre.values()), gap_mask, gaps), 2)


def unpack_waits(blob: bytes, trace: Trace) -> None:
    """`pack_waits`' rebuild, kept with this process's `trace` (the same)."""
    got = marshal.loads(blob)
    if got is None:
        return
    waits, mask, values, gap_mask, gaps = got
    if mask.count(1) != len(values) or gap_mask.count(1) != len(gaps):
        raise ValueError("packed waits of another trace")
    pre = dict(zip(map(id, compress(trace.requests, mask)), values, strict=True))
    gap = dict(zip(map(id, compress(trace.requests, gap_mask)), gaps, strict=True))
    trace.rebuilt_waits = (waits, pre, gap)


class RecordedBaseline(Window):
    """The throttle's TTFT baseline window (`PressureMonitor.ttft_base`) with
    the recorded proxy's history.

    The baseline spans `baseline_window_s` (an hour by default): when the
    trace begins, the recorded proxy's window already held the TTFTs of the
    hour before, which the trace does not. Replayed from the trace alone,
    the baseline is the trace's own TTFTs, and a trace that is all one
    episode (a burst: its TTFTs are the slow ones) reads its short window
    against itself — a ratio the recorded proxy never saw (chaos drill 6:
    the TTFT signal held the recorded throttle for 57 s; without its
    history the replay let it go after 10). The recording's samples carry
    the baseline's P95 once a second: for the first `baseline_window_s` of
    the trace, the replay's baseline is the latest recorded one (its count
    taken as enough: the recorded proxy had its history), its own after
    that. Used only when the replayed throttle is the recorded one (the
    same window, the same marks); limit: a candidate that changes the
    TTFTs early in the trace changes its short window, not this baseline.
    """

    def __init__(self, span_s: float, min_samples: int, recorded: list[tuple[float, float]]):
        super().__init__(span_s)
        self._min = min_samples
        self._rec_t = [t for t, _ in recorded]
        self._rec_v = [v for _, v in recorded]

    def p95(self, now: float) -> tuple[float, int]:
        own = super().p95(now)
        if now >= self.span_s:
            return own
        i = bisect.bisect_right(self._rec_t, now) - 1
        if i < 0:
            return own
        return self._rec_v[i], max(own[1], self._min)

    @classmethod
    def of(cls, trace: Trace, policy: Policy) -> RecordedBaseline | None:
        """The baseline for a replay of `trace` under `policy`, or None (the
        replay's own: another throttle, no recorded baseline)."""
        knobs = trace.recorded_policy
        if knobs is None or trace.synthetic or not trace.samples:
            return None
        recorded = [
            (float(s["t"]), float(s["ttft_base"]))
            for s in trace.samples
            if isinstance(s.get("ttft_base"), int | float)
        ]
        if not recorded:
            return None
        try:
            throttle = policy_from_knobs(knobs).ladder.throttle
        except PolicyError:
            return None
        if throttle != policy.ladder.throttle:
            return None
        return cls(throttle.baseline_window_s, throttle.min_samples, recorded)
