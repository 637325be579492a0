"""Bounded concurrency plus a bounded FIFO wait queue.

A slot is held from admission until the generation thread has finished,
not until the handler returns, so `running` is the number of threads busy
with the model and a cancelled stream frees its slot only once the thread
has actually stopped.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    """No free slot and no room in the wait queue."""


class Admission:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def is_full(self) -> bool:
        """True when `acquire` would raise `QueueFull` right now."""
        if self.running < self.max_running and not self._waiters:
            return False
        return len(self._waiters) >= self.max_waiting

    async def acquire(self) -> None:
        """Take a slot, waiting in line if needed; raises `QueueFull`."""
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # `release` hands its slot over by resolving this
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self.release()  # a slot was handed over just as we were cancelled
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; `running` is unchanged
                return
        self.running -= 1
