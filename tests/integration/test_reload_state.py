"""Reload is transactional and keeps what it does not change (issue 13, defect 7).

- a policy that validates but cannot be applied (a tokenizer path that does
  not load) is rejected with an OpenAI-style error object, counted, shown in
  status, and leaks nothing: no HTTP session, no probe task per attempt;
- a reload that changes only other `sessions.*` knobs keeps the store and its
  memory:// sessions; one that replaces the store hands the waiting saves over;
- the background loops follow the policy (shared-state sync, file watch) and
  a loop that raises is counted and runs again;
- a reload from SIGHUP that raises is logged and counted, not lost.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import structlog
from aiohttp import web

from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from proxy.server import _reload_on_sighup
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy
from tests.integration.test_sessions_flow import (
    SYSTEM,
    ChatFake,
    PrivateRedis,
    ask,
    assistant,
    completion,
    metric,
    new_sid,
    user,
)
from tests.integration.test_sessions_flow import key_prefix as key_prefix
from tests.integration.test_sessions_flow import private_redis as private_redis

ADMIN = {"Authorization": "Bearer s3cret"}


def write(path: Path, upstream: str, primary: str = "", rest: str = "", server: str = "") -> None:
    path.write_text(
        f"""server:
  admin_token: s3cret
  heartbeat_s: 0.3
{server}backends:
  primary:
    url: {upstream}
    timeouts: {{connect_s: 1, first_byte_s: 2, idle_s: 1}}
    health: {{interval_s: 0.1, timeout_s: 0.5}}
{primary}ladder:
  maintenance:
    enabled: false
{rest}"""
    )


async def reload(p: RunningProxy) -> tuple[int, dict[str, Any]]:
    async with p.session.post(p.url + "/brownout/reload", headers=ADMIN) as resp:
        body: dict[str, Any] = await resp.json()
        return resp.status, body


async def status(p: RunningProxy) -> dict[str, Any]:
    async with p.session.get(p.url + "/brownout/status") as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def wait_for(check: Callable[[], Awaitable[bool]], what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def open_client_sessions() -> int:
    gc.collect()
    # type(), not isinstance(): some objects (torch) warn on attribute lookups.
    return sum(1 for o in gc.get_objects() if type(o) is aiohttp.ClientSession and not o.closed)


def probe_tasks() -> list[str]:
    return sorted(
        t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("health_probe_")
    )


async def test_a_policy_that_cannot_be_applied_is_rejected_and_leaks_nothing(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    ChatFake(fake_upstream)
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    running = proxy.app[STATE].current
    sessions_before, probes_before = open_client_sessions(), probe_tasks()
    assert probes_before == ["health_probe_primary"]

    missing = tmp_path / "no-such-tokenizer"
    write(path, fake_upstream.url, primary=f"    tokenizer: {missing}\n")
    load_policy(path)  # valid: `brownout check` says ok
    for attempt in range(1, 4):
        code, body = await reload(proxy)
        assert code == 422
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "policy_not_applied"
        assert str(missing) in err["message"]
        assert body["ok"] is False
        assert await metric(proxy, "brownout_policy_reload_failures_total") == attempt
    assert await metric(proxy, "brownout_policy_reloads_total") == 0
    st = await status(proxy)
    assert st["policy"]["last_reload"]["ok"] is False
    assert str(missing) in st["policy"]["last_reload"]["errors"][0]
    assert st["policy"]["generations_live"] == 1
    # Nothing leaked, nothing changed: the running generation still serves.
    assert open_client_sessions() == sessions_before
    assert probe_tasks() == probes_before
    assert proxy.app[STATE].current is running
    r = await ask(proxy, "still here?", sid=None)
    assert r.status == 200 and r.headers["X-Brownout-Backend"] == "primary"


async def test_other_session_knobs_keep_the_memory_store_and_its_sessions(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    chat = ChatFake(fake_upstream)
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url, rest="sessions:\n  trimming: {margin_tokens: 64}\n")
    proxy = await start_proxy(load_policy(path))
    sid = new_sid()
    assert (await ask(proxy, "remember me", sid=sid)).session == "used"
    store = proxy.app[STATE].current.store

    write(
        path,
        fake_upstream.url,
        rest="sessions:\n  ttl_s: 600\n  max_turns: 5\n  trimming: {margin_tokens: 32}\n",
    )
    code, body = await reload(proxy)
    assert code == 200, body
    assert any(c.startswith("~ sessions.trimming.margin_tokens:") for c in body["changes"])
    r = await ask(proxy, "who am I?", sid=sid)
    assert r.session == "used"
    first = [user("remember me"), assistant(chat.answered["remember me"])]
    assert chat.messages() == [SYSTEM, *first, user("who am I?")]
    assert proxy.app[STATE].current.store is store


@pytest.mark.real
async def test_a_new_store_takes_over_the_turns_that_wait_for_redis(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    private_redis: PrivateRedis,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    chat = ChatFake(fake_upstream)
    path = tmp_path / "policy.yaml"

    def sessions(timeout: float) -> str:
        return (
            f"sessions:\n  store: {private_redis.url}\n  key_prefix: '{key_prefix}'\n"
            f"  redis_timeout_s: {timeout}\n"
        )

    write(path, fake_upstream.url, rest=sessions(0.3))
    proxy = await start_proxy(load_policy(path))
    sid = new_sid()

    async def redis_dies_then_answers(request: web.Request) -> web.StreamResponse:
        await asyncio.to_thread(private_redis.stop)
        return web.json_response(completion("kept for later"))

    chat.script.append(redis_dies_then_answers)
    r = await ask(proxy, "during the outage", sid=sid, stream=False)
    assert r.status == 200 and r.session == "used"
    assert await metric(proxy, "brownout_session_saves_waiting") == 1

    # The store's own settings change: a new store, the waiting turn moves with it.
    old_store = proxy.app[STATE].current.store
    write(path, fake_upstream.url, rest=sessions(0.4))
    code, body = await reload(proxy)
    assert code == 200, body
    assert proxy.app[STATE].current.store is not old_store
    assert await metric(proxy, "brownout_session_saves_waiting") == 1
    await asyncio.to_thread(private_redis.start)

    async def drained() -> bool:
        return await metric(proxy, "brownout_session_saves_waiting") == 0

    await wait_for(drained, "the waiting turn to be written", within=10)
    client = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        raw = await client.hget(f"{key_prefix}session:anon:{sid}", "history")
    finally:
        await client.aclose()
    assert raw is not None
    assert '"kept for later"' in raw
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "late"}) == 1


@pytest.mark.real
async def test_loops_follow_the_policy_and_a_failing_loop_runs_again(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    private_redis: PrivateRedis,
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    base = ["evaluate", "flush_saves", "scrape"]
    assert (await status(proxy))["loops"]["running"] == base

    shared = f"  shared: {{redis: '{private_redis.url}', interval_s: 0.05}}\n"
    watch = "  watch_policy: true\n  watch_interval_s: 0.05\n"
    write(path, fake_upstream.url, rest=shared, server=watch)
    assert (await reload(proxy))[0] == 200
    assert (await status(proxy))["loops"]["running"] == sorted(
        [*base, "shared_sync", "watch_policy"]
    )
    write(path, fake_upstream.url)
    assert (await reload(proxy))[0] == 200
    assert (await status(proxy))["loops"]["running"] == base

    # A window that raises: logged, counted, and the window comes again.
    rt = proxy.app[STATE].current
    evaluate, calls = rt.evaluate, []

    def flaky(window: bool = False) -> Any:
        calls.append(window)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return evaluate(window)

    rt.evaluate = flaky  # type: ignore[method-assign]

    async def ran_again() -> bool:
        return calls.count(True) >= 2

    await wait_for(ran_again, "the evaluation after the failure")
    assert await metric(proxy, "brownout_loop_errors_total", {"loop": "evaluate"}) == 1
    assert (await status(proxy))["loops"]["errors"]["evaluate"]["last"] == "RuntimeError: injected"


async def test_a_sighup_reload_that_raises_is_logged_and_counted(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    state = proxy.app[STATE]

    async def broken(reason: str) -> dict[str, Any]:
        raise RuntimeError(f"reload bug ({reason})")

    state._reload = broken  # type: ignore[method-assign]
    await _reload_on_sighup(proxy.app)
    loop = asyncio.get_running_loop()
    try:
        with structlog.testing.capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGHUP)

            async def counted() -> bool:
                labels = {"loop": "reload_sighup"}
                return await metric(proxy, "brownout_loop_errors_total", labels) == 1

            await wait_for(counted, "the failed SIGHUP reload to be counted")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
    failed = [e for e in logs if e["event"] == "loop_failed"]
    assert failed and failed[0]["error"] == "RuntimeError: reload bug (sighup)"


async def test_a_rebuilt_backend_keeps_what_its_breaker_learnt(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    old = proxy.app[STATE].current.upstreams["primary"]
    old.breaker.force_open("test: the primary failed")
    assert (await status(proxy))["backends"]["primary"]["breaker"] == "open"

    # Another pool size needs a new connection pool, not a new opinion of the server.
    write(path, fake_upstream.url, primary="    pool: {max_connections: 8}\n")
    code, body = await reload(proxy)
    assert code == 200, body
    assert proxy.app[STATE].current.upstreams["primary"] is not old
    st = await status(proxy)
    assert st["backends"]["primary"]["breaker"] == "open"
    assert st["backends"]["primary"]["breaker_detail"] == old.breaker.snapshot()
