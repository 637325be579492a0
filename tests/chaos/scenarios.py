"""The nine drills, how one is run, and what it must show.

Each drill: a steady load (N clients, one session each) runs through nginx;
after a warm-up the fault is injected (`DrillContext.fault`), held, then
removed (`DrillContext.removed`); the run then waits until the proxy is back
to normal (tier `normal`, no ramp, session store healthy), keeps the load a
little longer, stops it, and audits every session in Redis.

    detect time      first tier change after the fault (from the proxy's own
                     transition history), or for faults that do not move
                     the tier: first sign the proxy noticed (store down,
                     reload rejected)
    back to normal   fault removed → tier normal with no ramp (polled, 0.2 s)
    lost turns       completed answers served with `X-Brownout-Session: used`
                     whose turn is not in the session's Redis history
                     (identified exactly: every question carries its number)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import redis.asyncio as aioredis

from tests.chaos.badcanary import (
    CANARY_STEPS,
    Bundle,
    CanarySummary,
    CandidateProc,
    canary_policy,
    canary_problems,
    canary_sections,
    pick_run_id,
    read_bundle,
    summarize,
)
from tests.chaos.drill import (
    ADMIN_TOKEN,
    Load,
    Req,
    Sample,
    Stack,
    Timeline,
    in_owner_thread,
    is_normal,
    session_key,
    wait_status,
)
from tests.chaos.hostile import (
    HostileClient,
    HostileReq,
    HostileSummary,
    hostile_policy,
    metric_values,
)
from tests.chaos.hostile import summarize as summarize_hostile
from tests.chaos.replay import replay_drill, replay_problems
from tests.harness.procs import is_alive

# Drills failed by a replay of their recording below the fidelity goal
# (keys of `DRILLS`: tests/unit/test_replay_drills.py checks them): those
# whose recordings met it (bench/results/replay-fidelity.md). Not drill 6
# ("overload"): its tier agreement meets it (0.992-1.000), but its
# `deadline` sheds (the expected wait on its mark, ~20 queued at limit 1)
# sit on a knife's edge: the two saved recordings replay 50/56 and 55/50
# (jittered arrivals: 4 of 10 replays each within the 10 %).
FIDELITY_GATED = frozenset(
    {
        "engine_kill",
        "stall",
        "api_kill",
        "redis_stop",
        "fallback_kill",
        "broken_reload",
        "bad_canary",
    }
)  # drill 8 (hostile) meets the goal on both saved recordings (tests/unit/test_replay_drills.py)
# but its second only narrowly (TTFT p95 23 % off, 25 % allowed): reported, not yet gated live
SHORT_FIDELITY_GATED = frozenset({"engine_kill"})

__all__ = [
    "DRILLS",
    "LONG",
    "SHORT",
    "DrillContext",
    "DrillResult",
    "DrillSpec",
    "Durations",
    "run_drill",
]


@dataclass(frozen=True)
class Durations:
    """Seconds (and client counts) of one run; LONG follows the issue's numbers."""

    workers: int = 8  # steady clients (= ladder.throttle.max_inflight)
    think_s: float = 0.2
    max_tokens: int = 200  # long enough (≈ 0.5–1 s) for faults to land mid-answer
    warmup_s: float = 8.0
    settle_s: float = 8.0
    deadline_s: float = 90.0  # a request still open after this is "hung"
    normal_timeout_s: float = 90.0  # "back to normal" later than this is a failure
    failover_hold_s: float = 10.0  # time on the fallback before vLLM is restarted
    stall_s: float = 20.0
    api_down_s: float = 30.0
    redis_down_s: float = 20.0
    maintenance_hold_s: float = 10.0
    burst_s: float = 30.0
    burst_factor: int = 10
    reload_gap_s: float = 5.0
    hostile_s: float = 60.0  # the hostile client's sending window
    hostile_first_byte_s: float = 4.0  # the primary's, in drill 8 (a long answer outlives it)
    hostile_total_s: float = 30.0  # timeouts.total_s of both backends, in drill 8
    hostile_enum: int = 100_000  # entries of the hostile enum schema
    hostile_burst: int = 4  # poison requests at once (retry amplification)
    canary_step_s: float = 20.0  # rollout.step_s in drill 9
    canary_hold_s: float = 10.0  # on the second step before the candidate degrades
    canary_after_s: float = 20.0  # the fault held after the rollback (load on the primary)
    canary_rollback_wait_s: float = 90.0  # how long the drill waits for the rollback


LONG = Durations()
SHORT = Durations(
    workers=4,  # half the clients: vLLM's restart competes with them for 2 cores
    warmup_s=3.0,
    settle_s=2.0,
    deadline_s=60.0,
    normal_timeout_s=90.0,
    failover_hold_s=3.0,
    redis_down_s=4.0,
    reload_gap_s=2.0,
    hostile_s=20.0,
    canary_step_s=8.0,
    canary_hold_s=2.0,
    canary_after_s=4.0,
)


# --------------------------------------------------------------------------- context


@dataclass
class Fault:
    label: str
    t: float
    detect: Literal["tier", "store", "reload", "rollout", "none"] = "tier"
    detected_at: float | None = None  # set by the drill for non-tier faults
    detect_s: float | None = None  # filled in at the end


@dataclass
class Mark:
    t: float
    text: str


@dataclass
class CanaryRun:
    """What drill 9 leaves for `run_drill` to sum up once the load stopped."""

    run_id: str
    rollout: dict[str, Any]
    fault: dict[str, Any]
    degraded_at: float | None
    polled_at: float | None
    bundle: Bundle | None
    policy_added: str = ""  # the candidate's and the rollout's policy lines


@dataclass
class HostileRun:
    """What drill 8 leaves for `run_drill` to sum up once the load stopped."""

    records: list[HostileReq]
    metrics_before: dict[str, dict[str, float]]
    first_byte_s: float


class DrillError(Exception):
    """A drill could not do what it meant to (not a proxy finding)."""


