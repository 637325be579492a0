"""Drill 9's pure parts and its candidate: the fault proxy in front of a
scripted engine, the drill's policy, the session spread, the bundle check,
the figures, the verdict and their report (no real servers; the drill
itself runs in test_chaos_short.py and `make chaos`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.control.attribution import classify as attribute
from proxy.control.rollout import bucket
from proxy.policy.loader import parse_policy
from tests.chaos.badcanary import (
    CanarySummary,
    canary_policy,
    canary_problems,
    judge_bundle,
    pick_run_id,
    spread,
    spread_ok,
    summarize,
)
from tests.chaos.drill import Load, Req, Stack, classify
from tests.chaos.faultproxy import FaultProxy
from tests.chaos.report import canary_section
from tests.chaos.scenarios import DRILLS, LONG, SHORT
from tests.harness.procs import free_port

CHAT = "/v1/chat/completions"


def event(content: str, finish: str | None = None) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(delta).encode() + b"\n\n"


# --------------------------------------------------------------------------- the fault proxy


class Engine:
    """A scripted engine: streams `events` one per `gap_s`, else a JSON answer."""

    def __init__(self, events: int = 3, gap_s: float = 0.0) -> None:
        self.events = events
        self.gap_s = gap_s
        self.started = asyncio.Event()
        self.closed = asyncio.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(
                {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.events):
                # Two writes per event: the proxy must not relay half an event.
                ev = event(f"t{i}")
                await resp.write(ev[:7])
                await resp.write(ev[7:])
                self.started.set()
                await asyncio.sleep(self.gap_s)
            await resp.write(event("", "stop") + b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.closed.set()
            raise
        return resp

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    port = free_port()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def rig(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Engine, FaultProxy, str, aiohttp.ClientSession]]:
    engine = Engine(**getattr(request, "param", {}))
    app = web.Application()
    app.router.add_post(CHAT, engine.chat)
    app.router.add_get("/health", engine.health)
    up_runner, up_url = await _serve(app)
    fp = FaultProxy(up_url)
    fp_runner, fp_url = await _serve(fp.app())
    async with aiohttp.ClientSession() as http:
        yield engine, fp, fp_url, http
    await fp_runner.cleanup()
    await up_runner.cleanup()


async def _ask(
    http: aiohttp.ClientSession, url: str, rid: str, stream: bool = True
) -> tuple[int, bytes]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    async with http.post(url + CHAT, json=body, headers={"X-Request-Id": rid}) as r:
        return r.status, await r.read()


async def _mode(http: aiohttp.ClientSession, url: str, mode: str) -> int:
    async with http.post(url + "/_fault", json={"mode": mode}) as r:
        return r.status


async def test_healthy_it_relays_the_engine_event_by_event(rig: Any) -> None:
    _, fp, url, http = rig
    status, raw = await _ask(http, url, "r1")
    assert status == 200
    assert raw == event("t0") + event("t1") + event("t2") + event("", "stop") + b"data: [DONE]\n\n"
    assert (await _ask(http, url, "r2", stream=False))[0] == 200
    async with http.get(url + "/health") as r:
        assert r.status == 200
    assert [(s.request_id, s.action) for s in fp.seen] == [("r1", "passed"), ("r2", "passed")]


async def test_out_of_memory_new_requests_get_an_oom_the_proxy_recognises(rig: Any) -> None:
    _, fp, url, http = rig
    assert await _mode(http, url, "oom") == 200
    status, raw = await _ask(http, url, "r1")
    assert status == 500
    # What Brownout's attribution makes of it: an OOM, the backend's fault, definitive.
    v = attribute("http_500", 500, raw)
    assert (v.fault, v.attribution, v.suspect) == ("oom", "backend", False)
    assert (await _ask(http, url, "r2", stream=False))[0] == 500
    async with http.get(url + "/health") as r:
        assert r.status == 200  # the API server is up and says so
    assert [s.action for s in fp.seen] == ["oom", "oom"]
    assert all(s.failed_at is not None for s in fp.seen)
    assert await _mode(http, url, "healthy") == 200
    assert (await _ask(http, url, "r3"))[0] == 200
    async with http.get(url + "/_fault") as r:
        rep = await r.json()
    assert rep["mode"] == "healthy" and [s["action"] for s in rep["seen"]][-1] == "passed"


@pytest.mark.parametrize("rig", [{"events": 50, "gap_s": 0.01}], indirect=True)
@pytest.mark.parametrize("cut_after", [16, 0])
async def test_out_of_memory_a_stream_under_way_ends_with_the_engine_error(
    rig: Any, cut_after: int
) -> None:
    """Mid-answer: once it relayed `cut_after` events (16 by default), a
    stream under way gets the engine's error event and [DONE]."""
    engine, fp, url, http = rig
    task = asyncio.create_task(_ask(http, url, "r1"))
    await asyncio.wait_for(engine.started.wait(), 5)
    async with http.post(url + "/_fault", json={"mode": "oom", "cut_after": cut_after}) as r:
        assert r.status == 200
    status, raw = await asyncio.wait_for(task, 5)
    assert status == 200
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    content = [e + b"\n\n" for e in events[:-3]]
    # Whole events, the engine's own, as many as cut_after (at least the one before the fault).
    assert content == [event(f"t{i}") for i in range(len(content))]
    assert len(content) == max(cut_after, 1)
    # An in-band engine death: definitive for Brownout, an error for the client.
    assert attribute("stream_error", 200, events[-3][6:]).fault == "engine_dead"
    v = classify(200, "text/event-stream", raw)
    assert (v.outcome, v.code) == ("error", "500")
    await asyncio.wait_for(engine.closed.wait(), 5)  # the engine's stream was closed
    (seen,) = fp.seen
    assert (seen.action, seen.events) == ("cut", len(content))
    assert seen.failed_at is not None and seen.ended is not None


