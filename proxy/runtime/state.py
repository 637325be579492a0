"""The running proxy across policy reloads.

A reload (SIGHUP, `POST /brownout/reload`, or a change of the file when
`server.watch_policy` is on) is a transaction: it reads and validates the
whole new policy off the event loop, builds a new `Runtime` with everything
it needs (backends, tokenizers, session store, shared state), and only then
swaps it in, in one step that does no I/O. Requests in flight keep the
`Runtime` they started with and finish under the old policy. A policy that
fails validation, or whose parts cannot be built (a tokenizer path that does
not load), changes nothing: what was built is closed, the errors are logged,
counted in `brownout_policy_reload_failures_total` and shown in
`/brownout/status` and the reload's answer (an OpenAI-style error object).

What carries over, so a reload never resets what the proxy has learnt:
backends whose settings did not change keep their connection pool, health
and breaker; the ladder keeps its tier, forced tier, history and ramp; the
admission limiter keeps its in-flight count and queue; the session store
(and its memory:// sessions) is kept unless its identity changes
(`store_identity`: URL and pool settings; ttl and sizes are retuned in
place); turns waiting for the store are one queue across generations; the
shared-state client is kept when its settings are the same; the background
loops are reconciled with the new policy. What a replaced generation alone
used is closed once its last request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from proxy.backends.upstream import Health, Upstream, open_upstream
from proxy.control.shared import SharedState
from proxy.openai.capabilities import PLAIN
from proxy.policy import Policy, PolicyError, load_policy, policy_diff, split_restart
from proxy.policy.diff import RESTART_MARK
from proxy.policy.recorder import RecorderPolicy
from proxy.runtime.canary import read_state
from proxy.runtime.generation import Runtime
from proxy.runtime.shutdown import Draining
from proxy.runtime.supervise import Body, Supervisor
from proxy.sessions.counters import HFTokenCounter
from proxy.sessions.store import SessionStore, make_store, store_identity
from proxy.telemetry.metrics import TIER_VALUES, Metrics
from proxy.telemetry.recorder import Recorder

if TYPE_CHECKING:
    from proxy.policy.telemetry import TelemetryPolicy
    from proxy.telemetry.tracing import Tracing

log = structlog.get_logger("brownout.policy")

# A replaced generation's resources are closed when its requests are done;
# one still draining after this long is logged (a stream can run for minutes).
_DRAIN_LIMIT_S = 900.0


@dataclass
class _Built:
    """What one provisioning attempt opened, so a failed attempt closes it all."""

    upstreams: list[Upstream] = dataclasses.field(default_factory=list)
    store: SessionStore | None = None
    shared: SharedState | None = None
    tracing: Tracing | None = None

    async def close(self) -> None:
        for up in self.upstreams:
            with contextlib.suppress(Exception):
                await up.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.shared is not None:
            with contextlib.suppress(Exception):
                await self.shared.close()
        if self.tracing is not None:
            with contextlib.suppress(Exception):
                await close_tracing(self.tracing)


LoopSpec = Callable[["ProxyState"], Mapping[str, Body]]


class ProxyState:
    def __init__(self, policy: Policy, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.clock = clock
        self.supervisor = Supervisor(metrics.loop_errors)
        self.current = Runtime(
            policy=policy, metrics=metrics, clock=clock, supervisor=self.supervisor
        )
        self.live: list[Runtime] = [self.current]
        # The flight recorder: one per process, across reloads (`recorder.dir`).
        self.recorder: Recorder | None = None
        self._recording = False  # started (the app is up)
        self._reconcile_recorder(policy.recorder)
        self.current.recorder = self.recorder
        metrics.watch_recorder(lambda: self.recorder)
        self.loaded_at = time.time()
        self.last_reload: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._queued = False  # a coalesced reload waits for the lock
        self._drains: set[asyncio.Task[None]] = set()
        self._loops: LoopSpec | None = None
        # SIGTERM's drain (proxy.runtime.shutdown): /readyz and the ingress read it.
        self.shutdown = Draining()
        metrics.inflight.set_function(lambda: sum(r.inflight for r in self.live))
        metrics.tier.set_function(lambda: TIER_VALUES[self.current.tier])

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        built = _Built()
        try:
            await self._provision(self.current, None, built)
        except BaseException:
            await built.close()
            raise
        self.current.bind_gauges()
        self._recording = True
        if self.recorder is not None:
            self.recorder.start()
            self.recorder.put(("policy", self.clock(), self.current.policy, "start"))

    def _reconcile_recorder(self, pol: RecorderPolicy) -> None:
        """Start, keep (retuned), replace or stop the recorder for `pol`
        (no I/O, no waiting: a replaced writer finishes its last second alone)."""
        old = self.recorder
        if old is not None and pol.enabled and old.dir == Path(pol.dir):
            old.retune(pol)
            return
        if old is not None:
            old.stop()
        self.recorder = None
        if pol.enabled:
            self.recorder = Recorder(pol, time.time() - self.clock())
            if self._recording:
                self.recorder.start()

    def _on_probe(self, name: str, h: Health) -> None:
        rec = self.recorder
        if rec is not None:
            rec.put(
                (
                    "probe",
                    self.clock(),
                    name,
                    bool(h.healthy),
                    h.definitive,
                    h.last_error,
                    h.consecutive_failures,
                )
            )

    def run_loops(self, spec: LoopSpec) -> None:
        """Supervise the background loops `spec` names for the current
        policy, now and again after every reload."""
        self._loops = spec
        self.supervisor.reconcile(spec(self))

    async def stop_loops(self) -> None:
        self._loops = None
        self.supervisor.reconcile({})
        await asyncio.sleep(0)  # let the cancelled loops unwind

    async def close(self) -> None:
        for t in list(self._drains):
            t.cancel()
        for t in list(self._drains):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.supervisor.close()
        for rt in self.live:
            await self._close_unused(rt, keep=[])
        self.live = []
        rec, self.recorder = self.recorder, None
        if rec is not None:
            await asyncio.to_thread(rec.close)

    def _on_breaker_change(self, name: str, old: str, new: str, reason: str) -> None:
        # Upstreams outlive generations: breaker news goes to the current one.
        self.current.on_breaker_change(name, old, new, reason)

    def _on_model_breaker_change(
        self, name: str, model: str, old: str, new: str, reason: str
    ) -> None:
        self.current.on_model_breaker_change(name, model, old, new, reason)

    async def _provision(self, rt: Runtime, prev: Runtime | None, built: _Built) -> None:
        """Give `rt` its backends, store, tokenizers and shared state, reusing
        `prev`'s where the settings are the same. What is opened anew is
        recorded in `built`. Changes nothing that `prev` uses: the swap is
        `_commit`'s."""
        pol = rt.policy
        named = (
            ("primary", pol.backends.primary),
            ("fallback", pol.backends.fallback),
            ("candidate", pol.backends.candidate),
        )
        for name, bp in named:
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
                same_server = old is not None and old.policy.url == bp.url
                up = open_upstream(
                    name,
                    bp,
                    pol.ladder.breaker,
                    self.clock,
                    self._on_breaker_change,
                    pol.ladder.failover.probe_failures,
                    start=self.supervisor.start,
                    # What the breaker learnt about this server stays true.
                    breaker=old.breaker
                    if old is not None and same_server and old.breaker.policy == pol.ladder.breaker
                    else None,
                    on_model_breaker_change=self._on_model_breaker_change,
                )
                built.upstreams.append(up)
                if old is not None and same_server:
                    # Discovered facts stay true for the same server.
                    up.served_model = old.served_model
                    up.served_models = old.served_models
                    if up.breaker is old.breaker:
                        up.judge.model_breakers = old.judge.model_breakers
                        up.judge.ledgers = old.judge.ledgers
                    up.max_model_len = bp.max_model_len or old.max_model_len
                    up.health = dataclasses.replace(old.health)
                    _keep_learnt(up, old)
            up.on_probe = self._on_probe
            rt.add_upstream(up)
            if (
                prev is not None
                and old is not None
                and old.policy.tokenizer == bp.tokenizer
                and name in prev.counters
                and (up is old or bp.tokenizer)
            ):
                # The same tokenizer files: loading them again takes seconds.
                rt.counters[name] = prev.counters[name]
            elif bp.tokenizer:
                rt.counters[name] = await HFTokenCounter.load(bp.tokenizer)
        canary = rt.canary
        if canary is not None and (prev is None or prev.canary is None):
            # A (re)start: the rollout goes on where it was (snapshot_dir/state.json).
            saved = await asyncio.to_thread(read_state, canary.dir)
            if saved is not None:
                canary.restore(saved)
            elif pol.rollout.auto_start:
                canary.act("start")
        if prev is not None and store_identity(prev.policy.sessions) == store_identity(
            pol.sessions
        ):
            rt.store = prev.store  # and its sessions; knobs are retuned at the swap
        else:
            errors = self.metrics.session_store_errors
            rt.store = built.store = make_store(
                pol.sessions, on_error=lambda op, reason: errors.labels(op, reason).inc()
            )
        shared = pol.ladder.shared
        if prev is not None and prev.shared is not None and prev.policy.ladder.shared == shared:
            rt.shared = prev.shared
        elif shared.redis:
            rt.shared = built.shared = SharedState(shared)
        tel = pol.telemetry
        if not tel.otlp_endpoint:
            pass
        elif prev is not None and prev.tracing is not None and prev.policy.telemetry == tel:
            rt.tracing = prev.tracing
        else:
            # Off the loop: the SDK's first import takes a moment.
            rt.tracing = built.tracing = await asyncio.to_thread(open_tracing, tel, self.metrics)

    def _commit(self, new: Runtime, old: Runtime) -> None:
        """The swap: nothing here awaits or does I/O, so it cannot half happen."""
        if new.store is old.store:
            new.store.retune(new.policy.sessions)
        new.adopt(old)
        if new.policy.recorder != old.policy.recorder:
            self._reconcile_recorder(new.policy.recorder)
        new.recorder = self.recorder
        self.current = new
        self.live.append(new)
        new.bind_gauges()
        self.loaded_at = time.time()
        if self._loops is not None:
            self.supervisor.reconcile(self._loops(self))

    # -- reload --------------------------------------------------------------------

    async def reload_coalesced(self, reason: str) -> dict[str, Any] | None:
        """A reload for triggers that come in bursts (SIGHUP, the file watch):
        while one such reload still waits for its turn, another trigger adds
        nothing — the waiting one reads the file after it anyway. Returns None
        for a trigger folded into the waiting reload."""
        if self._queued:
            return None
        self._queued = True
        try:
            await self._lock.acquire()
        finally:
            # From here on the file is read: a later trigger needs a reload of its own.
            self._queued = False
        try:
            return await self._reload(reason)
        finally:
            self._lock.release()

    async def reload(self, reason: str) -> dict[str, Any]:
        """Load the policy file again; swap it in if it is valid and everything
        it needs could be built. Never raises: a failure keeps the running
        policy, and is logged, counted and shown in status."""
        async with self._lock:
            return await self._reload(reason)

    async def _reload(self, reason: str) -> dict[str, Any]:
        """The reload itself; the caller holds the lock."""
        old = self.current
        path = old.policy.source
        started = time.time()
        try:
            policy = await asyncio.to_thread(load_policy, path)
        except PolicyError as exc:
            return self._rejected(reason, started, exc.lines(), "invalid_policy")
        except Exception as exc:
            log.error("policy_reload_failed", reason=reason, exc_info=True)
            why = f"{path}: cannot read the policy: {type(exc).__name__}: {exc}"
            return self._rejected(reason, started, [why], "invalid_policy")
        # Knobs a running process cannot change keep their running value;
        # the reload says which ones wait for a restart.
        restart = [line for line in policy_diff(old.policy, policy) if line.endswith(RESTART_MARK)]
        policy, _waiting = split_restart(old.policy, policy)
        built = _Built()
        try:
            changes = policy_diff(old.policy, policy)
            new = Runtime(
                policy=policy,
                metrics=self.metrics,
                clock=self.clock,
                supervisor=self.supervisor,
            )
            await self._provision(new, old, built)
        except Exception as exc:
            log.error("policy_reload_failed", reason=reason, exc_info=True)
            await built.close()
            why = f"{path}: cannot apply the policy: {type(exc).__name__}: {exc}"
            return self._rejected(reason, started, [why], "policy_not_applied")
        self._commit(new, old)
        if self.recorder is not None:
            now = self.clock()
            self.recorder.put(("reload", now, True, policy, changes))
            self.recorder.put(("policy", now, policy, "reload"))
        self.metrics.reloads.inc()
        log.warning("policy_reloaded", reason=reason, changes=changes, needs_restart=restart)
        self.last_reload = {
            "ok": True,
            "at": round(started, 3),
            "trigger": reason,
            "changes": changes,
            "needs_restart": restart,
        }
        task = self.supervisor.spawn("drain", self._drain(old))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return self.last_reload

    def _rejected(
        self, reason: str, started: float, errors: list[str], code: str
    ) -> dict[str, Any]:
        self.metrics.reload_failures.inc()
        if self.recorder is not None:
            self.recorder.put(("reload", self.clock(), False, None, errors))
        for line in errors:
            log.error("policy_reload_rejected", reason=reason, error=line)
        self.last_reload = {
            "ok": False,
            "at": round(started, 3),
            "trigger": reason,
            "errors": errors,
            "error": {
                "message": "policy reload rejected, the running policy stays: " + "; ".join(errors),
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            },
        }
        return self.last_reload

    async def _drain(self, old: Runtime) -> None:
        now = time.monotonic()
        warn_at: float | None = now + _DRAIN_LIMIT_S
        # A request takes its generation when its headers arrive but counts
        # itself in flight only once its body is read: one that was still
        # sending its body at the swap is not in `inflight` yet, and closing
        # its backends under it answered it with a plain-text 500. Keep the
        # generation for as long as a body may take (it then counts, or 408s).
        settled = now + old.policy.server.body_timeout_s + 0.5
        # A poll, not an event: in-flight counts change on the hot path, which
        # should not pay for waking a drainer. No deadline: closing the old
        # backends would cut a long answer mid-stream, and every request is
        # bounded by its backend's idle timeout anyway; a drain that lasts
        # says so once.
        while old.inflight > 0 or time.monotonic() < settled:
            if warn_at is not None and time.monotonic() >= warn_at:
                log.warning(
                    "generation_still_draining",
                    inflight=old.inflight,
                    after_s=round(time.monotonic() - now),
                )
                warn_at = None
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
        if rt.tracing is not None and all(r.tracing is not rt.tracing for r in keep):
            await close_tracing(rt.tracing)

    def status(self) -> dict[str, Any]:
        body = self.current.status()
        body["policy"] = {
            "source": self.current.policy.source,
            "hash": self.current.policy_hash,  # = brownout_build_info{policy_hash}
            "loaded_at": round(self.loaded_at, 3),
            "last_reload": self.last_reload,
            "generations_live": len(self.live),
        }
        rec = self.recorder
        body["recorder"] = rec.snapshot() if rec is not None else {"enabled": False}
        body["loops"] = {
            "running": self.supervisor.running(),
            "errors": self.supervisor.errors(),
        }
        return body


