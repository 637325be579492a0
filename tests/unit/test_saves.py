"""Turns waiting out a session-store outage: kept in order, bounded."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.saves import PendingSaves
from proxy.sessions import SessionStoreUnavailable, Turn


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