async def test_it_reports_the_requests_in_flight(rig: Any) -> None:
    engine, _, url, http = rig
    engine.events, engine.gap_s = 20, 0.02
    task = asyncio.create_task(_ask(http, url, "r1"))
    await asyncio.wait_for(engine.started.wait(), 5)
    async with http.get(url + "/_fault") as r:
        assert (await r.json())["inflight"] == 1
    await task
    async with http.get(url + "/_fault") as r:
        rep = await r.json()
    assert rep["inflight"] == 0 and rep["seen"][0]["events"] == 22  # 20 + finish + [DONE]


@pytest.mark.parametrize("rig", [{"events": 50, "gap_s": 0.01}], indirect=True)
async def test_the_switch_can_wait_for_a_stream_to_cut(rig: Any) -> None:
    """`wait_streams`: the fault starts once a stream is under way that has
    not yet relayed `cut_after` events, so it is cut mid-answer."""
    _, fp, url, http = rig
    switch = asyncio.create_task(
        http.post(url + "/_fault", json={"mode": "oom", "wait_streams": 1, "limit_s": 5})
    )
    await asyncio.sleep(0.1)
    assert fp.mode == "healthy"  # nothing in flight yet: still waiting
    status, raw = await asyncio.wait_for(_ask(http, url, "r1"), 5)
    async with await switch as r:
        body = await r.json()
    assert (r.status, body["mode"], body["early"]) == (200, "oom", 1)
    assert status == 200 and raw.count(b'"content": "t') == 16
    assert fp.seen[0].action == "cut"
    # With nothing in flight, the switch comes at `limit_s` anyway.
    async with http.post(url + "/_fault", json={"mode": "healthy"}):
        pass
    async with http.post(
        url + "/_fault", json={"mode": "oom", "wait_streams": 1, "limit_s": 0.05}
    ) as r:
        assert (await r.json())["early"] == 0 and fp.mode == "oom"


async def test_an_unknown_mode_is_refused(rig: Any) -> None:
    _, fp, url, http = rig
    assert await _mode(http, url, "slow") == 400
    async with http.post(url + "/_fault", json={"mode": "oom", "cut_after": -1}) as r:
        assert r.status == 400
    assert fp.mode == "healthy"


async def test_an_engine_that_is_gone_is_a_502_and_recorded() -> None:
    fp = FaultProxy(f"http://127.0.0.1:{free_port()}")
    runner, url = await _serve(fp.app())
    try:
        async with aiohttp.ClientSession() as http:
            assert (await _ask(http, url, "r1"))[0] == 502
        assert fp.seen[0].action == "upstream_error"
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- policy, sessions


