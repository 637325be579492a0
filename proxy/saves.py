"""Turns that could not be saved because the session store was down.

A finished answer's turn is already promised to the client (the request said
`X-Brownout-Session: used`), so a failed save is not dropped: it waits here,
in order, and is written when the store answers again. Once anything waits,
new saves queue behind it, so a session's turns keep their order. The queue
is bounded (`sessions.pending_saves`); past it the oldest waiting turn is
dropped and counted (`brownout_session_turns_dropped_total`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import structlog

from proxy.sessions import SessionStore, SessionStoreUnavailable, Turn

log = structlog.get_logger("brownout.sessions")


class PendingSaves:
    def __init__(
        self,
        limit: int,
        on_saved: Callable[[], None] | None = None,
        on_dropped: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self._q: collections.deque[tuple[str, Turn]] = collections.deque()
        self._on_saved = on_saved
        self._on_dropped = on_dropped
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, key: str, turn: Turn) -> None:
        if len(self._q) >= self.limit:
            self._q.popleft()
            if self._on_dropped is not None:
                self._on_dropped()
        self._q.append((key, turn))

    async def save(self, store: SessionStore, key: str, turn: Turn) -> bool:
        """Save now, or queue it. True when it is in the store already."""
        if self._q:
            self.add(key, turn)
            await self.flush(store)
            return False
        try:
            await store.append(key, [turn])
        except SessionStoreUnavailable:
            self.add(key, turn)
            return False
        return True

    async def flush(self, store: SessionStore) -> int:
        """Write what waits, oldest first, until the store fails again."""
        written = 0
        async with self._lock:
            while self._q:
                key, turn = self._q[0]
                try:
                    await store.append(key, [turn])
                except SessionStoreUnavailable:
                    break
                self._q.popleft()
                written += 1
                if self._on_saved is not None:
                    self._on_saved()
        if written:
            log.info("session_turns_saved_late", turns=written, waiting=len(self._q))
        return written
