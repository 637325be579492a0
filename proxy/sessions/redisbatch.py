"""Lua script calls from concurrent requests, sent to Redis as one pipeline.

redis-py's asyncio client spends ~100 µs of CPU per command (pool checkout,
packing, a write, a parse, bookkeeping), more than the proxy spends relaying
a short answer. Session loads and appends are independent calls from many
requests at once, so the calls made during about two event-loop iterations
go out together: one pool checkout, one write, one read of all the replies.

A batch runs as its own task under `timeout_s` (cancelled then; a connect
that absorbs the cancellation is still bounded by the pool's connect
timeout). Each caller waits on a plain future, which its own deadline can
abandon at once. Whatever the batch holds, it is one round trip: one write of
all its EVALSHAs, one read of their replies. After a Redis restart the
scripts are gone: calls that got NOSCRIPT are retried once after SCRIPT LOAD.

Between batches a batcher keeps up to `IDLE_KEPT` connections of its own,
checked before each use as the pool checks its own (`ensure_connection`:
a closed one reconnects), rather than check each out of redis-py's
BlockingConnectionPool and back in (its condition, lock, timeout scope and
metric hooks cost more than a batch's own work).

The EVALSHAs are packed by hiredis (`redis[hiredis]`), in C: redis-py's own
packer runs every argument through its Python encoder (a third of the
session path's CPU, measured). An argument hiredis can't pack (text with a
lone surrogate in the key prefix) takes redis-py's packer, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

hiredis_pack: Callable[[Any], bytes] | None
try:
    from hiredis import pack_command as hiredis_pack
except ImportError:  # pragma: no cover - hiredis is a dependency; redis-py's packer works alone
    hiredis_pack = None

Command = tuple[Any, ...]

# Connections a batcher keeps between its batches (more go back to the pool).
IDLE_KEPT = 4


def pack(commands: list[Command], fallback: Callable[[list[Command]], list[bytes]]) -> bytes:
    """The commands in the Redis protocol, one buffer: hiredis' packer, or
    `fallback` (redis-py's) for what hiredis refuses."""
    if hiredis_pack is not None:
        try:
            return b"".join([hiredis_pack(cmd) for cmd in commands])
        except (TypeError, UnicodeEncodeError):
            pass
    return b"".join(fallback(commands))


def _expire(fut: asyncio.Future[Any], timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no reply from Redis within {timeout_s}s"))


@dataclass(slots=True)
class _Call:
    script: str
    keys: Sequence[str]
    args: Sequence[Any]
    future: asyncio.Future[Any]
    timer: asyncio.TimerHandle  # the future's deadline (`_expire`)


class ScriptBatcher:
    def __init__(self, client: aioredis.Redis, scripts: dict[str, str], timeout_s: float) -> None:
        self._client = client
        self._lua = dict(scripts)
        self._sha = {name: client.register_script(lua).sha for name, lua in scripts.items()}
        self._timeout_s = timeout_s
        self._queue: list[_Call] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # Connections between batches, checked as the pool checks them
        # (`ensure_connection`) but not handed back to it: redis-py's
        # BlockingConnectionPool takes a condition, a lock, a timeout scope
        # and four metric hooks per checkout and per release.
        self._idle: list[Any] = []
        self._closed = False

    def call(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> asyncio.Future[Any]:
        """Queue one EVALSHA; the future gets its reply or exception, or
        TimeoutError after `timeout_s` (a timer, cheaper than asyncio.timeout).
        The batch cancels the timers of its calls when it ends (no done
        callback per call: a closure and a loop callback each); a future
        settled otherwise keeps its timer, which then finds it done."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        timer = loop.call_later(self._timeout_s, _expire, fut, self._timeout_s)
        self._queue.append(_Call(script, keys, args, fut, timer))
        if len(self._queue) == 1:
            # Sent after the next loop iteration, not this one: requests woken
            # by the same I/O poll queue their calls in between (measured:
            # one iteration's wait lifts session throughput ~20 % at c=16,
            # and costs an idle loop microseconds).
            loop.call_soon(loop.call_soon, self._send_queued)
        return fut

    def _send_queued(self) -> None:
        batch, self._queue = self._queue, []
        batch = [c for c in batch if not c.future.done()]  # callers gone already
        if not batch:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(batch))
        watchdog = loop.call_later(self._timeout_s, task.cancel)
        self._tasks.add(task)

        def finished(t: asyncio.Task[None]) -> None:
            watchdog.cancel()
            self._finished(t, batch)

        task.add_done_callback(finished)

    def _finished(self, task: asyncio.Task[None], batch: list[_Call]) -> None:
        self._tasks.discard(task)
        exc: BaseException | None
        if task.cancelled():
            exc = TimeoutError(f"Redis did not answer within {self._timeout_s}s")
        else:
            exc = task.exception()
        for c in batch:
            c.timer.cancel()
            if exc is not None and not c.future.done():
                c.future.set_exception(exc)

    async def _run(self, batch: list[_Call]) -> None:
        results = await self._pipeline(batch)
        missing = [c for c, r in zip(batch, results, strict=True) if isinstance(r, NoScriptError)]
        if missing:
            for name in {c.script for c in missing}:
                await self._client.script_load(self._lua[name])
            retried = await self._pipeline(missing)
            by_call = {id(c): r for c, r in zip(missing, retried, strict=True)}
            results = [by_call.get(id(c), r) for c, r in zip(batch, results, strict=True)]
        for c, r in zip(batch, results, strict=True):
            if c.future.done():
                continue
            if isinstance(r, Exception):
                c.future.set_exception(r)
            else:
                c.future.set_result(r)

    async def _pipeline(self, calls: list[_Call]) -> list[Any]:
        """One write of every EVALSHA, one read of their replies: a round
        trip. On a pooled connection directly, not through redis-py's
        `Pipeline` (its per-batch bookkeeping, retry wrapper and telemetry
        cost more CPU than the round trip; retries are off here anyway).
        The connection disconnects itself on any failure of its write or
        read (a cancellation included), so it is never returned out of step."""
        pool = self._client.connection_pool
        idle = self._idle
        if idle:
            conn = idle.pop()
            try:
                await pool.ensure_connection(conn)  # reconnects a closed one
            except BaseException:
                await pool.release(conn)
                raise
        else:
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            sha = self._sha
            commands = [("EVALSHA", sha[c.script], len(c.keys), *c.keys, *c.args) for c in calls]
            await conn.send_packed_command(pack(commands, conn.pack_commands))
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # this call's error: the others' replies follow
                    replies.append(exc)
            return replies
        finally:
            if len(idle) < IDLE_KEPT and not self._closed:
                idle.append(conn)
            else:
                await pool.release(conn)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._client.connection_pool.release(conn)
