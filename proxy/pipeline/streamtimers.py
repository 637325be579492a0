"""The timers of one relayed stream: the idle watchdog and the heartbeat.

Per request, not per chunk: each is a timer callback that re-arms itself only
when it fires (the read loop just stamps `last_activity`), so a chunk costs
no timer work. The heartbeat (an SSE comment, after `heartbeat_s` of upstream
silence) keeps nginx and load balancers from closing a long prefill's
connection; the watchdog closes an upstream silent for `idle_s`, which wakes
the reader with an error (`timed_out` says why).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from proxy.openai.sse import HEARTBEAT


class Pump:
    """State of one relayed stream, shared by the read loop and its timers."""

    __slots__ = (
        "_hb_handle",
        "_hb_task",
        "_idle_handle",
        "client",
        "first_event",
        "heartbeat_s",
        "idle_s",
        "last_activity",
        "loop",
        "request",
        "timed_out",
        "upstream",
    )

    def __init__(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        client: web.StreamResponse,
        heartbeat_s: float,
        idle_s: float,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.request = request
        self.upstream = upstream
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.idle_s = idle_s
        self.last_activity = self.loop.time()
        self.first_event = False
        self.timed_out = False
        self._hb_task: asyncio.Task[None] | None = None
        # heartbeat_s 0 = no heartbeats.
        self._hb_handle: asyncio.TimerHandle | None = (
            self.loop.call_later(heartbeat_s, self._on_heartbeat) if heartbeat_s > 0 else None
        )
        self._idle_handle: asyncio.TimerHandle | None = None

    # -- timers ------------------------------------------------------------------

    def start_idle_watch(self) -> None:
        self._idle_handle = self.loop.call_later(self.idle_s, self._on_idle)

    def _on_idle(self) -> None:
        due = self.last_activity + self.idle_s
        if self.loop.time() >= due:
            self.timed_out = True
            # Closing the response wakes the reader with an error right away.
            self.upstream.close()
        else:
            self._idle_handle = self.loop.call_at(due, self._on_idle)

    def _on_heartbeat(self) -> None:
        due = self.last_activity + self.heartbeat_s
        now = self.loop.time()
        if now >= due and (self._hb_task is None or self._hb_task.done()):
            self._hb_task = self.loop.create_task(self._send_heartbeat())
            due = now + self.heartbeat_s
        self._hb_handle = self.loop.call_at(due, self._on_heartbeat)

    async def _send_heartbeat(self) -> None:
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
            if not self.client.prepared:
                await self.client.prepare(self.request)
            await self.client.write(HEARTBEAT)

    async def settle_heartbeat(self) -> None:
        """Wait for a heartbeat write in progress, so writes never overlap."""
        task = self._hb_task
        if task is not None and not task.done():
            await task

    def stop(self) -> None:
        if self._hb_handle is not None:
            self._hb_handle.cancel()
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._hb_task is not None and not self._hb_task.done():
            self._hb_task.cancel()
