"""Issue 21: a gray release of `backends.candidate`, on real sockets with
scripted fakes (latency and faults per arm), the real evaluation loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.app import create_app
from proxy.control.rollout import bucket
from proxy.policy import Policy, parse_policy
from proxy.policy.recorder import RecorderPolicy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, chunk, free_port
from tests.integration.test_pipeline import CHAT, metrics, total, wait_until
from tests.integration.test_retry_flow import text_of

SSE = {"Content-Type": "text/event-stream"}
DONE = b"data: [DONE]\n\n"
TOKEN = "rollout-admin"


def streaming(who: str, delay_s: float) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        await asyncio.sleep(delay_s)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": f"from {who}"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("from ") + chunk(who) + chunk("", "stop") + DONE)
        return resp

    return handler


def rollout_policy(
    primary: str,
    candidate: str,
    snapshot_dir: Path,
    fallback: str | None = None,
    *,
    breaker: dict[str, Any] | None = None,
    **over: Any,
) -> Policy:
    backend = {
        "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1},
        "health": {"interval_s": 0.2, "timeout_s": 0.5},
    }
    doc: dict[str, Any] = {
        "server": {"heartbeat_s": 0, "admin_token": TOKEN},
        "backends": {
            "primary": {"url": primary, **backend},
            "candidate": {"url": candidate, **backend},
        },
        "ladder": {
            "maintenance": {"enabled": False},
            "recovery": {"window_s": 0.05},
            "failover": {"retry_max": 0},
            **({"breaker": breaker} if breaker else {}),
        },
        "rollout": {
            "steps": [0.25, 0.5, 1.0],
            "step_s": 0.4,
            "sticky": "session",
            "snapshot_dir": str(snapshot_dir),
            # A p99 needs ~437 requests per arm to pass: advance on TTFT here.
            "gates": {"min_samples": 5, "window_s": 60, "advance_on": ["ttft_ratio"]},
            **over,
        },
    }
    if fallback is not None:
        doc["backends"]["fallback"] = {"url": fallback, "kind": "transformers", **backend}
    return parse_policy(yaml.safe_dump(doc), "rollout-test.yaml")


async def ask(proxy: Any, sid: str, stream: bool = True) -> tuple[int, str, str]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with proxy.session.post(proxy.url + CHAT, json=body, headers={"X-Session-Id": sid}) as r:
        raw = await r.read()
        return r.status, r.headers["X-Brownout-Backend"], raw.decode()


async def act(proxy: Any, action: str) -> tuple[int, dict[str, Any]]:
    async with proxy.session.post(
        proxy.url + "/brownout/rollout",
        json={"action": action},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as r:
        return r.status, await r.json()


async def state(proxy: Any) -> dict[str, Any]:
    async with proxy.session.get(
        proxy.url + "/brownout/rollout", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


@pytest.fixture
async def candidate_upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port).start()
    yield fake
    await runner.cleanup()


async def test_a_faster_healthy_candidate_is_promoted_step_by_step_sticky_per_session(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.03)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    proxy = await start_proxy(rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path))
    sids = [f"user-{i}" for i in range(40)]
    status, body = await act(proxy, "start")
    assert status == 200 and body["state"] == "step" and body["share"] == 0.25
    seen: dict[float, dict[str, str]] = {}
    t0 = time.monotonic()
    while (await state(proxy))["state"] != "complete":
        assert time.monotonic() - t0 < 20, await state(proxy)
        share = (await state(proxy))["share"]
        for sid in sids:
            st, arm, raw = await ask(proxy, sid)
            assert st == 200 and text_of(raw.encode()) == f"from {arm}"
            now = (await state(proxy))["share"]
            if now == share:  # not moved on while asking: the step's routing
                seen.setdefault(share, {})[sid] = arm
    for share, arms in seen.items():
        for sid, arm in arms.items():
            # The arm is the session's bucket against the step's share, exactly.
            want = "candidate" if bucket(sid) < share else "primary"
            assert arm == want, (share, sid, arm)
    # Sticky across steps: on the candidate at 25 %, still there at 50 %.
    if 0.25 in seen and 0.5 in seen:
        for sid, arm in seen[0.25].items():
            if arm == "candidate" and sid in seen[0.5]:
                assert seen[0.5][sid] == "candidate"
    st, arm, _ = await ask(proxy, "anyone")
    assert (st, arm) == (200, "candidate")
    m = await metrics(proxy)
    assert total(m, "brownout_rollout_state") == 4  # complete
    assert total(m, "brownout_rollout_share") == 1.0


async def test_the_measured_share_of_a_step_is_its_share(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    """400 sessions at a 25 % step (held long): the candidate's share is 0.25
    within 3 binomial standard deviations (±0.065)."""
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    pol = rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path, step_s=3600)
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    arms = [(await ask(proxy, f"s-{i}", stream=False))[1] for i in range(400)]
    share = arms.count("candidate") / len(arms)
    assert abs(share - 0.25) <= 0.065, share


async def test_an_oom_on_the_candidate_rolls_back_at_once_and_no_client_sees_it(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)

    async def oom(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB", "code": 500}},
            status=500,
        )

    candidate_upstream.handlers[CHAT] = oom
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, steps=[1.0], step_s=3600
    )
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    st, arm, raw = await ask(proxy, "u1")
    assert (st, arm) == (200, "primary"), raw  # the candidate's 500, retried on the primary
    t_fail = time.monotonic()
    snap = await state(proxy)
    assert snap["state"] == "rolled_back" and snap["failed_gate"] == "oom"
    detect_to_rollback = time.monotonic() - t_fail
    assert detect_to_rollback < 1.0
    # Everything new goes to the primary.
    for i in range(5):
        assert (await ask(proxy, f"u{i}"))[1] == "primary"

    def bundles() -> list[Path]:  # not the temporary directory it is written in
        return [p.parent for p in tmp_path.glob("*/verdict.json") if p.parent.name[0] != "."]

    await wait_until(lambda: bool(bundles()))
    (bundle,) = bundles()
    assert sorted(p.name for p in bundle.iterdir()) == [
        "errors.jsonl",
        "metrics.prom",
        "timeline.jsonl",
        "verdict.json",
    ]
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["gate"] == "oom" and verdict["rollout_id"] == snap["id"]
    errors = [json.loads(x) for x in (bundle / "errors.jsonl").read_text().splitlines()]
    # One record per failure: the attempt's, completed by the request's end.
    (oom,) = [e for e in errors if e["arm"] == "candidate"]
    assert (oom["fault"], oom["status"], oom["counted"]) == ("oom", 500, True)
    assert (oom["answered_by"], oom["client_status"]) == ("primary", 200)
    assert "CUDA out of memory" in oom["detail"]
    assert "brownout_rollout_rollbacks_total" in (bundle / "metrics.prom").read_text()
    timeline = [json.loads(x) for x in (bundle / "timeline.jsonl").read_text().splitlines()]
    assert [t["event"] for t in timeline if t["event"] != "gates"][:1] == ["started"]
    m = await metrics(proxy)
    assert total(m, "brownout_rollout_rollbacks_total", gate="oom") == 1
    assert (await state(proxy))["bundles"] == [str(bundle)]


def bundles_in(root: Path) -> list[Path]:
    """The rollback bundles written (not the temporary directory of one)."""
    return [p.parent for p in root.glob("*/verdict.json") if p.parent.name[0] != "."]


@pytest.mark.parametrize("gate", ["health", "breaker"])
async def test_a_health_gate_rollback_bundles_the_failures_still_being_answered(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
    gate: str,
) -> None:
    """The race a real-stack drill lost: requests fail on the candidate, which
    then goes bad (/health 503, or its breaker opens) and the health gate rolls
    back while the primary is still answering them. The bundle's errors.jsonl
    holds those failures (it was empty: they were logged at the requests' end,
    after the rollback), and the reason names the cause once."""
    release = asyncio.Event()
    ok = streaming("primary", 0.0)

    async def held_primary(request: web.Request) -> web.StreamResponse:
        await release.wait()  # answered only once the rollback happened
        return await ok(request)

    sick = False

    async def failing(request: web.Request) -> web.StreamResponse:
        nonlocal sick
        await request.read()
        sick = True
        return web.json_response({"error": {"message": "kernel panic in sampler"}}, status=500)

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503 if sick and gate == "health" else 200)

    fake_upstream.handlers[CHAT] = held_primary
    candidate_upstream.handlers[CHAT] = failing
    candidate_upstream.handlers["/health"] = health
    pol = rollout_policy(
        fake_upstream.url,
        candidate_upstream.url,
        tmp_path,
        steps=[1.0],
        step_s=3600,
        # Not the error gate (it judges a request at its end): the health gate.
        gates={"min_samples": 5, "window_s": 60, "error_rate_max": 1.0},
        # health: 3 failures keep the breaker closed; breaker: the first opens
        # it (the corroborating probe fails too).
        breaker={"fail_max": 5 if gate == "health" else 1},
    )
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    tasks = [
        asyncio.create_task(
            proxy.session.post(
                proxy.url + CHAT,
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers={"X-Session-Id": f"s-{i}"},
            )
        )
        for i in range(3)
    ]
    t0 = time.monotonic()
    while (snap := await state(proxy))["state"] != "rolled_back":
        assert time.monotonic() - t0 < 10, snap
        await asyncio.sleep(0.02)
    assert snap["failed_gate"] == "health"
    if gate == "health":
        assert snap["reason"] == "candidate unhealthy: health returned HTTP 503"
    else:
        assert snap["reason"].startswith("candidate unhealthy: breaker open: ")
        assert "unhealthy" not in snap["reason"][len("candidate unhealthy: ") :]
    release.set()
    rids = []
    for t in tasks:
        async with await t as r:
            assert (r.status, r.headers["X-Brownout-Backend"]) == (200, "primary")
            rids.append(r.headers["X-Request-Id"])
            await r.read()
    await wait_until(lambda: bool(bundles_in(tmp_path)))
    (bundle,) = bundles_in(tmp_path)
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["gate"] == "health" and verdict["detail"] == snap["reason"]
    errors = [json.loads(x) for x in (bundle / "errors.jsonl").read_text().splitlines()]
    cand = [e for e in errors if e["arm"] == "candidate"]
    assert sorted(e["request_id"] for e in cand) == sorted(rids), errors
    for e in cand:
        assert (e["status"], e["fault"], e["attribution"]) == (500, "http_500", "backend")
        assert "kernel panic in sampler" in e["detail"], e  # what the candidate said
        # Still being answered at the rollback: how it ended is not known yet.
        assert e["answered_by"] is None and e["counted"] is None


async def test_a_request_that_fails_everywhere_does_not_roll_a_good_candidate_back(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    """A hostile client's poison request fails on the candidate and on the
    primary: the request's problem, not the candidate's."""

    def poisoned(who: str) -> Any:
        ok = streaming(who, 0.0)

        async def handler(request: web.Request) -> web.StreamResponse:
            body = json.loads(await request.read())
            if body.get("top_p") == 1e-300:
                return web.json_response({"error": {"message": "inf/nan"}}, status=500)
            return await ok(request)

        return handler

    fake_upstream.handlers[CHAT] = poisoned("primary")
    candidate_upstream.handlers[CHAT] = poisoned("candidate")
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, steps=[1.0], step_s=3600
    )
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1e-300}
    for _ in range(5):
        async with proxy.session.post(proxy.url + CHAT, json=body) as r:
            assert r.status >= 500
            await r.read()
    await asyncio.sleep(0.2)  # a few evaluation windows
    assert (await state(proxy))["state"] == "step"


async def test_a_candidate_that_cuts_streams_rolls_back_and_the_stream_is_rescued(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    fallback_upstream.handlers[CHAT] = streaming("fallback", 0.0)

    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("from "))
        await asyncio.sleep(0.02)
        assert request.transport is not None
        request.transport.abort()
        return resp

    candidate_upstream.handlers[CHAT] = cut
    pol = rollout_policy(
        fake_upstream.url,
        candidate_upstream.url,
        tmp_path,
        fallback_upstream.url,
        steps=[1.0],
        step_s=3600,
    )
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    st, arm, raw = await ask(proxy, "u1")
    assert (st, arm) == (200, "candidate")
    assert "[DONE]" in raw and '"error"' not in raw  # rescued on the fallback
    snap = await state(proxy)
    assert snap["state"] == "rolled_back" and snap["failed_gate"] == "error_rate"


async def test_the_step_survives_a_restart(
    fake_upstream: FakeUpstream, candidate_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    pol = rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path, step_s=3600)

    async def run(action: str | None) -> dict[str, Any]:
        port = free_port()
        app = create_app(pol)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as s:
                h = {"Authorization": f"Bearer {TOKEN}"}
                url = f"http://127.0.0.1:{port}/brownout/rollout"
                if action:
                    async with s.post(url, json={"action": action}, headers=h) as r:
                        assert r.status == 200
                await wait_until(lambda: (tmp_path / "state.json").exists())
                app[STATE].current.canary.rollout.step = 1  # type: ignore[union-attr]
                app[STATE].current.canary.save()  # type: ignore[union-attr]
                await asyncio.sleep(0.1)
                async with s.get(url, headers=h) as r:
                    data: dict[str, Any] = await r.json()
                    return data
        finally:
            await runner.cleanup()

    first = await run("start")
    assert first["state"] == "step"
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["state"] == "step" and saved["step"] == 1
    again = await run(None)
    assert (again["state"], again["step"], again["id"]) == ("step", 1, first["id"])


async def test_admin_actions_and_their_errors(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    proxy = await start_proxy(rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path))
    async with proxy.session.get(proxy.url + "/brownout/rollout") as r:
        assert r.status == 401  # the admin token
    assert (await act(proxy, "pause"))[0] == 409
    status, body = await act(proxy, "launch")
    assert status == 400 and body["error"]["param"] == "action"
    assert (await act(proxy, "start"))[1]["state"] == "step"
    assert (await act(proxy, "start"))[0] == 409
    assert (await act(proxy, "pause"))[1]["state"] == "paused"
    assert (await act(proxy, "resume"))[1]["state"] == "step"
    assert (await act(proxy, "promote"))[1]["state"] == "complete"
    assert (await act(proxy, "abort"))[1]["state"] == "aborted"
    assert (await ask(proxy, "u"))[1] == "primary"


async def test_the_mirror_step_copies_requests_no_user_sees_the_candidate(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.03)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, mirror=1.0, mirror_s=0.3
    )
    proxy = await start_proxy(pol)
    status, body = await act(proxy, "start")
    assert (status, body["state"]) == (200, "mirror")
    t0 = time.monotonic()
    while (await state(proxy))["state"] == "mirror":
        assert time.monotonic() - t0 < 10, await state(proxy)
        st, arm, raw = await ask(proxy, f"m-{time.monotonic()}")
        assert (st, arm) == (200, "primary") and text_of(raw.encode()) == "from primary"
    copies = [p for p, _, _ in candidate_upstream.requests if p == CHAT]
    assert len(copies) >= 5  # min_samples of mirrored answers judged the step
    assert (await state(proxy))["state"] == "step"


async def test_replicas_sharing_state_follow_one_rollout_and_its_rollback(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    """With ladder.shared, a start on replica A puts B on the same step, and
    A's rollback (an OOM it saw) rolls B back too."""
    from tests.sessions.conftest import PrivateRedis

    (tmp_path / "redis").mkdir()
    redis = PrivateRedis(tmp_path / "redis")
    redis.start()
    try:
        fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
        candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)

        def pol(name: str) -> Policy:
            p = rollout_policy(
                fake_upstream.url, candidate_upstream.url, tmp_path / name, step_s=3600
            )
            from dataclasses import replace

            shared = replace(p.ladder.shared, redis=redis.url, interval_s=0.05, timeout_s=0.5)
            return replace(p, ladder=replace(p.ladder, shared=shared))

        a = await start_proxy(pol("a"))
        b = await start_proxy(pol("b"))
        assert (await act(a, "start"))[1]["state"] == "step"
        await wait_until_async(lambda: state(b), lambda s: s["state"] == "step")
        assert (await state(b))["id"] == (await state(a))["id"]

        async def oom(request: web.Request) -> web.StreamResponse:
            return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)

        candidate_upstream.handlers[CHAT] = oom
        for i in range(40):  # until one of A's requests lands on the candidate
            await ask(a, f"s{i}")
            if (await state(a))["state"] == "rolled_back":
                break
        assert (await state(a))["state"] == "rolled_back"
        await wait_until_async(lambda: state(b), lambda s: s["state"] == "rolled_back")
        assert (await ask(b, "s0"))[1] == "primary"
    finally:
        redis.stop()


