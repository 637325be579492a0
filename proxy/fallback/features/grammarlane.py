"""The grammar-compile lane: a bounded pool, a bounded queue, a deadline, a cache.

xgrammar's compile runs in C++ with the interpreter lock released and cannot
be interrupted. So each compile runs on a thread of its own, holding a compile
slot (`Admission`, `workers` of them) that is released only when its thread
is done, never earlier: at most `workers` compiles ever run, whatever clients
do. The threads are daemons: a compile still running never holds up shutdown.
A request waits for a slot in a bounded line (`queue`; full: `LaneFull`, which
the handler answers 503 + Retry-After: that is load).

Each request waits at most `timeout_s` for its grammar, in line and compiling
together (`CompileTimeout`). Past that the request is answered, and the choice
made here is a 503 with Retry-After rather than a 400: the server cannot tell a
schema too costly for it from a compile slowed down by a loaded machine, and
the compile goes on and lands in the cache, so a retry after Retry-After may
well succeed. To a client of the proxy it is load (it fails over and never
counts against the backend's breaker), never a 5xx without Retry-After.

A compile slot is a slot of its own, not a generation slot: a request that is
compiling never holds a slot plain requests need (the generation slot is
taken after, as before). A request whose client went away while in line
leaves it and never starts a compile. Results (and a schema's compile error)
are cached by key — the grammar's kind and the schema's compact JSON text,
key order kept, since it decides the order of an answer's properties — in an
LRU of `cache_entries`; a request for a key being compiled joins that compile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.fallback.engines.admission import Admission, QueueFull

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class LaneLimits:
    workers: int = 2
    queue: int = 8
    timeout_s: float = 5.0
    cache_entries: int = 256

    def __post_init__(self) -> None:
        if self.workers < 1 or self.queue < 0 or self.cache_entries < 0:
            raise ValueError("grammar workers must be >= 1, queue and cache >= 0")
        if not self.timeout_s > 0:
            raise ValueError("the grammar compile timeout must be positive")


class LaneFull(Exception):
    """Every compile worker is busy and the line is full."""


class CompileTimeout(Exception):
    """The grammar was not ready within the deadline (the compile goes on)."""


@dataclass
class LaneCounts:
    """What the lane did, for /metrics (read on the event loop)."""

    hits: int = 0
    started: int = 0
    compiled: int = 0
    failed: int = 0
    timeouts: int = 0
    shed: int = 0
    left: int = 0  # clients that went away while in line: no compile started


class GrammarLane(Generic[K, V]):
    """`get(key)` runs `compile(key)` on the pool, bounded as the module says.

    `compile` raises to say the key cannot be compiled; that exception is
    cached like a result and re-raised to every request for the key.
    """

    def __init__(self, compile_fn: Callable[[K], V], limits: LaneLimits) -> None:
        self._compile = compile_fn
        self.limits = limits
        self._slots = Admission(limits.workers, limits.queue)
        self._cache: OrderedDict[K, V | BaseException] = OrderedDict()
        self._running: dict[K, asyncio.Future[V]] = {}
        self.counts = LaneCounts()

    @property
    def running(self) -> int:
        return self._slots.running

    @property
    def waiting(self) -> int:
        return self._slots.waiting

    async def get(self, key: K) -> V:
        """The compiled value; raises `LaneFull`, `CompileTimeout` or the compile's error."""
        cached = self._lookup(key)
        if cached is not None:
            self.counts.hits += 1
            return _unwrap(cached)
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._compiled(key)
        except TimeoutError:
            self.counts.timeouts += 1
            raise CompileTimeout from None

    async def _compiled(self, key: K) -> V:
        future = self._running.get(key)
        if future is None:
            try:
                await self._slots.acquire()
            except QueueFull:
                self.counts.shed += 1
                raise LaneFull from None
            except asyncio.CancelledError:
                self.counts.left += 1  # gone (or timed out) in line: nothing started
                raise
            # While this request waited, another may have compiled or started the key.
            cached = self._lookup(key)
            if cached is not None:
                self._slots.release()
                return _unwrap(cached)
            future = self._running.get(key)
            if future is None:
                future = self._start(key)
            else:
                self._slots.release()
        # shield: a request that gives up (timeout, client gone) leaves the compile running.
        return await asyncio.shield(future)

    def _start(self, key: K) -> asyncio.Future[V]:
        """Compile `key` in the slot just taken; the slot goes back when the thread is done."""
        self.counts.started += 1
        loop = asyncio.get_running_loop()
        work: concurrent.futures.Future[V] = concurrent.futures.Future()

        def run() -> None:
            work.set_running_or_notify_cancel()
            try:
                work.set_result(self._compile(key))
            except BaseException as exc:  # handed to the requests waiting for it
                work.set_exception(exc)

        future = asyncio.wrap_future(work, loop=loop)
        self._running[key] = future
        threading.Thread(target=run, name="grammar", daemon=True).start()

        def done(f: asyncio.Future[V]) -> None:
            self._running.pop(key, None)
            self._slots.release()
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                self.counts.compiled += 1
                self._store(key, f.result())
            else:
                self.counts.failed += 1
                self._store(key, exc)

        future.add_done_callback(done)
        return future

    def _lookup(self, key: K) -> V | BaseException | None:
        if key not in self._cache:
            return None
        self._cache.move_to_end(key)
        return self._cache[key]

    def _store(self, key: K, value: V | BaseException) -> None:
        if self.limits.cache_entries == 0:
            return
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.limits.cache_entries:
            self._cache.popitem(last=False)

    def shutdown(self) -> None:
        """Nothing to wait for: a compile still running ends with the process."""


def _unwrap(value: V | BaseException) -> V:
    if isinstance(value, BaseException):
        raise value
    return value