def _stack_policy(tmp_path: Path) -> str:
    vllm = types.SimpleNamespace(base_url="http://127.0.0.1:8000")
    return Stack(vllm, tmp_path / "model", tmp_path / "w").policy_text()  # type: ignore[arg-type]


def test_the_drill_policy_adds_a_candidate_and_a_short_rollout(tmp_path: Path) -> None:
    text = canary_policy(_stack_policy(tmp_path), "http://127.0.0.1:9", tmp_path / "snap", 20)
    pol = parse_policy(text, "drill9.yaml")
    cand = pol.backends.candidate
    assert cand is not None
    assert cand.url == "http://127.0.0.1:9" and cand.kind == "vllm"
    assert cand.timeouts == pol.backends.primary.timeouts
    r = pol.rollout
    assert r.steps == (0.25, 0.5, 1.0) and r.step_s == 20 and r.sticky == "session"
    assert r.snapshot_dir == str(tmp_path / "snap")
    assert (r.gates.error_rate_max, r.gates.oom_max) == (0, 0)
    assert r.gates.advance_on == ()
    with pytest.raises(RuntimeError):
        canary_policy("backends: {}\n", "http://x", tmp_path, 1)


def test_spread_is_the_proxy_s_buckets_and_the_picked_run_id_covers_both_arms() -> None:
    run_id = pick_run_id(8)
    ids = [Load.session_id(run_id, "steady", i) for i in range(8)]
    assert spread(run_id, 8) == [sum(bucket(s) < x for s in ids) for x in (0.25, 0.5, 1.0)]
    assert spread_ok(spread(run_id, 8), 8) and spread(run_id, 8)[2] == 8
    assert spread_ok(spread(pick_run_id(SHORT.workers), SHORT.workers), SHORT.workers)
    assert not spread_ok([0, 4, 8], 8)  # nobody on the candidate at the first step
    assert not spread_ok([1, 7, 8], 8)  # one session left for the primary at the second
    with pytest.raises(RuntimeError):
        pick_run_id(2)  # two sessions cannot be two on each arm


def test_drill_9_is_registered_with_its_own_run_ids() -> None:
    spec = DRILLS["bad_canary"]
    assert spec.number == 9 and spec.run_id is not None
    assert spread_ok(spread(spec.run_id(LONG), LONG.workers), LONG.workers)
    assert sorted(s.number for s in DRILLS.values()) == list(range(1, 10))


# --------------------------------------------------------------------------- the bundle

RID = "20261201T000000Z-abc123"
VERDICT = {
    "rollout_id": RID,
    "gate": "oom",
    "detail": "1 OOM",
    "value": 1,
    "limit": 0,
    "step": 1,
    "share": 0.5,
    "gates": {"gates": [{"gate": "oom", "verdict": "fail"}]},
}
METRICS = 'brownout_rollout_rollbacks_total{gate="oom"} 1.0\n'
TIMELINE = "".join(
    json.dumps({"event": e}) + "\n" for e in ("started", "gates", "step", "gates", "rolled_back")
)


def _texts(**over: str | None) -> dict[str, str | None]:
    texts: dict[str, str | None] = {
        "verdict.json": json.dumps(VERDICT),
        "errors.jsonl": json.dumps({"arm": "candidate", "fault": "oom"}) + "\n",
        "metrics.prom": METRICS,
        "timeline.jsonl": TIMELINE,
    }
    texts.update(over)
    return texts


def test_a_whole_bundle_passes() -> None:
    b = judge_bundle("/b", _texts(), RID, "oom", 1)
    assert b.problems == []
    assert (b.errors_lines, b.errors_by_arm) == (1, {"candidate": 1})
    assert b.metrics_rollbacks == {"oom": 1.0}
    assert b.timeline_events == {"started": 1, "gates": 2, "step": 1, "rolled_back": 1}
    assert b.verdict["share"] == 0.5


def test_an_empty_errors_file_is_shown_not_failed() -> None:
    b = judge_bundle("/b", _texts(**{"errors.jsonl": ""}), RID, "oom", 1)
    assert b.problems == [] and b.errors_lines == 0