async def wait_until_async(get: Any, pred: Any, limit_s: float = 3.0) -> None:
    t0 = time.monotonic()
    while True:
        value = await get()
        if pred(value):
            return
        assert time.monotonic() - t0 < limit_s, value
        await asyncio.sleep(0.02)


async def test_a_candidate_that_fails_the_eval_set_rolls_back(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    """The eval set runs against both arms at the start; the candidate passes
    none of the checks the primary passes: the quality gate rolls back."""
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    evalset = tmp_path / "eval.yaml"
    evalset.write_text(
        "questions:\n"
        "  - prompt: Who are you?\n"
        "    checks: [{contains: primary}, {regex: '^from'}]\n"
        "  - prompt: Again?\n"
        "    checks: [{equals: from primary}]\n"
    )
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, eval=str(evalset), step_s=3600
    )
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    await wait_until_async(lambda: state(proxy), lambda s: s["state"] == "rolled_back")
    snap = await state(proxy)
    assert snap["failed_gate"] == "quality"
    assert snap["eval"]["primary"]["score"] == 1.0
    assert snap["eval"]["candidate"]["score"] == 1 / 3
    asked = [json.loads(b) for p, _, b in candidate_upstream.requests if p == CHAT]
    assert [a["messages"][0]["content"] for a in asked] == ["Who are you?", "Again?"]


