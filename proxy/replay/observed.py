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
import math
from typing import Any

from proxy.policy import Policy, PolicyError
from proxy.replay.trace import Trace, policy_from_knobs

# Attempts that made a backend call (the others never left admission).
_CALLED = frozenset({"answered", "failed", "ended"})


class ObservedWaits:
    """The recorded queue waits and when a replay may use them."""

    def __init__(self, trace: Trace, policy: Policy) -> None:
        self.waits: list[tuple[float, float, bool]] = []  # (call, seconds, counts)
        self.usable = False
        self._fair = False
        knobs = trace.recorded_policy
        if knobs is None or not trace.calls or trace.synthetic:
            return
        try:
            recorded = policy_from_knobs(knobs)
        except PolicyError:  # a policy this version cannot parse: the waits are modelled
            return
        if recorded.ladder.throttle != policy.ladder.throttle:
            return
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
                continue
            client = q.client
            if not since <= t < until:
                i = right(limit_t, t) - 1
                limit = limit_v[i] if i >= 0 else limit0
                if ordered:
                    since = limit_t[i] if i >= 0 else -math.inf
                    until = limit_t[i + 1] if i + 1 < n_limits else math.inf
            full = len(held) >= limit or queue_until > t
            if not full:
                if called:
                    push(held, (a.end, client))
                    holds[client] = holds.get(client, 0) + 1  # (`_add`, inline)
                continue
            counts = self._counts(t, client, holds, waiting)
            _add(waiting, client, 1)
            if called:
                push(admitted, (a.start, a.end, client))
                queue_until = max(queue_until, a.start)
                out.append((a.start, max(0.0, a.start - t), counts))
            else:
                push(gave_up, (t + q.duration, client))
                queue_until = max(queue_until, t + q.duration)
        out.sort()
        return out

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
