"""A hung recovery probe does not hold the ladder's window (issue 13).

The primary's breaker is open and its recovery trial hangs (the completion
never answers, `first_byte_s` is 30 s). Meanwhile the fallback dies: the
next window must move the ladder to maintenance, not the end of the trial.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port


def ladder_policy(primary: str, fallback: str) -> Policy:
    backend = (
        "    timeouts: {connect_s: 1, first_byte_s: 30, idle_s: 1}\n"
        "    health: {interval_s: 0.05, timeout_s: 0.5}\n"
    )
    return parse_policy(
        f"""server:
  heartbeat_s: 0.3
backends:
  primary:
    url: {primary}
{backend}  fallback:
    url: {fallback}
    kind: transformers
{backend}ladder:
  recovery: {{window_s: 0.05}}
  breaker: {{reset_timeout_s: 0.05}}
""",
        "probe-test.yaml",
    )


async def test_the_window_goes_on_while_a_recovery_trial_hangs(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    trial_started = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        trial_started.set()
        await asyncio.Event().wait()  # a primary that never answers
        raise AssertionError("unreachable")

    fake_upstream.handlers["/v1/completions"] = hang
    fallback = FakeUpstream(free_port())
    fallback_health = {"status": 200}

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(status=fallback_health["status"])

    fallback.handlers["/health"] = health
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fallback.dispatch)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fallback.port).start()
    try:
        proxy = await start_proxy(ladder_policy(fake_upstream.url, fallback.url))
        rt = proxy.app[STATE].current
        rt.upstreams["primary"].breaker.force_open("test: primary failing")
        await asyncio.wait_for(trial_started.wait(), 5)
        assert rt.tier == "failover"

        fallback_health["status"] = 503  # the fallback's engine died
        t0 = time.monotonic()
        while rt.tier != "maintenance":
            assert time.monotonic() - t0 < 3, "the ladder waited for the hung trial"
            await asyncio.sleep(0.02)
        assert rt.upstreams["primary"].breaker.state == "half-open"  # still on trial
    finally:
        await runner.cleanup()