@pytest.mark.parametrize(
    ("over", "gate", "step", "problem"),
    [
        ({"metrics.prom": None}, "oom", 1, "bundle files missing: metrics.prom"),
        ({}, "health", 1, "verdict.json names gate 'oom', status 'health'"),
        ({}, "oom", 2, "verdict.json says step 1, not 2"),
        ({"verdict.json": "{"}, "oom", 1, "verdict.json is not JSON"),
        ({"errors.jsonl": "oops\n"}, "oom", 1, "errors.jsonl has a line that is not"),
        ({"metrics.prom": "# nothing\n"}, "oom", 1, "metrics.prom has no brownout_rollout"),
        ({"timeline.jsonl": json.dumps({"event": "started"})}, "oom", 1,
         "timeline.jsonl has no step, rolled_back event"),
    ],
)  # fmt: skip
def test_a_broken_bundle_is_a_problem(
    over: dict[str, str | None], gate: str, step: int, problem: str
) -> None:
    b = judge_bundle("/b", _texts(**over), RID, gate, step)
    assert any(p.startswith(problem) for p in b.problems), b.problems


def test_no_bundle_is_a_problem() -> None:
    assert judge_bundle(None, {}, RID, "oom", 1).problems == ["no bundle was written"]


# --------------------------------------------------------------------------- figures, verdict

RUN = "d9-abcdef"
T0 = 1000.0  # rollout started; step 2 at +20; the fault at +32; rolled back at +32.4


def _history(rolled_at: float | None = T0 + 32.4, step: int = 1) -> list[dict[str, Any]]:
    h: list[dict[str, Any]] = [
        {"at": T0, "change": "started", "step": 0, "share": 0.25},
        {"at": T0 + 20, "change": "step", "step": 1, "share": 0.5},
    ]
    if rolled_at is not None:
        h.append(
            {"at": rolled_at, "change": "rolled_back", "step": step, "share": 0.5,
             "detail": "breaker open", "gate": "health"}
        )  # fmt: skip
    return h


def _rollout(**over: Any) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "id": RID,
        "state": "rolled_back",
        "failed_gate": "health",
        "history": _history(),
    }
    snap.update(over)
    return snap


def _seen(rid: str, at: float, action: str = "passed", failed: float | None = None) -> Any:
    return {"at": at, "request_id": rid, "path": CHAT, "action": action, "failed_at": failed}


def _req(
    sid: int, n: int, at: float, backend: str, outcome: str = "complete", rescued: bool = False
) -> Req:
    r = Req("steady", f"{RUN}-steady-{sid}", n, at, at + 1, headers_at=at + 0.1, backend=backend)
    r.outcome = outcome  # type: ignore[assignment]
    r.rescued = rescued
    return r


FAULT = {
    "mode": "healthy",
    "seen": [
        _seen(f"{RUN}-steady-0-1", T0 + 5),
        _seen(f"{RUN}-steady-0-7", T0 + 31.5, "cut", T0 + 32.1),  # a stream under way
        _seen(f"{RUN}-steady-1-9", T0 + 32.2, "oom", T0 + 32.2),  # a new request
        _seen("probe-1", T0 + 33, "oom", T0 + 33),  # the proxy's own recovery probe
        _seen(f"{RUN}-steady-1-10", T0 + 32.6, "oom", T0 + 32.6),  # routed just before
    ],
}
RECORDS = [
    _req(0, 1, T0 + 5, "candidate"),
    _req(2, 1, T0 + 5, "primary"),
    _req(0, 7, T0 + 31.5, "candidate", rescued=True),
    _req(1, 9, T0 + 32.2, "primary"),
    _req(1, 10, T0 + 32.6, "primary"),
    _req(1, 11, T0 + 40, "primary"),
]
# The stream cut mid-answer began before the rollback; its first byte (and the
# header naming the candidate) came after it: it counts where it was sent.
RECORDS[2].headers_at = T0 + 33.0


def _summary(
    rollout: dict[str, Any] | None = None,
    fault: dict[str, Any] | None = None,
    records: list[Req] | None = None,
    degraded_at: float | None = T0 + 32.0,
) -> CanarySummary:
    return summarize(
        rollout or _rollout(),
        fault or FAULT,
        records or RECORDS,
        run_id=RUN,
        workers=8,
        degraded_at=degraded_at,
        polled_at=T0 + 32.5,
        bundle=judge_bundle("/b", _texts(), RID, "oom", 1),
    )


