"""Turns that could not be saved because the session store was down.

A finished answer's turn is already promised to the client (the request said
`X-Brownout-Session: used`), so a failed save is not dropped: it waits here,
in order, and is written when the store answers again. Once anything waits,
new saves queue behind it, so a session's turns keep their order. The queue
is bounded (`sessions.pending_saves`); past it the oldest waiting turn is
dropped and counted (`brownout_session_turns_dropped_total`).

No single turn can stop the queue: a turn the store refuses (it answered,
with an error about these contents) or that fails in an unexpected way is
tried `attempts` times, then dropped, logged and counted
(`brownout_session_ops_total{op="save",result="rejected"}`). An outage
(`SessionStoreUnavailable`: Redis down, slow, or refusing writes — OOM,
READONLY, BUSY, MISCONF) costs a turn no attempt: it waits for the store. A
turn that would create a session past its client's cap
(`SessionLimitReached`) is not stored and not queued: waiting cannot make
room (`on_limited` counts it when it waited in the queue; `save` says so).
The queue outlives policy reloads (one per process); saving never raises.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from proxy.sessions.store import (
    SessionLimitReached,
    SessionStore,
    SessionStoreUnavailable,
    SessionTurnRejected,
    Turn,
)

log = structlog.get_logger("brownout.sessions")

ATTEMPTS = 3


async def _append(store: SessionStore, key: str, turn: Turn, client: str | None) -> None:
    if client is None:  # stores without a client cap take no `client`
        await store.append(key, [turn])
    else:
        await store.append(key, [turn], client=client)


@dataclass(slots=True)
class _Waiting:
    key: str
    turn: Turn
    client: str | None = None
    failures: int = 0


class PendingSaves:
    def __init__(
        self,
        limit: int,
        on_saved: Callable[[], None] | None = None,
        on_dropped: Callable[[], None] | None = None,
        on_rejected: Callable[[], None] | None = None,
        attempts: int = ATTEMPTS,
        on_limited: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self.attempts = attempts
        self._q: collections.deque[_Waiting] = collections.deque()
        self._on_saved = on_saved
        self._on_dropped = on_dropped
        self._on_rejected = on_rejected
        self._on_limited = on_limited
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._q)

    def waiting(self, key: str) -> list[Turn]:
        """The turns of session `key` that wait, oldest first: a load merges
        them after the stored history, so a conversation keeps its context
        while Redis refuses writes but serves reads."""
        if not self._q:
            return []
        return [w.turn for w in self._q if w.key == key]

    def add(self, key: str, turn: Turn, client: str | None = None) -> None:
        while len(self._q) >= max(1, self.limit):
            self._q.popleft()
            if self._on_dropped is not None:
                self._on_dropped()
        self._q.append(_Waiting(key, turn, client))

    async def save(
        self, store: SessionStore, key: str, turn: Turn, client: str | None = None
    ) -> bool | None:
        """Save now, or queue it. True when it is in the store already, False
        when it waits, None when it is refused for good (the client's session
        cap). Never raises."""
        if self._q:
            self.add(key, turn, client)
            if self._lock.locked():
                # A flush is running: it goes on until the queue is empty (this
                # turn included) or the store fails. Wait for it rather than
                # try the store again after it: N answers finishing while
                # Redis hangs would otherwise wait N timeouts in a row.
                async with self._lock:
                    pass
            else:
                await self.flush(store)
            return False
        try:
            await _append(store, key, turn, client)
        except SessionLimitReached as exc:  # the caller counts it
            log.warning("session_save_over_client_limit", key=key, error=str(exc))
            return None
        except SessionStoreUnavailable as exc:
            if isinstance(exc, SessionTurnRejected):
                log.warning("session_save_refused", error=str(exc))
            self.add(key, turn, client)
            if isinstance(exc, SessionTurnRejected):
                self._q[-1].failures = 1
            return False
        except Exception as exc:  # a defect: keep the turn, bounded like a refused one
            log.exception("session_save_failed", error=f"{type(exc).__name__}: {exc}")
            self.add(key, turn, client)
            self._q[-1].failures = 1
            return False
        return True

    async def flush(self, store: SessionStore) -> int:
        """Write what waits, oldest first, until the store fails again. Never raises."""
        written = 0
        async with self._lock:
            while self._q:
                item = self._q[0]
                try:
                    await _append(store, item.key, item.turn, item.client)
                except SessionLimitReached as exc:
                    self._q.popleft()
                    self._limited(item.key, str(exc))
                    continue
                except SessionTurnRejected as exc:
                    if self._failed(item, str(exc)):
                        continue
                    break
                except SessionStoreUnavailable:
                    break
                except Exception as exc:
                    log.exception("session_save_failed", error=f"{type(exc).__name__}: {exc}")
                    if self._failed(item, f"{type(exc).__name__}: {exc}"):
                        continue
                    break
                self._q.popleft()
                written += 1
                if self._on_saved is not None:
                    self._on_saved()
        if written:
            log.info("session_turns_saved_late", turns=written, waiting=len(self._q))
        return written

    def _limited(self, key: str, why: str) -> None:
        log.warning("session_save_over_client_limit", key=key, error=why)
        if self._on_limited is not None:
            self._on_limited()

    def _failed(self, item: _Waiting, why: str) -> bool:
        """One more failed attempt for the head item. It is retried at the
        next flush (order is kept); after `attempts` it is dropped (True)."""
        item.failures += 1
        if item.failures < self.attempts:
            return False
        self._q.popleft()
        log.error(
            "session_turn_rejected",
            key=item.key,
            attempts=item.failures,
            error=why,
            waiting=len(self._q),
        )
        if self._on_rejected is not None:
            self._on_rejected()
        return True
