"""Admission control: a concurrency limit, a bounded priority queue, early 429s.

vLLM queues without bound and never says 429, so the proxy holds the line:

- at most `limit` requests in flight (normally vLLM's `--max-num-seqs`; the
  throttle tier lowers it);
- beyond that, a bounded wait queue served by priority (`critical`, then
  `normal`, then `sheddable`), first-in first-out within a priority;
- a request is rejected at once — 429 with `Retry-After` — when the queue is
  full and nothing of lower priority can be evicted for it, when its expected
  wait (its queue position ÷ the measured drain rate) exceeds the queue
  deadline, or, in the throttle tier, when it is sheddable. A request that
  does wait and reaches its deadline is rejected too. Evicted and timed-out
  waiters get the same 429.

`Retry-After` = ⌈(queued + 1) ÷ drain rate⌉ seconds, clamped to 1–60 (so
clients come back when there is room, not all at once).

Fair share (`fair_share`, on by default): each request carries its client's
identity (`proxy.ingress.identity`), and the pool counts the slots each
client holds. Nothing changes while a slot is free. When requests wait, a
freed slot goes, within the highest waiting priority, to the waiter whose
client holds the fewest slots (first-in first-out among equals: with one
client this is plain FIFO) — max-min fairness, so a client that grabbed the
pool while it was idle gives slots back to the others as its requests end,
down to its share, ⌈limit ÷ clients holding or waiting⌉. A full queue sheds
the newest waiter of the client holding the most slots before it refuses a
request from a client under its share. And a wait is reported as engine
pressure only if, when it queued, its client held less than its share and
no client held more: a wait behind one client's excess (or the waiter's
own) is that client's doing, and cutting the limit for it would punish
everybody (chaos drill 8: one client's long answers drove the throttle
tier, limit 8 → 1, and the others were shed).

The drain rate is measured on busy time only, by Little's law: slots ÷ mean
service time, where the mean service time is the slot-seconds spent in
flight ÷ completions, both averaged over the last `DRAIN_WINDOW_S` seconds
of busy time. Idle time counts for nothing (a burst after a quiet minute
sees the rate the pool had when it was last busy), completions in the same
instant share the busy time they used (they cannot read as 1,000/s), and
requests that run long without completing lower the estimate as they go.
The mean service time is bounded below by `MIN_SERVICE_S`.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from proxy.policy import PRIORITIES, RANK, AdmissionPolicy, Priority

__all__ = ["PRIORITIES", "Admission", "AdmissionPolicy", "Priority", "Rejected"]

DRAIN_WINDOW_S = 10.0  # busy seconds the drain-rate estimate averages over
MIN_SERVICE_S = 0.005  # the mean service time is never taken as shorter


class Rejected(Exception):
    """Not admitted: becomes a 429 with Retry-After."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class Slot(Protocol):
    """What a waiter is woken through: an `asyncio.Future` on the event loop;
    `brownout replay`'s virtual clock passes its own."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def set_result(self, result: None, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass(slots=True)
class Waiter:
    priority: Priority
    future: Slot
    enqueued: float
    client: str
    counts: bool  # its wait is evidence of engine pressure (see the module text)


class Admission:
    """One per backend pool. Not thread-safe; lives on the event loop."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        clock: Callable[[], float],
        on_wait: Callable[[float, bool], None] | None = None,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.on_wait = on_wait
        self.limit = policy.max_inflight
        self.inflight = 0
        self.shed_sheddable = False  # set by the throttle tier
        self.held: dict[str, int] = {}  # slots held per client identity
        self._queues: dict[Priority, collections.deque[Waiter]] = {
            p: collections.deque() for p in PRIORITIES
        }
        self._queued = 0
        # Drain rate (Little's law on busy time): slot-seconds in flight and
        # completions, both decayed over DRAIN_WINDOW_S of busy time.
        self._area = 0.0
        self._done = 0.0
        self._t = clock()

    # -- state -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._queued

    def _decayed(self, now: float) -> tuple[float, float]:
        """(slot-seconds, completions) as of `now`: busy time decays both and
        adds to the first; idle time changes nothing."""
        dt = now - self._t
        if dt <= 0 or self.inflight <= 0:
            return self._area, self._done
        keep = math.exp(-dt / DRAIN_WINDOW_S)
        return self._area * keep + self.inflight * dt, self._done * keep

    def _advance(self) -> None:
        # `_decayed`, inline: this runs twice on every admitted request.
        now = self.clock()
        dt = now - self._t
        if dt > 0 and self.inflight > 0:
            keep = math.exp(-dt / DRAIN_WINDOW_S)
            self._area = self._area * keep + self.inflight * dt
            self._done *= keep
        self._t = now

    def drain_rate(self) -> float:
        """Completions per second the queue can expect: slots ÷ mean service
        time (0 until something has completed)."""
        area, done = self._decayed(self.clock())
        if done <= 1e-9:
            return 0.0
        service = max(MIN_SERVICE_S, area / done)
        return max(self.limit, self.inflight) / service

    def retry_after(self, position: int | None = None) -> int:
        pos = (self._queued if position is None else position) + 1
        rate = self.drain_rate()
        if rate <= 0:
            return min(60, max(1, math.ceil(self.policy.queue_timeout_s)))
        return min(60, max(1, math.ceil(pos / rate)))

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    # -- admission ---------------------------------------------------------------

    async def acquire(self, priority: Priority, client: str = "") -> None:
        """Wait for a slot or raise Rejected. `client` is the request's
        identity for the fair share (every request of one client: same string)."""
        if self.admit(priority, client):
            return
        w = self.enqueue(priority, client, asyncio.get_running_loop().create_future())
        future = cast("asyncio.Future[None]", w.future)
        try:
            async with asyncio.timeout(self.policy.queue_timeout_s):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                # The slot was handed over in the same step the deadline hit:
                # it is ours, so use it rather than leak it.
                pass
            else:
                self.abandon(w)
                raise Rejected("queue_timeout", self.retry_after()) from None
        except asyncio.CancelledError:
            # The client left while waiting; if a slot was just handed over, give it back.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(client)
            else:
                self.abandon(w)
            raise
        self.waited(w)

    # The steps of `acquire`, synchronous (no I/O, no await): `brownout
    # replay` drives them on its virtual clock with its own `Slot`s.

    def admit(self, priority: Priority, client: str = "") -> bool:
        """Take a slot now (True), or say the request must wait (False);
        raises Rejected for a sheddable request in the throttle tier."""
        if self.shed_sheddable and priority == "sheddable":
            raise Rejected("shed", self.retry_after())
        inflight = self.inflight
        if inflight < self.limit and (not self._queued or not self._ahead_of(priority)):
            # `_take` and `_advance`, inline: every admitted request.
            now = self.clock()
            dt = now - self._t
            if dt > 0 and inflight > 0:
                keep = math.exp(-dt / DRAIN_WINDOW_S)
                self._area = self._area * keep + inflight * dt
                self._done *= keep
            self._t = now
            self.inflight = inflight + 1
            held = self.held
            held[client] = held.get(client, 0) + 1
            return True
        return False

    def enqueue(self, priority: Priority, client: str, future: Slot) -> Waiter:
        """Queue a request `admit` could not take: `future` gets its slot
        (`set_result`) or its eviction (`set_exception(Rejected)`). Raises
        Rejected when the queue is full and nothing can be evicted for it, or
        when its expected wait exceeds the deadline. The caller times the
        wait out (`queue_timeout_s`: then `abandon`) and reports it (`waited`)."""
        fair = self.policy.fair_share
        share, clients = self.share(client) if fair else (self.limit, 1)
        mine = self.held.get(client, 0)
        if (
            self._queued >= self.policy.queue_size
            and not self._evict_below(priority)
            and not (fair and mine < share and self._evict_heaviest(priority, client, share))
        ):
            raise Rejected("queue_full", self.retry_after())
        position = self._position(priority, client if fair else None)
        rate = self.drain_rate()
        if rate > 0 and (position + 1) / rate > self.policy.queue_timeout_s:
            raise Rejected("deadline", self.retry_after(position))
        # Engine pressure only if nobody is past its share: a wait behind a
        # client holding more than its share (or the waiter's own excess) is
        # that client's doing, and cutting the limit would punish everyone.
        counts = clients < 2 or (mine < share and max(self.held.values(), default=0) <= share)
        w = Waiter(priority, future, self.clock(), client, counts)
        self._queues[priority].append(w)
        self._queued += 1
        return w

    def abandon(self, w: Waiter) -> None:
        """A waiter gave up (its deadline, its client left) before a slot came."""
        self._remove(w)

    def waited(self, w: Waiter) -> None:
        """A waiter got its slot: its wait is reported (`on_wait`)."""
        if self.on_wait is not None:
            self.on_wait(self.clock() - w.enqueued, w.counts)

    def share(self, client: str) -> tuple[int, int]:
        """(⌈limit ÷ clients⌉, clients): the fair share of one client, counting
        the clients holding slots or waiting, and `client` itself."""
        who = set(self.held)
        for q in self._queues.values():
            who.update(w.client for w in q)
        who.add(client)
        n = len(who)
        return max(1, -(-self.limit // n)), n

    def release(self, client: str = "") -> None:
        # `_advance`, inline: every request.
        now = self.clock()
        inflight = self.inflight
        dt = now - self._t
        if dt > 0 and inflight > 0:
            keep = math.exp(-dt / DRAIN_WINDOW_S)
            self._area = self._area * keep + inflight * dt
            self._done *= keep
        self._t = now
        self.inflight = inflight - 1
        held = self.held
        n = held.get(client, 0) - 1
        if n > 0:
            held[client] = n
        else:
            held.pop(client, None)
        self._done += 1.0
        if self._queued:  # (`_wake` has nobody to wake otherwise)
            self._wake()

    def _wake(self) -> None:
        while self.inflight < self.limit and self._queued:
            w = self._pop()
            if w is None:
                return
            if w.future.done():  # timed out or cancelled meanwhile
                continue
            self._take(w.client)
            w.future.set_result(None)

    def _take(self, client: str) -> None:
        self._advance()
        self.inflight += 1
        held = self.held
        held[client] = held.get(client, 0) + 1

    def _pop(self) -> Waiter | None:
        for p in PRIORITIES:
            q = self._queues[p]
            if q:
                self._queued -= 1
                if len(q) == 1 or not self.policy.fair_share:
                    return q.popleft()
                # Max-min fairness: the waiter whose client holds the fewest
                # slots (the first of them); a scan, only while requests wait.
                held = self.held
                best, fewest = 0, held.get(q[0].client, 0)
                for i, w in enumerate(q):
                    n = held.get(w.client, 0)
                    if n < fewest:
                        best, fewest = i, n
                        if n == 0:
                            break
                w = q[best]
                del q[best]
                return w
        return None

    def _remove(self, w: Waiter) -> None:
        try:
            self._queues[w.priority].remove(w)
            self._queued -= 1
        except ValueError:
            pass

    def _ahead_of(self, priority: Priority) -> bool:
        """Someone of the same or higher priority is already waiting."""
        return any(self._queues[p] for p in PRIORITIES[: RANK[priority] + 1])

    def _position(self, priority: Priority, client: str | None = None) -> int:
        """Waiters served before a new request of `priority` (of `client`,
        under the fair share: at its own priority only those whose client
        holds no more slots than `client` does)."""
        higher = PRIORITIES[: RANK[priority]]
        ahead = sum(len(self._queues[p]) for p in higher)
        if client is None:
            return ahead + len(self._queues[priority])
        held = self.held
        mine = held.get(client, 0)
        return ahead + sum(1 for w in self._queues[priority] if held.get(w.client, 0) <= mine)

    def _evict_below(self, priority: Priority) -> bool:
        """Make room for `priority` by shedding the newest lower-priority waiter."""
        for p in reversed(PRIORITIES):
            if RANK[p] <= RANK[priority]:
                return False
            q = self._queues[p]
            if q:
                w = q.pop()
                self._queued -= 1
                if not w.future.done():
                    w.future.set_exception(Rejected("evicted", self.retry_after()))
                return True
        return False

    def _evict_heaviest(self, priority: Priority, client: str, share: int) -> bool:
        """Make room for a request of a client under its share by shedding the
        newest waiter, of `priority` or lower, of the client holding the most
        slots (if it holds at least its share)."""
        held = self.held
        heavy = max(
            (w.client for p in PRIORITIES[RANK[priority] :] for w in self._queues[p]),
            key=lambda c: held.get(c, 0),
            default=None,
        )
        if heavy is None or heavy == client or held.get(heavy, 0) < share:
            return False
        for p in reversed(PRIORITIES[RANK[priority] :]):
            q = self._queues[p]
            for i in range(len(q) - 1, -1, -1):
                w = q[i]
                if w.client == heavy:
                    del q[i]
                    self._queued -= 1
                    if not w.future.done():
                        w.future.set_exception(Rejected("evicted", self.retry_after()))
                    return True
        return False

    def snapshot(self) -> dict[str, object]:
        return {
            "limit": self.limit,
            "inflight": self.inflight,
            "queued": {p: len(q) for p, q in self._queues.items()},
            "drain_rate": round(self.drain_rate(), 2),
            "shedding_sheddable": self.shed_sheddable,
            "clients": len(self.held),
        }