class DrillContext:
    """What a drill's fault script gets: the stack, the load, the timeline, marks."""

    def __init__(
        self,
        stack: Stack,
        load: Load,
        timeline: Timeline,
        durations: Durations,
        http: aiohttp.ClientSession,
    ) -> None:
        self.stack = stack
        self.load = load
        self.timeline = timeline
        self.d = durations
        self.http = http
        self.faults: list[Fault] = []
        self.marks: list[Mark] = []
        self.removed_at: float | None = None
        self.notes: list[str] = []
        self.facts: dict[str, Any] = {}
        self.hostile: HostileRun | None = None
        self.canary: CanaryRun | None = None

    def fault(
        self,
        label: str,
        detect: Literal["tier", "store", "reload", "rollout", "none"] = "tier",
        at: float | None = None,
    ) -> Fault:
        """A fault injected now (or at `at`, when the component that injected it says when)."""
        f = Fault(label, time.time() if at is None else at, detect)
        self.faults.append(f)
        self.marks.append(Mark(f.t, f"FAULT: {label}"))
        return f

    def removed(self, label: str) -> None:
        self.removed_at = time.time()
        self.marks.append(Mark(self.removed_at, f"fault removed: {label}"))

    def info(self, text: str) -> None:
        self.marks.append(Mark(time.time(), text))

    def note(self, text: str) -> None:
        self.notes.append(text)

    async def wait_tier(self, tier: str, limit_s: float) -> Sample | None:
        s = await self.timeline.wait_for(lambda s: s.tier == tier, limit_s)
        if s is None:
            self.note(f"tier {tier} was not reached within {limit_s:.0f} s")
        return s

    async def mid_stream(self) -> None:
        """Faults "mid-load" land while answers are being generated: wait for
        half the clients to be early in an answer (content seen, most of it to
        come). The clients move in near lockstep, and a fault between two
        waves, or after the engine produced the last token, would test
        nothing but retries."""
        want = max(1, self.d.workers // 2)
        got = await self.load.mid_stream(want)
        self.info(f"{got} answers in their first third when the fault hits")

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - time.time()))

    async def metrics(self) -> dict[str, dict[str, float]]:
        """The proxy's attribution and breaker counters, scraped now."""
        async with self.http.get(self.stack.proxy.url + "/metrics") as resp:
            return metric_values(await resp.text())

    async def reload(self, text: str, what: str) -> bool:
        """Write a policy, SIGHUP, wait until the proxy reports it loaded."""
        t = time.time()
        self.stack.write_policy(text)
        self.stack.proxy.sighup()
        s = await self.timeline.wait_for(
            lambda s: s.reload_at is not None and s.reload_at >= t - 0.5 and s.reload_ok is True,
            10,
        )
        if s is None:
            self.note(f"{what}: the reload was not reported ok within 10 s")
        return s is not None

    async def admin(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        async with self.http.post(
            self.stack.proxy.url + path,
            json=body,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as resp:
            return resp.status, await resp.json()

    async def admin_get(self, path: str) -> Any:
        async with self.http.get(
            self.stack.proxy.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as resp:
            return await resp.json()


# --------------------------------------------------------------------------- the drills


def _engine(ctx: DrillContext, title: str) -> list[int]:
    pids = ctx.stack.vllm.engine_pids().get(title, [])
    return list(pids)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def _wait_exit(ctx: DrillContext, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while ctx.stack.vllm.running():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def _reap_orphans(ctx: DrillContext, tree: list[int]) -> None:
    """Kill what is left of a broken vLLM's process tree (snapshot `tree`, taken
    before the fault): once its parent died, `VLLMServer.stop` cannot find it."""
    left = [p for p in tree if _is_vllm_process(p)]
    if left:
        ctx.note(
            f"{len(left)} process(es) of the broken vLLM were still running when it was "
            "restarted (orphans, no longer under the API server); the drill killed them"
        )
        _signal_all(left, signal.SIGKILL)


async def _restart_vllm(ctx: DrillContext, tree: list[int]) -> None:
    _reap_orphans(ctx, tree)
    ctx.info("vLLM restart begins")
    vllm = ctx.stack.vllm
    await in_owner_thread(vllm.restart)
    ctx.facts["vllm_startup_s"] = vllm.last_startup_s
    ctx.removed(f"vLLM healthy again (its startup took {vllm.last_startup_s or 0:.1f} s)")


async def drill_engine_kill(ctx: DrillContext) -> None:
    """1. SIGKILL VLLM::EngineCore mid-load; a supervisor restarts vLLM once it exited."""
    pids = _engine(ctx, "VLLM::EngineCore")
    if not pids:
        raise DrillError("no VLLM::EngineCore process found")
    await ctx.mid_stream()
    tree = [p.pid for p in ctx.stack.vllm.processes()]
    ctx.fault(f"SIGKILL VLLM::EngineCore (pid {', '.join(map(str, pids))})")
    _signal_all(pids, signal.SIGKILL)
    await ctx.wait_tier("failover", 30)
    if await _wait_exit(ctx, 30):
        ctx.info("vLLM API server exited by itself")
    else:
        ctx.note("the vLLM API server was still running 30 s after its engine died")
    await asyncio.sleep(ctx.d.failover_hold_s)
    await _restart_vllm(ctx, tree)


async def drill_stall(ctx: DrillContext) -> None:
    """2. SIGSTOP the engine's worker (or the engine core itself) for 20 s, then SIGCONT."""
    title = "VLLM::Worker"
    pids = _engine(ctx, title)
    if not pids:
        title = "VLLM::EngineCore"
        pids = _engine(ctx, title)
        ctx.note("vLLM runs the model inside VLLM::EngineCore here (no separate worker)")
    if not pids:
        raise DrillError("no vLLM engine process found")
    await ctx.mid_stream()
    ctx.fault(f"SIGSTOP {title} (pid {', '.join(map(str, pids))}) for {ctx.d.stall_s:.0f} s")
    try:
        _signal_all(pids, signal.SIGSTOP)
        await asyncio.sleep(ctx.d.stall_s)
    finally:
        _signal_all(pids, signal.SIGCONT)
    ctx.removed("SIGCONT")


def _is_vllm_process(pid: int) -> bool:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
    except OSError:
        return False
    return is_alive(pid) and (b"VLLM" in cmd or b"vllm" in cmd)


async def drill_api_kill(ctx: DrillContext) -> None:
    """3. SIGKILL the vLLM API server; restart it 30 s later."""
    vllm = ctx.stack.vllm
    engine = [p.pid for p in vllm.processes()]
    await ctx.mid_stream()
    f = ctx.fault(f"SIGKILL vLLM API server (pid {vllm.pid})")
    os.kill(vllm.pid, signal.SIGKILL)
    await ctx.wait_tier("failover", 30)
    await asyncio.sleep(5)
    left = [p for p in engine if _is_vllm_process(p)]
    ctx.facts["orphans_after_5s"] = len(left)
    await ctx.sleep_until(f.t + ctx.d.api_down_s)
    await _restart_vllm(ctx, engine)


async def drill_redis_stop(ctx: DrillContext) -> None:
    """4. Stop redis-server (SIGTERM) for 20 s, then start it again on the same port."""
    redis = ctx.stack.redis
    await ctx.mid_stream()
    f = ctx.fault("redis-server stopped (SIGTERM)", detect="store")
    await in_owner_thread(redis.stop)
    s = await ctx.timeline.wait_for(lambda s: s.store_healthy is False, 10)
    if s is not None:
        f.detected_at = s.t
    await ctx.sleep_until(f.t + ctx.d.redis_down_s)
    await in_owner_thread(redis.start)
    ctx.removed("redis-server started again (same port; its AOF kept the sessions)")


async def drill_fallback_kill(ctx: DrillContext) -> None:
    """5. Kill the engine (→ failover), then the fallback too (→ maintenance); restore both."""
    stack = ctx.stack
    pids = _engine(ctx, "VLLM::EngineCore")
    if not pids:
        raise DrillError("no VLLM::EngineCore process found")
    await ctx.mid_stream()
    tree = [p.pid for p in stack.vllm.processes()]
    ctx.fault(f"SIGKILL VLLM::EngineCore (pid {', '.join(map(str, pids))})")
    _signal_all(pids, signal.SIGKILL)
    await ctx.wait_tier("failover", 30)
    await asyncio.sleep(ctx.d.failover_hold_s)
    assert stack.fallback.proc is not None
    await ctx.mid_stream()
    ctx.fault(f"SIGKILL fallback server (pid {stack.fallback.proc.pid}) during failover")
    await in_owner_thread(stack.fallback.kill)
    await ctx.wait_tier("maintenance", 30)
    await asyncio.sleep(ctx.d.maintenance_hold_s)
    ctx.info("restore both: fallback start + vLLM restart")
    await asyncio.gather(in_owner_thread(stack.fallback.start), _restart_vllm(ctx, tree))
    ctx.removed("fallback and vLLM both healthy again")


async def drill_overload(ctx: DrillContext) -> None:
    """6. A 10× burst: (factor − 1) × N more clients without think time."""
    extra = ctx.d.workers * (ctx.d.burst_factor - 1)
    ctx.fault(
        f"burst: +{extra} clients without think time ({ctx.d.burst_factor}× the steady "
        f"clients) for {ctx.d.burst_s:.0f} s"
    )
    ctx.load.start("burst", extra, think_s=0.0)
    await asyncio.sleep(ctx.d.burst_s)
    ctx.load.halt("burst")
    ctx.removed("burst over (no new burst requests)")
    await ctx.load.stop("burst")
    ctx.info("last burst request finished")


def broken_yaml(good: str) -> str:
    """A syntax error: an unclosed flow sequence."""
    out = good.replace("ladder:\n  throttle:\n", "ladder:\n  throttle: [\n", 1)
    assert out != good
    return out


def broken_schema(good: str) -> str:
    """Valid YAML, wrong policy: a type error and a misspelt knob."""
    out = re.sub(r"max_inflight: \d+", "max_inflight: lots", good, count=1)
    out = out.replace("    window_s: 0.2\n", "    windw_s: 0.2\n", 1)
    assert out != good
    return out


async def drill_broken_reload(ctx: DrillContext) -> None:
    """7. Push broken policies mid-load (SIGHUP, then the API), then the good one back."""
    stack = ctx.stack
    good = stack.policy_text()
    await ctx.mid_stream()
    f = ctx.fault("policy with a YAML syntax error written + SIGHUP", detect="reload")
    stack.write_policy(broken_yaml(good))
    stack.proxy.sighup()
    s = await ctx.timeline.wait_for(
        lambda s: s.reload_at is not None and s.reload_at >= f.t - 0.5 and s.reload_ok is False,
        10,
    )
    if s is not None:
        f.detected_at = s.t
        errors = (ctx.timeline.last_status.get("policy") or {}).get("last_reload", {})
        ctx.facts["sighup_errors"] = errors.get("errors")
    else:
        ctx.note("the SIGHUP reload of a broken policy was not reported within 10 s")
    await asyncio.sleep(ctx.d.reload_gap_s)
    f2 = ctx.fault("policy with schema errors written + POST /brownout/reload", detect="reload")
    stack.write_policy(broken_schema(good))
    code, body = await ctx.admin("/brownout/reload")
    f2.detected_at = time.time()
    ctx.facts["api_reload_status"] = code
    ctx.facts["api_errors"] = body.get("errors") if isinstance(body, dict) else body
    if code != 422:
        ctx.note(f"POST /brownout/reload of a broken policy answered {code}, not 422")
    st = ctx.timeline.last_status
    ctx.facts["max_inflight_after"] = (st.get("concurrency") or {}).get("max")
    await asyncio.sleep(ctx.d.reload_gap_s)
    t_fix = time.time()
    stack.write_policy(good)
    stack.proxy.sighup()
    ctx.info("the good policy written back + SIGHUP")
    s = await ctx.timeline.wait_for(
        lambda s: s.reload_at is not None and s.reload_at >= t_fix - 0.5 and s.reload_ok is True,
        10,
    )
    if s is None:
        ctx.note("the good policy's reload was not reported ok within 10 s")
    ctx.removed("good policy reloaded (ok)")


async def drill_hostile(ctx: DrillContext) -> None:
    """8. A hostile client (its own address) sends poison sampling values, hostile
    schemas, long non-streaming answers and bursts of them while the load runs
    (its workers end users with addresses of their own: one hostile user among
    many; as one frontend address the load would get only half the slots by
    fair share, and a slow CI machine shed it — CI, 2026-12-02)."""
    d, stack = ctx.d, ctx.stack
    good = stack.policy_text()
    fb = d.hostile_first_byte_s
    await ctx.reload(hostile_policy(good, fb, d.hostile_total_s), "the drill's policy")
    ctx.info(
        f"drill policy: primary first_byte_s {fb:g} s, timeouts.total_s "
        f"{d.hostile_total_s:g} s on both backends"
    )
    before = await ctx.metrics()
    async with HostileClient(
        stack.api_url, enum_entries=d.hostile_enum, burst=d.hostile_burst
    ) as hostile:
        ctx.hostile = HostileRun(hostile.records, before, fb)
        await ctx.mid_stream()
        ctx.fault(
            f"hostile client (127.0.0.2 through nginx) for {d.hostile_s:.0f} s: poison "
            f"sampling values, hostile schemas, long non-stream answers, bursts of "
            f"{d.hostile_burst}",
            detect="none",
        )
        hostile.start()
        await asyncio.sleep(d.hostile_s)
        hostile.halt()
        ctx.info(f"hostile client stops sending ({len(hostile.records)} answered so far)")
        await hostile.stop()
    ctx.removed(f"the hostile client's last request ended ({len(hostile.records)} in all)")
    await ctx.reload(good, "the good policy back")


async def _rollout_until(
    ctx: DrillContext, pred: Callable[[dict[str, Any]], bool], limit_s: float
) -> tuple[dict[str, Any], float | None]:
    """Poll GET /brownout/rollout (every 0.1 s) until `pred` holds: the last
    answer, and the wall time it was seen (None after `limit_s`)."""
    deadline = time.monotonic() + limit_s
    while True:
        snap: dict[str, Any] = await ctx.admin_get("/brownout/rollout")
        if pred(snap):
            return snap, time.time()
        if time.monotonic() > deadline:
            return snap, None
        await asyncio.sleep(0.1)


async def _fault_mode(
    ctx: DrillContext, cand: CandidateProc, mode: str, **wait: float
) -> dict[str, Any]:
    """Switch the fault proxy (see tests.chaos.faultproxy): its answer, with
    the time of the switch (`at`)."""
    async with ctx.http.post(cand.url + "/_fault", json={"mode": mode, **wait}) as resp:
        body: dict[str, Any] = await resp.json()
        if resp.status != 200:
            raise DrillError(f"the fault proxy answered {resp.status}: {body}")
        return body


def _rollout_marks(ctx: DrillContext, snap: dict[str, Any]) -> None:
    for h in snap.get("history") or []:
        i = int(h["step"])
        share = CANARY_STEPS[i] if 0 <= i < len(CANARY_STEPS) else float(h["share"])
        step = f"step {i + 1} of {len(CANARY_STEPS)} ({share:.0%})"
        text = {
            "started": f"rollout started: {step}",
            "step": f"rollout: {step}",
            "rolled_back": f"rollout ROLLED BACK at {step}: {h.get('gate')}: {h.get('detail')}",
        }.get(str(h.get("change")), f"rollout: {h.get('change')} ({step})")
        ctx.marks.append(Mark(float(h["at"]), _short(text, 160)))


async def drill_bad_canary(ctx: DrillContext) -> None:
    """9. A gray release (issue 21) whose candidate runs out of memory at its
    second step under load; the proxy must roll back by itself."""
    stack = ctx.stack
    good = stack.policy_text()
    run_id = ctx.load.run_id
    cand = CandidateProc(stack.vllm.base_url, stack.workdir / f"candidate-{run_id}.log")
    run = CanaryRun(run_id, {}, {}, None, None, None)
    ctx.canary = run
    await in_owner_thread(cand.start)
    try:
        snapdir = stack.workdir / f"rollouts-{run_id}"
        policy = canary_policy(good, cand.url, snapdir, ctx.d.canary_step_s)
        run.policy_added = "backends:\n  ...\n" + "\n".join(
            canary_sections(good, cand.url, snapdir, ctx.d.canary_step_s)
        )
        await _bad_canary(ctx, cand, run, policy)
    finally:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            run.rollout = await ctx.admin_get("/brownout/rollout")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with ctx.http.get(cand.url + "/_fault") as resp:
                run.fault = await resp.json()
        await ctx.reload(good, "the stack's policy back (no candidate)")
        await in_owner_thread(cand.stop)
    snap = run.rollout
    _rollout_marks(ctx, snap)
    if snap.get("bundle_error"):
        ctx.note(f"bundle_error in the rollout status: {snap['bundle_error']}")
    rolled = [h for h in snap.get("history") or [] if h.get("change") == "rolled_back"]
    if snap.get("state") == "rolled_back" and rolled:
        bundles = snap.get("bundles") or []
        run.bundle = await asyncio.to_thread(
            read_bundle,
            bundles[-1] if bundles else None,
            str(snap.get("id") or ""),
            str(snap.get("failed_gate") or ""),
            int(rolled[-1]["step"]),
        )


async def _bad_canary(ctx: DrillContext, cand: CandidateProc, run: CanaryRun, policy: str) -> None:
    d = ctx.d
    await ctx.reload(policy, "drill policy")
    steps = ", ".join(f"{s:.0%}" for s in CANARY_STEPS)
    ctx.info(
        f"drill policy: backends.candidate = the fault proxy in front of vLLM; rollout "
        f"steps {steps}, step_s {d.canary_step_s:g} s"
    )
    snap, seen = await _rollout_until(
        ctx, lambda s: (s.get("candidate") or {}).get("healthy") is True, 15
    )
    if seen is None:
        raise DrillError(f"the candidate was not reported healthy within 15 s: {snap}")
    code, body = await ctx.admin("/brownout/rollout", {"action": "start"})
    if code != 200:
        raise DrillError(f"POST /brownout/rollout start answered {code}: {body}")
    limit = 3 * d.canary_step_s + 30
    snap, seen = await _rollout_until(
        ctx, lambda s: s.get("state") != "step" or (s.get("step") or 0) >= 1, limit
    )
    if seen is None or snap.get("state") != "step" or snap.get("step") != 1:
        ctx.note(
            f"the rollout did not stop at its second step within {limit:.0f} s: state "
            f"{snap.get('state')}, step {snap.get('step')}, gate "
            f"{snap.get('failed_gate')}: {snap.get('reason')}"
        )
        return
    await asyncio.sleep(d.canary_hold_s)
    # The switch waits (inside the fault proxy) for a stream under way on the
    # candidate that it can cut mid-answer; bounded, so the fault lands inside the step.
    limit_s = max(0.5, d.canary_step_s - d.canary_hold_s - 1.5)
    switched = await _fault_mode(ctx, cand, "oom", wait_streams=1, limit_s=limit_s)
    run.degraded_at = float(switched["at"])
    ctx.marks.append(
        Mark(
            run.degraded_at,
            f"{switched['early']} request(s) in flight on the candidate, not yet "
            "16 events into their answer, when the fault hits",
        )
    )
    f = ctx.fault(
        "the candidate runs out of memory at the second step (50 %): its streams end "
        "mid-answer (after 16 events) with vLLM's engine error event, new generation "
        "requests get 500 CUDA out of memory, its /health stays 200",
        detect="rollout",
        at=run.degraded_at,  # the fault proxy's own time of the switch
    )
    snap, run.polled_at = await _rollout_until(
        ctx, lambda s: s.get("state") != "step", d.canary_rollback_wait_s
    )
    if run.polled_at is None:
        ctx.note(f"no rollback within {d.canary_rollback_wait_s:.0f} s of the fault")
    rolled = [h for h in snap.get("history") or [] if h.get("change") == "rolled_back"]
    if rolled:
        f.detected_at = float(rolled[-1]["at"])
    # The bundle is written off the proxy's loop just after the rollback.
    await _rollout_until(ctx, lambda s: bool(s.get("bundles") or s.get("bundle_error")), 10)
    await asyncio.sleep(d.canary_after_s)
    await _fault_mode(ctx, cand, "healthy")
    ctx.removed("the candidate healthy again (the rollout stays rolled back)")


# --------------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class DrillSpec:
    number: int
    key: str
    title: str
    run: Callable[[DrillContext], Awaitable[None]]
    expect: Callable[[DrillResult], list[str]]
    # The load's run id (its sessions' ids): drill 9 needs sessions on both arms.
    run_id: Callable[[Durations], str] | None = None
    # The load's workers as end users with their own addresses (Load.own_addresses).
    own_addresses: bool = False


def _reached(r: DrillResult, tier: str) -> bool:
    return any(t["to"] == tier for t in r.transitions)


def _expect_failover(r: DrillResult) -> list[str]:
    return [] if _reached(r, "failover") else ["the tier never went to failover"]


def _expect_no_tier_change(r: DrillResult) -> list[str]:
    out = []
    if r.transitions:
        out.append(f"the tier moved: {[t['from'] + '->' + t['to'] for t in r.transitions]}")
    if r.counts["error"]:
        out.append(f"{r.counts['error']} explicit errors where none were expected")
    return out


def _expect_redis(r: DrillResult) -> list[str]:
    out = _expect_no_tier_change(r)
    if r.sessions["unavailable"] == 0:
        out.append("no answer said X-Brownout-Session: unavailable")
    if r.faults[0].detect_s is None:
        out.append("the proxy never reported the session store down")
    return out


def _expect_maintenance(r: DrillResult) -> list[str]:
    out = _expect_failover(r)
    if not _reached(r, "maintenance"):
        out.append("the tier never went to maintenance")
    if r.counts["maintenance"] == 0:
        out.append("no maintenance answer was served")
    return out


def _expect_overload(r: DrillResult) -> list[str]:
    out = [] if _reached(r, "throttle") else ["the burst never moved the tier to throttle"]
    if any(t["to"] in ("failover", "maintenance") for t in r.transitions):
        out.append("an overload alone moved the tier past throttle")
    return out


def _expect_reload(r: DrillResult) -> list[str]:
    out = _expect_no_tier_change(r)
    if any(f.detect_s is None for f in r.faults):
        out.append("a broken policy's rejection was not reported")
    if r.facts.get("api_reload_status") != 422:
        out.append(f"API reload answered {r.facts.get('api_reload_status')}, not 422")
    if r.facts.get("max_inflight_after") not in (None, 8):
        out.append("the broken policy changed the running concurrency limit")
    return out


def _expect_hostile(r: DrillResult) -> list[str]:
    h = r.hostile
    if h is None:
        return ["no hostile-client figures"]
    out = []
    # The others' requests may be shed by the throttle tier (429 with
    # Retry-After) while the hostile client's long generations share the CPU
    # engine with theirs — a slow engine, not an attribution: CI of
    # 2026-12-02 and 2026-12-04 (TTFT 6-9 s against the drill's 4 s first
    # byte; 2026-12-05: 9 of 26 shed). Every other kind of failure fails the
    # drill, and so do sheds of more than half their requests.
    sheds = sum(n for k, n in h.others_bad.items() if k == "error (429:rate_limit_exceeded)")
    if h.others_total - h.others_normal > sheds or sheds * 2 > h.others_total:
        out.append(
            f"{h.others_total - h.others_normal} of {h.others_total} other clients' requests "
            f"during and after the hostile client were not answered normally: {h.others_bad}"
        )
    opened = h.metrics.get("brownout_breaker_transitions_total")
    if opened:
        out.append(f"breaker transitions: {opened}")
    seen = {k: v for k, v in h.breakers_seen.items() if v != ["up/closed"]}
    if seen:
        out.append(f"backend states (health/breaker) seen in /brownout/status: {seen}")
    past = [t["to"] for t in r.transitions if t["to"] not in ("normal", "throttle")]
    if past:
        out.append(f"the hostile client moved the tier to {', '.join(past)}")
    if not h.hostile_verdicts:
        out.append("the hostile client got no answer at all")
    if h.hostile_verdicts.get("bad"):
        out.append(
            f"{h.hostile_verdicts['bad']} hostile requests got no clear error "
            f"(a 500, a broken reply or none): {h.bad_examples}"
        )
    return out


def _expect_canary(r: DrillResult) -> list[str]:
    out = [] if r.canary is not None else ["no bad-canary figures"]
    if r.canary is not None:
        out.extend(canary_problems(r.canary))
    past = [t["to"] for t in r.transitions if t["to"] not in ("normal", "throttle")]
    if past:
        out.append(f"the bad canary moved the tier to {', '.join(past)}")
    return out


DRILLS: dict[str, DrillSpec] = {
    s.key: s
    for s in (
        DrillSpec(1, "engine_kill", "Kill the vLLM engine process mid-load", drill_engine_kill,
                  _expect_failover),
        DrillSpec(2, "stall", "SIGSTOP the vLLM worker for 20 s, then SIGCONT", drill_stall,
                  _expect_failover),
        DrillSpec(3, "api_kill", "Kill the vLLM API server, restart it after 30 s",
                  drill_api_kill, _expect_failover),
        DrillSpec(4, "redis_stop", "Stop Redis for 20 s", drill_redis_stop, _expect_redis),
        DrillSpec(5, "fallback_kill", "Kill the fallback during failover, then restore both",
                  drill_fallback_kill, _expect_maintenance),
        DrillSpec(6, "overload", "A 10× overload burst", drill_overload, _expect_overload),
        DrillSpec(7, "broken_reload", "A broken policy pushed by reload mid-load",
                  drill_broken_reload, _expect_reload),
        DrillSpec(8, "hostile", "A hostile client: poison parameters, hostile schemas, "
                  "long non-stream answers", drill_hostile, _expect_hostile,
                  own_addresses=True),
        DrillSpec(9, "bad_canary", "A bad canary: the candidate runs out of memory at the "
                  "second rollout step", drill_bad_canary, _expect_canary,
                  run_id=lambda d: pick_run_id(d.workers)),
    )
}  # fmt: skip


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Phase:
    """Answers that ended within one stretch of a drill."""

    name: str
    seconds: float
    complete: int
    maintenance: int
    failed: int

    @property
    def rate(self) -> float:
        return self.complete / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DrillResult:
    number: int
    key: str
    title: str
    started: float
    ended: float
    faults: list[Fault]
    removed_at: float | None
    normal_at: float | None
    counts: dict[str, int]
    error_codes: dict[str, int]
    backends: dict[str, int]
    sessions: dict[str, int]
    lost: list[Req]
    extra: list[tuple[str, int]]
    transitions: list[dict[str, Any]]
    timeline: list[tuple[float, str]]
    notes: list[str]
    facts: dict[str, Any]
    phases: list[Phase] = field(default_factory=list)
    failure: str | None = None
    problems: list[str] = field(default_factory=list)
    records: list[Req] = field(default_factory=list, repr=False)
    hostile: HostileSummary | None = None
    # The drill's flight recording replayed under its own policy (tests/chaos/replay.py).
    replay: dict[str, Any] | None = None
    canary: CanarySummary | None = None

    @property
    def t0(self) -> float:
        return self.faults[0].t if self.faults else self.started

    @property
    def detect_s(self) -> float | None:
        return self.faults[0].detect_s if self.faults else None

    @property
    def back_to_normal_s(self) -> float | None:
        if self.normal_at is None:
            return None
        return max(0.0, self.normal_at - (self.removed_at or self.t0))

    @property
    def outage_s(self) -> float | None:
        return None if self.normal_at is None else self.normal_at - self.t0

    @property
    def ok(self) -> bool:
        return not self.problems


_QUESTION = re.compile(r"^Question (\d+):")


async def stored_questions(redis_url: str, sessions: list[str]) -> dict[str, list[int]]:
    """Per session, the question numbers of the turns stored in Redis."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        out: dict[str, list[int]] = {}
        for sid in sessions:
            raw = await client.hget(session_key(sid), "history")
            nums = []
            for m in json.loads(raw) if raw else []:
                if m.get("role") == "user" and (mm := _QUESTION.match(str(m.get("content")))):
                    nums.append(int(mm.group(1)))
            out[sid] = nums
        return out
    finally:
        await client.aclose()


def _short(text: str, n: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _timeline(
    marks: list[Mark], transitions: list[dict[str, Any]], samples: list[Sample]
) -> list[tuple[float, str]]:
    events: list[tuple[float, str]] = [(m.t, m.text) for m in marks]
    for t in transitions:
        events.append(
            (
                float(t["at"]),
                f"tier {t['from']} → {t['to']} ({t['reason']}: {_short(t['detail'] or '-')})",
            )
        )
    prev: Sample | None = None
    for s in samples:
        if prev is not None:
            if s.ramp != prev.ramp:
                target = "fallback" if s.tier == "failover" else "primary"
                events.append(
                    (
                        s.t,
                        f"ramp: {target} gets {s.ramp:.0%} of new requests"
                        if s.ramp is not None
                        else "ramp done (100 %)",
                    )
                )
            if s.store_healthy != prev.store_healthy and s.store_healthy is not None:
                events.append((s.t, f"status: session store {'up' if s.store_healthy else 'DOWN'}"))
            if s.reload_at != prev.reload_at and s.reload_at is not None:
                events.append((s.t, f"status: policy reload {'ok' if s.reload_ok else 'REJECTED'}"))
            if s.pressure != prev.pressure:
                events.append((s.t, f"pressure: {s.pressure or 'cleared'}"))
            if s.reachable != prev.reachable:
                events.append((s.t, "status page " + ("back" if s.reachable else "UNREACHABLE")))
        prev = s
    events.sort(key=lambda e: e[0])
    return events


def _ready(st: dict[str, Any]) -> bool:
    """Normal tier, no ramp, no pressure, the full admission limit, both backends
    healthy with closed breakers, the session store up: a clean start."""
    c = st.get("concurrency") or {}
    return bool(
        st.get("tier") == "normal"
        and st["ladder"]["ramp"] is None
        and not (st.get("pressure") or {}).get("active")
        and c.get("limit") == c.get("max")
        and all(b["healthy"] and b["breaker"] == "closed" for b in st["backends"].values())
        and st["sessions"]["healthy"] is not False
    )


def _busy(st: dict[str, Any]) -> tuple[int, int, int]:
    """(requests in handlers, admission slots taken, requests queued) per /brownout/status."""
    c = st.get("concurrency") or {}
    adm = c.get("admission") or {}
    queued = adm.get("queued") or {}
    return (
        int(c.get("inflight") or 0),
        int(adm.get("inflight") or 0),
        sum(int(v) for v in queued.values()) if isinstance(queued, dict) else int(queued),
    )


async def _idle_status(stack: Stack) -> dict[str, Any]:
    """The status once the load has stopped: give bookkeeping 3 s to reach zero."""
    deadline = time.monotonic() + 3
    while True:
        st = await asyncio.to_thread(stack.status)
        if _busy(st) == (0, 0, 0) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.1)


async def run_drill(stack: Stack, spec: DrillSpec, d: Durations) -> DrillResult:
    """Run one drill end to end on a working stack; never raises for a finding."""
    await in_owner_thread(stack.repair)
    st = await asyncio.to_thread(
        wait_status, stack, _ready, 120, f"drill {spec.number}: the stack back to normal first"
    )
    pre_notes = []
    leaked = _busy(st)[1]
    if leaked:
        # Leaked admission slots would throttle this drill: start from a fresh proxy.
        pre_notes.append(
            f"the proxy was restarted before this drill: {leaked} admission slot(s) "
            "leaked by the previous one"
        )
        await in_owner_thread(stack.restart_proxy)
        await asyncio.to_thread(wait_status, stack, _ready, 120, "the restarted proxy normal")
    started = time.time()
    failure: str | None = None
    normal_at: float | None = None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        Timeline(stack.status_url) as tl,
        Load(
            stack.api_url,
            run_id=spec.run_id(d) if spec.run_id else f"d{spec.number}-{uuid.uuid4().hex[:6]}",
            max_tokens=d.max_tokens,
            think_s=d.think_s,
            deadline_s=d.deadline_s,
            own_addresses=spec.own_addresses,
        ) as load,
    ):
        ctx = DrillContext(stack, load, tl, d, http)
        ctx.notes.extend(pre_notes)
        load.start("steady", d.workers)
        await asyncio.sleep(d.warmup_s)
        try:
            await spec.run(ctx)
        except Exception as exc:  # the drill itself broke: report it, keep measuring
            failure = f"{type(exc).__name__}: {exc}"
        s = await tl.wait_for(
            lambda s: is_normal(s) and s.store_healthy is not False, d.normal_timeout_s
        )
        normal_at = s.t if s is not None else None
        if normal_at is None:
            ctx.note(f"not back to normal {d.normal_timeout_s:.0f} s after the fault was removed")
        else:
            ctx.marks.append(Mark(normal_at, "back to normal (tier normal, no ramp)"))
        await asyncio.sleep(d.settle_s)
        ctx.info("load stops")
        await load.stop("steady")
        await load.stop("burst")
        ended = time.time()
        final = await _idle_status(stack)
    samples = list(tl.samples)
    limits = list(tl.limits)
    transitions = [h for h in final.get("history", []) if started <= float(h["at"]) <= ended + 0.5]
    for f in ctx.faults:
        if f.detect == "tier":
            after = [float(h["at"]) for h in transitions if float(h["at"]) >= f.t - 0.05]
            f.detect_s = (after[0] - f.t) if after else None
        elif f.detected_at is not None:
            f.detect_s = f.detected_at - f.t
    if ctx.faults and ctx.faults[0].detect == "store":
        first_unavailable = [
            r.headers_at
            for r in load.records
            if r.session_state == "unavailable" and r.headers_at and r.headers_at >= ctx.faults[0].t
        ]
        cands = [x for x in [ctx.faults[0].detected_at, *first_unavailable[:1]] if x is not None]
        if cands:
            ctx.faults[0].detect_s = min(cands) - ctx.faults[0].t

    records = list(load.records)
    counts = collections.Counter(r.outcome for r in records)
    result_counts = {
        "sent": len(records),
        "complete": counts["complete"] + counts["maintenance"],
        "model_answers": counts["complete"],
        "rescued": sum(1 for r in records if r.outcome == "complete" and r.rescued),
        "maintenance": counts["maintenance"],
        "error": counts["error"],
        "truncated": counts["truncated"],
        "hung": counts["hung"],
        "rescue_failed": sum(1 for r in records if r.outcome == "error" and r.rescued),
    }
    error_codes = dict(collections.Counter(r.code for r in records if r.outcome == "error"))
    backends = dict(collections.Counter(r.backend for r in records if r.outcome == "complete"))

    # Turns whose save timed out wait in the proxy's queue and are written
    # within about a second of Redis answering: audit once the queue is empty.
    drain_deadline = time.monotonic() + 10.0
    while time.monotonic() < drain_deadline:
        status = await asyncio.to_thread(stack.status)
        if not status.get("sessions", {}).get("saves_waiting"):
            break
        await asyncio.sleep(0.2)
    stored = await stored_questions(stack.redis.url, load.sessions)
    expected = [
        r
        for r in records
        if r.outcome == "complete"
        and r.backend in ("primary", "fallback", "candidate")
        and r.session_state == "used"
    ]
    expected_keys = {(r.session, r.n) for r in expected}
    stored_keys = {(sid, n) for sid, nums in stored.items() for n in nums}
    lost = [r for r in expected if (r.session, r.n) not in stored_keys]
    extra = sorted(stored_keys - expected_keys)
    sessions = {
        "sessions": len(load.sessions),
        "expected_turns": len(expected),
        "stored_turns": sum(len(v) for v in stored.values()),
        "lost": len(lost),
        "extra": len(extra),
        "unavailable": sum(1 for r in records if r.session_state == "unavailable"),
        "duplicates": sum(len(v) - len(set(v)) for v in stored.values()),
    }
    t_fault = ctx.faults[0].t if ctx.faults else started
    # The limit in force at the fault, then every change after it.
    at_fault = [v for t, v in limits if t <= t_fault]
    since = [(t_fault, v) for v in at_fault[-1:]] + [(t, v) for t, v in limits if t > t_fault]
    if since:
        top = max(v for _, v in limits)
        low_t, low = min(since, key=lambda x: x[1])
        if low < top:
            back = [t for t, v in limits if t > low_t and v == top]
            ctx.facts["admission_limit"] = f"{top} → {low} at {low_t - t_fault:+.1f} s → " + (
                f"{top} again at {back[0] - t_fault:+.1f} s" if back else "not back"
            )
    edges = [
        ("before the fault", started, t_fault),
        ("fault → removed", t_fault, ctx.removed_at or t_fault),
        ("removed → normal", ctx.removed_at or t_fault, normal_at or ended),
        ("after", normal_at or ended, ended),
    ]
    phases = []
    for name, a, b in edges:
        inside = [r for r in records if a <= r.ended < b]
        phases.append(
            Phase(
                name,
                b - a,
                sum(1 for r in inside if r.outcome in ("complete", "maintenance")),
                sum(1 for r in inside if r.outcome == "maintenance"),
                sum(1 for r in inside if r.outcome not in ("complete", "maintenance")),
            )
        )
    result = DrillResult(
        number=spec.number,
        key=spec.key,
        title=spec.title,
        started=started,
        ended=ended,
        faults=ctx.faults,
        removed_at=ctx.removed_at,
        normal_at=normal_at,
        counts=result_counts,
        error_codes=error_codes,
        backends=backends,
        sessions=sessions,
        lost=lost,
        extra=extra,
        transitions=transitions,
        timeline=_timeline(ctx.marks, transitions, samples),
        phases=phases,
        notes=ctx.notes,
        facts=ctx.facts,
        failure=failure,
        records=records,
    )
    if ctx.hostile is not None:
        hr = ctx.hostile
        result.hostile = summarize_hostile(
            hr.records,
            [r for r in records if r.ended >= t_fault],
            hr.metrics_before,
            await ctx_metrics(stack),
            hr.first_byte_s,
            breakers_seen={
                "primary": sorted({s.primary for s in samples if s.primary}),
                "fallback": sorted({s.fallback for s in samples if s.fallback}),
            },
        )
    try:
        result.replay = await asyncio.to_thread(
            replay_drill, stack.recording_dir, stack.workdir, spec.number, started, ended
        )
    except Exception as exc:  # a replay that breaks is a finding, not a crash
        result.replay = {"error": f"{type(exc).__name__}: {exc}"}
    if ctx.canary is not None:
        cr = ctx.canary
        result.canary = summarize(
            cr.rollout,
            cr.fault,
            records,
            run_id=cr.run_id,
            workers=d.workers,
            degraded_at=cr.degraded_at,
            polled_at=cr.polled_at,
            bundle=cr.bundle,
            policy_added=cr.policy_added,
        )
    handlers, slots, queued = _busy(final)
    result.facts["idle_after_load"] = (
        f"handlers {handlers}, admission slots {slots}, queued {queued}"
    )
    # A replay below the fidelity goal fails the drills whose fidelity was
    # measured at the goal (`FIDELITY_GATED`); the others report it. The
    # short drills of `make test` gate engine death only: their few seconds
    # on a loaded CI machine (CI 2026-12-05: redis_stop 0.709, a throttle
    # the recording did not hold) are not the recordings the goal was
    # measured on (their fixtures are gated in tests/unit).
    gated = FIDELITY_GATED if d is not SHORT else SHORT_FIDELITY_GATED
    gate = replay_problems(result.replay) if spec.key in gated else []
    result.problems = _problems(result, spec) + gate
    if slots > handlers:
        result.problems.append(
            f"{slots - handlers} admission slot(s) leaked: taken with no request in flight "
            f"(limit {(final.get('concurrency') or {}).get('limit')})"
        )
    elif handlers or queued:
        result.problems.append(
            f"not idle after the load stopped: {result.facts['idle_after_load']}"
        )
    return result


async def ctx_metrics(stack: Stack) -> dict[str, dict[str, float]]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.get(stack.proxy.url + "/metrics") as resp,
    ):
        return metric_values(await resp.text())


def _problems(r: DrillResult, spec: DrillSpec) -> list[str]:
    out = []
    if r.failure:
        out.append(f"the drill failed: {r.failure}")
    if r.counts["truncated"]:
        out.append(f"{r.counts['truncated']} truncated answers presented as success")
    if r.counts["hung"]:
        out.append(f"{r.counts['hung']} hung requests")
    if r.sessions["lost"]:
        out.append(f"{r.sessions['lost']} lost session turns")
    if r.sessions["duplicates"]:
        out.append(f"{r.sessions['duplicates']} session turns stored twice")
    if r.normal_at is None:
        out.append("not back to normal")
    out.extend(spec.expect(r))
    return out