def open_tracing(pol: TelemetryPolicy, metrics: Metrics) -> Tracing:
    """The tracer `telemetry.otlp_endpoint` asks for (the SDK is an optional extra)."""
    try:
        from proxy.telemetry.tracing import Tracing
    except ImportError as exc:
        raise RuntimeError(
            "telemetry.otlp_endpoint is set but the OpenTelemetry SDK is not installed: "
            f"pip install 'brownout[otel]' ({exc})"
        ) from None
    return Tracing(pol, metrics.trace_spans)


async def close_tracing(tracing: Tracing) -> None:
    """Export what is queued (within the export timeout), off the loop."""
    await asyncio.to_thread(tracing.shutdown, tracing.policy.export_timeout_s)


def upstream_of(state: ProxyState, name: str) -> Upstream | None:
    return state.current.upstreams.get(name)


def _keep_learnt(up: Upstream, old: Upstream) -> None:
    """What requests taught about the same server stays true across a reload
    (discovery is not run again while it stays healthy): its advertised
    capabilities, whether it takes a prefill or the probe request, and the
    retries it was already given in this window (one budget per backend)."""
    same_kind = old.policy.kind == up.policy.kind
    if same_kind and old.caps is not None and old.caps is not PLAIN:
        up.caps = old.caps  # advertised by its /v1/models (not the kind's default)
    unset = up.policy.supports_continuation is None and old.policy.supports_continuation is None
    if same_kind and unset:  # learnt (advertised, or a prefill refused), not set
        up.supports_continuation = old.supports_continuation
    if up.policy.probe == old.policy.probe:
        up.probe_misconfigured = old.probe_misconfigured
    up.judge.retry_budget = old.judge.retry_budget