async def test_a_candidate_with_a_worse_p99_rolls_back(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    """A p99 interval needs ~437 samples per arm: under load the candidate's
    slower tail (every answer 40 ms vs ~0) is judged confidently worse and
    rolled back; the time from enough samples to the rollback is one window."""
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.04)
    pol = rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path, step_s=3600)
    proxy = await start_proxy(pol)
    await act(proxy, "start")
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with sem:
            await ask(proxy, f"p-{i}", stream=False)

    t0 = time.monotonic()
    i = 0
    while (await state(proxy))["state"] == "step":
        assert time.monotonic() - t0 < 60, await state(proxy)
        await asyncio.gather(*(one(i + k) for k in range(200)))
        i += 200
    snap = await state(proxy)
    assert snap["state"] == "rolled_back"
    assert snap["failed_gate"] == "p99_ratio", snap


async def test_a_rollback_bundle_carries_the_flight_recordings_last_minutes(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)

    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "CUDA out of memory"}}, status=500)

    candidate_upstream.handlers[CHAT] = broken
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path / "b", steps=[1.0], step_s=3600
    )
    rec_dir = tmp_path / "rec"
    pol = dataclasses.replace(pol, recorder=RecorderPolicy(enabled=True, dir=str(rec_dir)))
    proxy = await start_proxy(pol)
    for i in range(3):  # before the rollout: on the recording
        assert (await ask(proxy, f"before-{i}"))[1] == "primary"
    await act(proxy, "start")
    assert (await ask(proxy, "u1"))[1] == "primary"
    assert (await state(proxy))["state"] == "rolled_back"
    await wait_until(lambda: bool(list((tmp_path / "b").glob("*/recording.jsonl"))), 10)
    (path,) = list((tmp_path / "b").glob("*/recording.jsonl"))
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    reqs = [r for r in recs if r["k"] == "req"]
    assert len(reqs) >= 3 and recs[0]["k"] in ("seg", "policy")
    # The request the candidate failed: its attempts, in the order they ran.
    assert any([a[0] for a in r["att"]] == ["candidate", "primary"] for r in reqs)
