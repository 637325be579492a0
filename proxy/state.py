"""The running proxy across policy reloads.

A reload (SIGHUP, `POST /brownout/reload`, or a change of the file when
`server.watch_policy` is on) reads and validates the whole new policy off
the event loop, builds a new `Runtime` and swaps it in at once. Requests in
flight keep the `Runtime` they started with and finish under the old policy.
A policy that fails validation changes nothing: the errors (`FILE:LINE:
message`) are logged, counted in `brownout_policy_reload_failures_total` and
shown in `/brownout/status`.

What carries over, so a reload never resets what the proxy has learnt:
backends whose settings did not change keep their connection pool, health
and breaker; the ladder keeps its tier, forced tier, history and ramp; the
admission limiter keeps its in-flight count and queue; the session store and
the shared-state client are kept when their settings are the same. What a
replaced generation alone used is closed once its last request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import structlog

from proxy.metrics import TIER_VALUES, Metrics
from proxy.policy import Policy, PolicyError, load_policy, policy_diff
from proxy.runtime import Runtime
from proxy.sessions import make_store
from proxy.shared import SharedState
from proxy.trim import HFTokenCounter
from proxy.upstream import Upstream, open_upstream

log = structlog.get_logger("brownout.policy")

# A replaced generation's resources are closed when its requests are done,
# or after this long at most (a stream can run for minutes).
_DRAIN_LIMIT_S = 900.0


class ProxyState:
    def __init__(self, policy: Policy, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.clock = clock
        self.current = Runtime(policy=policy, metrics=metrics, clock=clock)
        self.live: list[Runtime] = [self.current]
        self.loaded_at = time.time()
        self.last_reload: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._drains: set[asyncio.Task[None]] = set()
        metrics.inflight.set_function(lambda: sum(r.inflight for r in self.live))
        metrics.tier.set_function(lambda: TIER_VALUES[self.current.tier])

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self._provision(self.current, None)

    async def close(self) -> None:
        for t in list(self._drains):
            t.cancel()
        for t in list(self._drains):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for rt in self.live:
            await self._close_unused(rt, keep=[])
        self.live = []

    def _on_breaker_change(self, name: str, old: str, new: str, reason: str) -> None:
        # Upstreams outlive generations: breaker news goes to the current one.
        self.current.on_breaker_change(name, old, new, reason)

    async def _provision(self, rt: Runtime, prev: Runtime | None) -> None:
        """Give `rt` its backends, store, tokenizers and shared state, reusing
        `prev`'s where the settings are the same."""
        pol = rt.policy
        for name, bp in (("primary", pol.backends.primary), ("fallback", pol.backends.fallback)):
            if bp is None:
                continue
            old = prev.upstreams.get(name) if prev is not None else None
            if (
                old is not None
                and old.policy == bp
                and old.breaker.policy == pol.ladder.breaker
                and old.probe_failures == pol.ladder.failover.probe_failures
            ):
                up = old
            else:
                up = open_upstream(
                    name,
                    bp,
                    pol.ladder.breaker,
                    self.clock,
                    self._on_breaker_change,
                    pol.ladder.failover.probe_failures,
                )
                if old is not None and old.policy.url == bp.url:
                    # Discovered facts stay true for the same server.
                    up.served_model = old.served_model
                    up.max_model_len = bp.max_model_len or old.max_model_len
            rt.add_upstream(up)
            if prev is not None and up is old and name in prev.counters:
                rt.counters[name] = prev.counters[name]
            elif bp.tokenizer:
                rt.counters[name] = await HFTokenCounter.load(bp.tokenizer)
        if prev is not None and prev.policy.sessions == pol.sessions:
            rt.store = prev.store
        else:
            rt.store = make_store(pol.sessions)
        shared = pol.ladder.shared
        if prev is not None and prev.shared is not None and prev.policy.ladder.shared == shared:
            rt.shared = prev.shared
        elif shared.redis:
            rt.shared = SharedState(shared)
        if prev is not None:
            rt.adopt(prev)

    # -- reload --------------------------------------------------------------------

    async def reload(self, reason: str) -> dict[str, Any]:
        """Load the policy file again; swap it in if valid. Never raises."""
        async with self._lock:
            old = self.current
            path = old.policy.source
            started = time.time()
            try:
                policy = await asyncio.to_thread(load_policy, path)
            except PolicyError as exc:
                self.metrics.reload_failures.inc()
                for line in exc.lines():
                    log.error("policy_reload_rejected", reason=reason, error=line)
                self.last_reload = {
                    "ok": False,
                    "at": round(started, 3),
                    "trigger": reason,
                    "errors": exc.lines(),
                }
                return self.last_reload
            changes = policy_diff(old.policy, policy)
            new = Runtime(policy=policy, metrics=self.metrics, clock=self.clock)
            await self._provision(new, old)
            self.current = new
            self.live.append(new)
            self.loaded_at = time.time()
            self.metrics.reloads.inc()
            log.warning("policy_reloaded", reason=reason, changes=changes)
            self.last_reload = {
                "ok": True,
                "at": round(started, 3),
                "trigger": reason,
                "changes": changes,
            }
            task = asyncio.create_task(self._drain(old))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
            return self.last_reload

    async def _drain(self, old: Runtime) -> None:
        deadline = time.monotonic() + _DRAIN_LIMIT_S
        # A poll, not an event: in-flight counts change on the hot path, which
        # should not pay for waking a drainer.
        while old.inflight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        self.live.remove(old)
        await self._close_unused(old, keep=self.live)

    async def _close_unused(self, rt: Runtime, keep: list[Runtime]) -> None:
        used_ups = {id(u) for r in keep for u in r.upstreams.values()}
        for up in rt.upstreams.values():
            if id(up) not in used_ups:
                await up.close()
                used_ups.add(id(up))
        if all(r.store is not rt.store for r in keep):
            await rt.store.close()
        if rt.shared is not None and all(r.shared is not rt.shared for r in keep):
            await rt.shared.close()

    def status(self) -> dict[str, Any]:
        body = self.current.status()
        body["policy"] = {
            "source": self.current.policy.source,
            "loaded_at": round(self.loaded_at, 3),
            "last_reload": self.last_reload,
            "generations_live": len(self.live),
        }
        return body


async def watch_policy(state: ProxyState, interval_s: float) -> None:
    """Reload when the policy file changes (stat off the event loop)."""
    last: tuple[float, int] | None = None
    while True:
        path = state.current.policy.source
        try:
            st = await asyncio.to_thread(os.stat, path)
            sig = (st.st_mtime, st.st_size)
        except OSError:
            sig = None
        if last is not None and sig is not None and sig != last:
            await state.reload("file_changed")
        if sig is not None:
            last = sig
        await asyncio.sleep(interval_s)


def upstream_of(state: ProxyState, name: str) -> Upstream | None:
    return state.current.upstreams.get(name)