def test_the_figures_of_a_good_run() -> None:
    s = _summary()
    assert s.rollback_s == pytest.approx(0.4)
    assert s.polled_s == pytest.approx(0.5)
    assert s.first_failure_s == pytest.approx(0.1)
    assert s.detect_to_rollback_s == pytest.approx(0.3)
    assert (s.failed_gate, s.rolled_back_step, s.gate_detail) == ("health", 1, "breaker open")
    assert s.candidate_failed == {"cut": 1, "oom": 2}
    assert s.probes_failed == 1
    assert s.failed_outcomes == {
        "complete, rescued mid-stream (X-Brownout-Backend candidate)": 1,
        "complete from the primary": 2,
    }
    assert s.users_after_rollback == 0  # 0.2 s after the rollback: routed before it
    assert s.arms == {
        "step 1 (25%)": {"candidate": 1, "primary": 1},
        "step 2 (50%)": {"candidate": 1, "primary": 1},
        "after the rollback": {"primary": 2},
    }
    assert s.saw_error == 0
    assert canary_problems(s) == []


def test_what_a_user_would_notice_is_a_problem() -> None:
    records = [*RECORDS, _req(3, 1, T0 + 33, "primary", "error"), _req(4, 1, T0 + 34, "", "hung")]
    records[3] = _req(1, 9, T0 + 32.2, "primary", "truncated")
    late = {**FAULT, "seen": [*FAULT["seen"], _seen(f"{RUN}-steady-3-2", T0 + 40)]}
    problems = canary_problems(_summary(records=records, fault=late))
    assert "3 of the load's requests saw an error (goal 0)" in problems
    assert "requests the candidate failed that did not end complete: {'truncated': 1}" in problems
    assert "1 of the load's requests reached the candidate after the rollback" in problems


def test_a_slow_early_or_missing_rollback_is_a_problem() -> None:
    slow = _rollout(history=_history(T0 + 32 + 61))
    assert canary_problems(_summary(slow)) == ["the rollback took 61.0 s (limit 60 s)"]
    early = _rollout(history=_history(T0 + 10))
    assert canary_problems(_summary(early))[0].startswith(
        "a healthy candidate was rolled back before the fault"
    )
    last = _rollout(history=_history(step=2))
    assert "rolled back at step 2, not the second (index 1)" in canary_problems(_summary(last))
    none = _rollout(state="step", failed_gate=None, history=_history(None))
    assert canary_problems(_summary(none)) == ["the rollout was not rolled back (state step)"]
    never = canary_problems(_summary(none, degraded_at=None))
    assert never[0] == (
        "the candidate was never degraded: the rollout reached step 2 of 3, state step"
    )


def test_a_bundle_problem_is_the_drill_s() -> None:
    s = _summary()
    assert s.bundle is not None
    broken = dataclasses.replace(s.bundle, problems=["no bundle was written"])
    assert canary_problems(dataclasses.replace(s, bundle=broken)) == ["no bundle was written"]


def test_the_report_shows_the_figures() -> None:
    text = canary_section(_summary(), 6)
    assert "**Rollback: 0.4 s after the fault** (goal ≤ 60 s), by gate `health` at step 2" in text
    assert "showed `rolled_back` 0.5 s after the fault" in text
    assert "**Requests that saw an error: 0** of 6" in text
    assert "The candidate failed 3 of the load's requests (cut 1, oom 2" in text
    assert "complete from the primary 2" in text
    assert "| step 2 (50%) | 1 | 1 |" in text
    assert "`errors.jsonl`: 1 lines (candidate 1 by arm)" in text
    assert "`brownout_rollout_rollbacks_total` {gate=oom} 1" in text
    b = judge_bundle("/b", _texts(**{"errors.jsonl": ""}), RID, "oom", 1)
    text = canary_section(dataclasses.replace(_summary(), bundle=b), 6)
    assert "`errors.jsonl`: 0 lines (none by arm) — empty" in text
    text = canary_section(dataclasses.replace(_summary(), policy_added="rollout:\n  x: 1\n"), 6)
    assert text.endswith("```yaml\nrollout:\n  x: 1\n```\n")
