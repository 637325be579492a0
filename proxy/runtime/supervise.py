"""Background work that cannot end silently.

Every task the proxy starts outside a request goes through one `Supervisor`
(one per app, shared by every policy generation):

- `start(name, body)`: a loop. When `body` raises, the exception is logged
  (`loop_failed`, with its traceback) and counted in
  `brownout_loop_errors_total{loop=name}`, and `body` is called again after
  a short backoff (doubling from `backoff_s` up to `max_backoff_s` while the
  failures repeat). A body that returns has finished on purpose.
- `reconcile(wanted)`: the named loops the running policy asks for; loops
  not wanted any more are cancelled, missing ones started. Called at start
  and after every reload, so a reload that adds `ladder.shared` starts the
  sync loop and one that removes it stops it.
- `spawn(name, coro)`: fire-and-forget work, kept referenced until it ends;
  its exception is logged and counted like a loop's.

Cancellation is how work is stopped, never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog
from prometheus_client import Counter

log = structlog.get_logger("brownout.supervise")

Body = Callable[[], Awaitable[None]]
Sleep = Callable[[float], Awaitable[None]]


class Supervisor:
    def __init__(
        self,
        errors: Counter,
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._errors = errors
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._named: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._errors_seen: dict[str, dict[str, Any]] = {}

    # -- loops ---------------------------------------------------------------------

    def start(self, name: str, body: Body) -> asyncio.Task[None]:
        """Run `body` under supervision; cancel the task to stop it."""
        task = asyncio.get_running_loop().create_task(self._run(name, body), name=name)
        self._keep(task)
        return task

    async def _run(self, name: str, body: Body) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            started = loop.time()
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed(name, exc)
            if loop.time() - started >= self.max_backoff_s:
                failures = 0  # it ran well for a while: this is a new failure
            delay = min(self.max_backoff_s, self.backoff_s * 2**failures)
            failures += 1
            await self._sleep(delay)

    def reconcile(self, wanted: Mapping[str, Body]) -> None:
        """Make the named loops exactly `wanted` (running ones are kept)."""
        for name in [n for n in self._named if n not in wanted]:
            task = self._named.pop(name)
            task.cancel()
            log.info("loop_stopped", loop=name)
        for name, body in wanted.items():
            running = self._named.get(name)
            if running is None or running.done():
                self._named[name] = self.start(name, body)
                if running is not None:
                    log.info("loop_started", loop=name)

    def running(self) -> list[str]:
        """Names of the reconciled loops now running."""
        return sorted(n for n, t in self._named.items() if not t.done())

    def errors(self) -> dict[str, dict[str, Any]]:
        """Per loop: how many exceptions so far, and the last one (for status)."""
        return {name: dict(seen) for name, seen in sorted(self._errors_seen.items())}

    # -- one-shot work -------------------------------------------------------------

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Fire and forget, but not lost: referenced until done, failures logged and counted."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._keep(task)
        task.add_done_callback(lambda t: self._reap(name, t))
        return task

    def _reap(self, name: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failed(name, exc)

    def failed(self, name: str, exc: BaseException) -> None:
        """Log and count one unexpected exception of background work `name`."""
        self._errors.labels(name).inc()
        seen = self._errors_seen.setdefault(name, {"count": 0, "last": ""})
        seen["count"] += 1
        seen["last"] = f"{type(exc).__name__}: {exc}"
        log.error(
            "loop_failed",
            loop=name,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=(type(exc), exc, exc.__traceback__),
        )

    # -- lifecycle -----------------------------------------------------------------

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel everything still running and wait for it to end."""
        self._named.clear()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
