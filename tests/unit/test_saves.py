"""Turns waiting out a session-store outage: kept in order, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from proxy.sessions.saves import ATTEMPTS, PendingSaves
from proxy.sessions.store import SessionStoreUnavailable, SessionTurnRejected, Turn


class FlakyStore:
    def __init__(self) -> None:
        self.up = True
        self.saved: list[tuple[str, str]] = []

    async def append(
        self, key: str, new_turns: Sequence[Turn], max_turns: int | None = None,
        ttl_s: int | None = None,
    ) -> int:  # fmt: skip
        if not self.up:
            raise SessionStoreUnavailable("down")
        self.saved.extend((key, t.user) for t in new_turns)
        return len(self.saved)


async def test_outage_keeps_turns_in_order_and_writes_them_later() -> None:
    store = FlakyStore()
    q = PendingSaves(limit=100)
    assert await q.save(store, "s", Turn("q1", "a1"))  # type: ignore[arg-type]
    store.up = False
    assert not await q.save(store, "s", Turn("q2", "a2"))  # type: ignore[arg-type]
    assert not await q.save(store, "t", Turn("x1", "y1"))  # type: ignore[arg-type]
    store.up = True
    # Anything waiting goes first, so a session's turns keep their order.
    assert not await q.save(store, "s", Turn("q3", "a3"))  # type: ignore[arg-type]
    assert store.saved == [("s", "q1"), ("s", "q2"), ("t", "x1"), ("s", "q3")]
    assert len(q) == 0


async def test_bounded_queue_drops_the_oldest_and_counts_it() -> None:
    dropped: list[int] = []
    store = FlakyStore()
    store.up = False
    q = PendingSaves(limit=2, on_dropped=lambda: dropped.append(1))
    for i in range(3):
        await q.save(store, "s", Turn(f"q{i}", "a"))  # type: ignore[arg-type]
    assert len(q) == 2
    assert dropped == [1]
    store.up = True
    assert await q.flush(store) == 2  # type: ignore[arg-type]
    assert store.saved == [("s", "q1"), ("s", "q2")]


class PickyStore(FlakyStore):
    """Refuses (or fails on) the turns whose user text starts with "bad"."""

    def __init__(self, fail_with: Exception) -> None:
        super().__init__()
        self.fail_with = fail_with
        self.tries: list[str] = []

    async def append(
        self, key: str, new_turns: Sequence[Turn], max_turns: int | None = None,
        ttl_s: int | None = None,
    ) -> int:  # fmt: skip
        self.tries.extend(t.user for t in new_turns)
        if self.up and any(t.user.startswith("bad") for t in new_turns):
            raise self.fail_with
        return await super().append(key, new_turns, max_turns, ttl_s)


@pytest.mark.parametrize(
    "failure",
    [SessionTurnRejected("user_script:1: invalid unicode escape"), TypeError("not UTF-8")],
    ids=["refused", "unexpected"],
)
async def test_a_poison_turn_is_dropped_after_bounded_retries_and_counted(
    failure: Exception,
) -> None:
    rejected: list[int] = []
    store = PickyStore(failure)
    store.up = False
    q = PendingSaves(limit=100, on_rejected=lambda: rejected.append(1))
    # Queued in an outage: the poison turn is at the head of the queue.
    assert not await q.save(store, "s", Turn("bad turn", "a"))  # type: ignore[arg-type]
    assert not await q.save(store, "s", Turn("q2", "a"))  # type: ignore[arg-type]
    store.up = True
    flushes = 0
    while len(q) and flushes < 10:
        await q.flush(store)  # type: ignore[arg-type]
        flushes += 1
    assert flushes == ATTEMPTS
    # Tried twice in the outage (that costs no attempt), then `ATTEMPTS` times.
    assert store.tries.count("bad turn") == 2 + ATTEMPTS
    assert rejected == [1]
    # What came after it is saved, in order, and later saves go straight in.
    assert store.saved == [("s", "q2")]
    assert await q.save(store, "t", Turn("q3", "a"))  # type: ignore[arg-type]
    assert store.saved == [("s", "q2"), ("t", "q3")]


async def test_saving_never_raises_and_a_failed_direct_save_is_bounded_too() -> None:
    rejected: list[int] = []
    store = PickyStore(RuntimeError("a defect in the store"))
    q = PendingSaves(limit=100, on_rejected=lambda: rejected.append(1))
    assert ATTEMPTS == 3
    assert not await q.save(store, "s", Turn("bad direct", "a"))  # type: ignore[arg-type]
    assert len(q) == 1
    assert not await q.save(store, "s", Turn("next1", "a"))  # type: ignore[arg-type]
    assert rejected == []
    assert not await q.save(store, "s", Turn("next2", "a"))  # type: ignore[arg-type]
    assert rejected == [1]
    assert len(q) == 0
    assert store.saved == [("s", "next1"), ("s", "next2")]
    assert await q.save(store, "s", Turn("next3", "a"))  # type: ignore[arg-type]


class HungStore:
    """A store that hangs until released, then fails (a Redis that stopped
    answering: each attempt costs the caller a full redis_timeout_s)."""

    def __init__(self) -> None:
        self.attempts = 0
        self.release = asyncio.Event()

    async def append(
        self, key: str, new_turns: Sequence[Turn], max_turns: int | None = None,
        ttl_s: int | None = None,
    ) -> int:  # fmt: skip
        self.attempts += 1
        await self.release.wait()
        raise SessionStoreUnavailable("timed out")


async def test_concurrent_saves_behind_a_waiting_queue_share_one_flush() -> None:
    # Used to: each save, with turns waiting, ran its own flush under the
    # lock, so N answers finishing while Redis hung waited N × the Redis
    # timeout, one after the other (the last non-stream answer ~N × 0.25 s late).
    store = HungStore()
    q = PendingSaves(limit=100)
    q.add("s", Turn("waiting", "a"))
    saves = [
        asyncio.ensure_future(q.save(store, "s", Turn(f"q{i}", "a")))  # type: ignore[arg-type]
        for i in range(20)
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert store.attempts == 1  # the first save's flush is trying the head turn
    store.release.set()
    assert await asyncio.gather(*saves) == [False] * 20
    assert store.attempts == 1  # one timeout in all, not 20 in a row
    assert len(q) == 21  # nothing lost, in order
