"""The background loops, and which of them the running policy wants.

`wanted_loops(state)` names them for `ProxyState.run_loops`, which hands them
to the app's `Supervisor` at start and after every reload (a loop that
raises is logged, counted and run again; see `proxy.runtime.supervise`). Each loop
reads `state.current` at every turn, so a reload takes effect at its next one.

The ladder's window never awaits network I/O: a recovery probe of an open
breaker runs as its own supervised task, and its result reaches the ladder
as a breaker transition (which re-evaluates at once). A hung primary delays
its own probe, never dwell, ramps or the throttle's AIMD.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import aiohttp
import structlog

from proxy.backends.upstream import ProbeMisconfigured, Upstream
from proxy.control.breaker import BackendBreaker, Permit
from proxy.control.pressure import parse_vllm_metrics
from proxy.runtime.supervise import Body, Sleep

if TYPE_CHECKING:
    from proxy.runtime.generation import Runtime
    from proxy.runtime.state import ProxyState

log = structlog.get_logger("brownout.ladder")


def wanted_loops(state: ProxyState) -> Mapping[str, Body]:
    pol = state.current.policy
    evaluator = Evaluator(state)
    loops: dict[str, Body] = {
        "evaluate": evaluator.run,
        "scrape": lambda: scrape_forever(state),
        "flush_saves": lambda: flush_saves_forever(state),
    }
    if pol.ladder.shared.redis:
        loops["shared_sync"] = lambda: sync_forever(state)
    if pol.server.watch_policy:
        loops["watch_policy"] = lambda: watch_policy(state)
    if state.recorder is not None:
        loops["record_samples"] = lambda: record_samples(state)
    return loops


class Evaluator:
    """Evaluate the ladder every window; test open breakers with recovery probes."""

    def __init__(self, state: ProxyState, sleep: Sleep = asyncio.sleep) -> None:
        self.state = state
        self._sleep = sleep
        # By (id(upstream), model or None for the backend's own breaker).
        self._probing: dict[tuple[int, str | None], asyncio.Task[None]] = {}

    async def run(self) -> None:
        while True:
            await self._sleep(self.state.current.policy.ladder.recovery.window_s)
            self.tick()

    def tick(self) -> None:
        """One window: start the probes that are due, then evaluate. No await."""
        rt = self.state.current
        recorder = self.state.recorder
        if recorder is not None:
            recorder.put(("tick", rt.clock()))
        if rt.policy.ladder.failover.recovery_probe:
            now = rt.clock()
            for up in rt.upstreams.values():
                if up.probe_misconfigured is not None:
                    continue  # real requests are the trial (see Runtime.route)
                for model, b in list(up.breakers()):
                    key = (id(up), model)
                    if key in self._probing or b.state == "closed":
                        continue
                    if b.state == "open" and now < b.retry_at():
                        continue
                    # Half-open too: a real request that moved it there may
                    # have ended without an outcome (shed, client gone), and
                    # with no trial out nothing else would ever test it.
                    permit = b.allow()  # None while a real trial is out
                    if permit is not None:
                        name = f"recovery_probe_{up.name}" + (f"_{model}" if model else "")
                        task = self.state.supervisor.spawn(name, self._probe(up, b, model, permit))
                        self._probing[key] = task
        rt.evaluate(window=True)
        if rt.canary is not None:
            rt.canary.tick(rt.upstreams.get("candidate"), rt.upstreams.get("primary"))

    def probing(self) -> list[str]:
        return sorted(t.get_name() for t in self._probing.values())

    async def _probe(
        self, up: Upstream, b: BackendBreaker, model: str | None, permit: Permit
    ) -> None:
        """The half-open trial `permit` admitted: its outcome closes or reopens."""
        rt = self.state.current
        try:
            try:
                why = await up.recovery_probe(model) if model else await up.recovery_probe()
            except Exception as exc:
                # The trial must end either way, or the breaker stays half-open.
                b.record_failure(permit, f"recovery probe: {type(exc).__name__}")
                raise  # logged and counted by the supervisor
            # The breaker's transition re-evaluates the ladder (`evaluate_soon`).
            rt = self.state.current
            if why is None:
                rt.metrics.recovery_probes.labels(up.name, "ok").inc()
                rt.report_success(up, permit=permit)
            elif isinstance(why, ProbeMisconfigured):
                # Not the backend's fault: no outcome; real requests take the
                # trial slot this permit frees (Runtime.route sends them).
                up.probe_misconfigured = why.reason
                rt.metrics.recovery_probes.labels(up.name, "misconfigured").inc()
                log.warning(
                    "recovery_probe_misconfigured",
                    backend=up.name,
                    model=model,
                    reason=why.reason,
                    fix=f"set backends.{up.name}.probe to a request this backend serves",
                )
            else:
                rt.metrics.recovery_probes.labels(up.name, "failed").inc()
                b.record_failure(permit, f"recovery probe: {why}")
        finally:
            self._probing.pop((id(up), model), None)
            b.release_trial(permit)  # cancelled: the slot goes back at once


async def scrape_forever(state: ProxyState) -> None:
    """Read vLLM's own load gauges from the primary's /metrics."""
    while True:
        rt = state.current
        interval = rt.policy.ladder.throttle.scrape_interval_s
        up = rt.upstreams.get("primary")
        if up is None or up.policy.kind != "vllm" or interval <= 0:
            await asyncio.sleep(1.0)
            continue
        timeout = aiohttp.ClientTimeout(total=max(0.5, interval))
        try:
            async with up.session.get(up.base.with_path("/metrics"), timeout=timeout) as resp:
                text = await resp.text()
            if resp.status == 200:
                rt.pressure.update_engine(parse_vllm_metrics(text))
            else:
                rt.pressure.engine.error = f"/metrics returned HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, RuntimeError) as exc:
            rt.pressure.engine.error = type(exc).__name__
        recorder = state.recorder
        if recorder is not None:
            g = rt.pressure.engine
            recorder.put(
                ("engine", rt.clock(), g.waiting, g.running, g.kv_cache, g.rejections, g.error)
            )
        await asyncio.sleep(interval)


SAMPLE_S = 1.0  # the flight recorder's state sample


def sample_of(rt: Runtime) -> tuple[object, ...]:
    """The flight recorder's once-a-second view of the control state."""
    now = rt.clock()
    p = rt.pressure
    short, n_short = p.ttft_short.p95(now)
    base, n_base = p.ttft_base.p95(now)
    adm = rt.admission
    return (
        "sample",
        now,
        rt.ladder.tier,
        adm.limit,
        adm.inflight,
        adm.queued,
        short if n_short else None,
        base if n_base else None,
        p.active,
        p.reason,
        {n: up.breaker.state for n, up in rt.upstreams.items()},
        {n: up.available for n, up in rt.upstreams.items()},
    )


