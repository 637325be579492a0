"""The timers of one relayed stream: the first-byte deadline, the heartbeat
and the idle watchdog, on one timer handle.

Per request, not per chunk: the read loop just stamps `last_activity`, and
one timer callback (`Pump._wake`) does whatever is due, then re-arms itself
for the next due time only. The first-byte deadline closes an upstream that
sent no event in time, which wakes the reader with an error (`expired` says
why); the heartbeat (an SSE comment, after `heartbeat_s` of upstream silence)
keeps nginx and load balancers from closing a long prefill's connection; the
watchdog closes an upstream silent for `idle_s` mid-answer (`timed_out`).
(One handle, not a timeout scope and two timers: each costs a uvloop timer,
and `asyncio.timeout_at` ~28,000 instructions.)
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from proxy.openai.sse import HEARTBEAT


class Pump:
    """State of one relayed stream, shared by the read loop and its timer."""

    __slots__ = (
        "_at",
        "_fb_due",
        "_handle",
        "_hb_due",
        "_hb_task",
        "_idle_due",
        "client",
        "expired",
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
        first_byte_deadline: float | None = None,
    ) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self.request = request
        self.upstream = upstream
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.idle_s = idle_s
        self.last_activity = now = loop.time()
        self.expired = False  # no event before the first-byte deadline
        self.timed_out = False  # silent for idle_s mid-answer
        self._hb_task: asyncio.Task[None] | None = None
        # Due times (loop time) of what is armed; None: not armed.
        self._fb_due = first_byte_deadline
        self._hb_due = now + heartbeat_s if heartbeat_s > 0 else None  # 0 = no heartbeats
        self._idle_due: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0  # when the handle fires
        self._arm()

    # -- timer -------------------------------------------------------------------

    def _arm(self) -> None:
        """The handle, for the earliest due time (none: no handle)."""
        due = self._hb_due
        for d in (self._fb_due, self._idle_due):
            if d is not None and (due is None or d < due):
                due = d
        if due is None:
            self._handle = None
            return
        self._at = due
        self._handle = self.loop.call_at(due, self._wake)

    def _sooner(self, due: float) -> None:
        """Something new is due at `due`: re-arm if the handle fires later."""
        if self._handle is None or due < self._at:
            if self._handle is not None:
                self._handle.cancel()
            self._arm()

    def first_event(self) -> None:
        """The first event arrived: the first-byte deadline no longer applies."""
        self._fb_due = None

    def start_idle_watch(self) -> None:
        self._idle_due = due = self.loop.time() + self.idle_s
        self._sooner(due)

    def _wake(self) -> None:
        now = self.loop.time()
        due = self._fb_due
        if due is not None and now >= due:
            self._fb_due = None
            self.expired = True
            # Closing the response wakes the reader with an error right away.
            self.upstream.close()
        due = self._idle_due
        if due is not None and now >= due:
            due = self.last_activity + self.idle_s
            if now >= due:
                self._idle_due = None
                self.timed_out = True
                self.upstream.close()
            else:
                self._idle_due = due
        due = self._hb_due
        if due is not None and now >= due:
            due = self.last_activity + self.heartbeat_s
            if now >= due and (self._hb_task is None or self._hb_task.done()):
                self._hb_task = self.loop.create_task(self._send_heartbeat())
                due = now + self.heartbeat_s
            self._hb_due = due
        self._arm()

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
        self._fb_due = self._hb_due = self._idle_due = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._hb_task is not None and not self._hb_task.done():
            self._hb_task.cancel()
