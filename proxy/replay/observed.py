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
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any

from proxy.policy import Policy, PolicyError
from proxy.replay.trace import Trace, policy_from_knobs

# Attempts that made a backend call (the others never left admission).
_CALLED = frozenset({"answered", "failed", "ended"})


class ObservedWaits:
    """The recorded queue waits and when a replay may use them."""

    def __init__(self, trace: Trace, policy: Policy) -> None:
        self.waits: list[tuple[float, float, str]] = []  # (call, seconds, client)
        self.usable = False
        knobs = trace.recorded_policy
        if knobs is None or not trace.calls or trace.synthetic:
            return
        try:
            recorded = policy_from_knobs(knobs)
        except PolicyError:  # a policy this version cannot parse: the waits are modelled
            return
        if recorded.ladder.throttle != policy.ladder.throttle:
            return
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
        self.waits = self._rebuild(trace)
        self.usable = True

    def limit(self, t: float) -> int:
        i = bisect.bisect_right(self._limit_t, t) - 1
        return self._limit_v[i] if i >= 0 else self._limit0

    def tier(self, t: float) -> str:
        i = bisect.bisect_right(self._tier_t, t) - 1
        return self._tier_v[max(0, i)]

    def agrees(self, t: float, tier: str, limit: int) -> bool:
        """The replay stands where the recording stood at `t`."""
        return tier == self.tier(t) and limit == self.limit(t)

    def _rebuild(self, trace: Trace) -> list[tuple[float, float, str]]:
        held: list[float] = []  # attempt ends of the slots taken (a heap)
        admitted: list[tuple[float, float]] = []  # waiters: (call, end), a heap by call
        queue_until = 0.0  # the last waiter so far is served (or gives up) then
        out: list[tuple[float, float, str]] = []
        push, pop = heapq.heappush, heapq.heappop
        limit_t, limit_v, limit0 = self._limit_t, self._limit_v, self._limit0
        right = bisect.bisect_right
        for q in trace.requests:  # (a day of traffic: locals, `limit` inline)
            t = q.t
            atts = q.attempts
            a: Any = atts[0] if atts else None
            while admitted and admitted[0][0] <= t:
                push(held, pop(admitted)[1])
            while held and held[0] <= t:
                pop(held)
            called = a is not None and a.backend == "primary" and a.kind in _CALLED
            queued = q.outcome == "shed_queue_timeout"
            if not called and not queued:
                continue
            i = right(limit_t, t) - 1
            full = len(held) >= (limit_v[i] if i >= 0 else limit0) or queue_until > t
            if not full:
                if called:
                    push(held, a.end)
                continue
            if called:
                push(admitted, (a.start, a.end))
                queue_until = max(queue_until, a.start)
                out.append((a.start, max(0.0, a.start - t), q.client))
            else:
                queue_until = max(queue_until, t + q.duration)
        out.sort()
        return out