async def record_samples(state: ProxyState, sleep: Sleep = asyncio.sleep) -> None:
    """Once a second, the control state into the flight recorder."""
    while True:
        await sleep(SAMPLE_S)
        recorder = state.recorder
        if recorder is not None:
            recorder.put(sample_of(state.current))


async def sync_forever(state: ProxyState) -> None:
    """Follow the other replicas' breakers and forced tier through Redis."""
    while True:
        rt = state.current
        await rt.sync_shared()
        await asyncio.sleep(rt.policy.ladder.shared.interval_s)


async def flush_saves_forever(state: ProxyState, sleep: Sleep = asyncio.sleep) -> None:
    """Write turns that waited out a session-store outage, once it answers."""
    while True:
        await sleep(1.0)
        rt = state.current
        if len(rt.pending_saves):
            await rt.pending_saves.flush(rt.store)


Stamp = tuple[int, int, int] | None


def _watched(path: str, faq_file: str | None) -> tuple[Stamp, ...]:
    """(mtime, size, inode) of the policy file and of the FAQ file it names
    (None: missing), through symlinks: a Kubernetes ConfigMap mount is
    `policy.yaml -> ..data/policy.yaml`, and the kubelet's update renames a new
    `..data` over the old, so the file behind the path is another inode even
    when its size and mtime match the old one's."""
    paths = [path]
    if faq_file:
        paths.append(os.path.join(os.path.dirname(path), faq_file))
    sigs: list[Stamp] = []
    for p in paths:
        try:
            st = os.stat(p)
            sigs.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            sigs.append(None)
    return tuple(sigs)


def changed(last: tuple[Stamp, ...], now: tuple[Stamp, ...]) -> bool:
    """A file whose stamp moved, or that came back; a file missing now (an
    editor's write-and-rename, for a moment) is no change by itself."""
    if len(last) != len(now):
        return True
    return any(b is not None and a != b for a, b in zip(last, now, strict=True))


def merge(last: tuple[Stamp, ...], now: tuple[Stamp, ...]) -> tuple[Stamp, ...]:
    """The stamps to compare with next time: a missing file keeps its last one."""
    if len(last) != len(now):
        return now
    return tuple(a if b is None else b for a, b in zip(last, now, strict=True))


async def watch_policy(state: ProxyState) -> None:
    """Reload when the policy file, or the FAQ file it names, changes (stat off
    the event loop)."""
    last: tuple[Stamp, ...] | None = None
    while True:
        policy = state.current.policy
        files = (policy.source, policy.faq.file)
        now = await asyncio.to_thread(_watched, *files)
        if last is not None and changed(last, now):
            await state.reload_coalesced("file_changed")
            policy = state.current.policy
            if (policy.source, policy.faq.file) != files:
                # The reload names another FAQ file: watch what is running now.
                now = await asyncio.to_thread(_watched, policy.source, policy.faq.file)
                last = None
            # Else `now` was taken before the reload read the files: an edit that
            # lands while it runs (the FAQ written just after the policy) is a
            # change next time, not taken for what the reload read.
        last = now if last is None else merge(last, now)
        await asyncio.sleep(state.current.policy.server.watch_interval_s)
