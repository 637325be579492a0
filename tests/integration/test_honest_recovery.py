"""Honest recovery from a double outage, with the default policy (issue 20).

Both backends go down under load (their breakers open, the tier goes to
maintenance); then the primary comes back while the fallback stays down. On
8c097b4 the primary's recovery ramp sent the share it did not take (95 %,
80 %, 50 %) to maintenance, for ~45 s, under `X-Brownout-Tier: throttle`
and then `normal`. Now every answer after the primary's recovery is the
primary's or a maintenance answer that says `X-Brownout-Tier: maintenance`,
and from 30 s after it every answer is the primary's.

The real app runs on an injected clock in front of the simulation's scripted
fakes, with `policies/default.yaml` as shipped except for where the backends
are and who probes their health: the test does (every `health.interval_s` of
the fake clock, as the app's loop would), and it runs the evaluation windows
(`Evaluator.tick`, recovery probes awaited) on that clock, so breaker reset
timeouts, dwell, healthy windows and ramp steps take their default lengths
without the test sleeping through them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
import yaml
from aiohttp import web

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from proxy.runtime.loops import Evaluator, wanted_loops
from proxy.runtime.state import ProxyState
from tests.integration.conftest import free_port
from tests.integration.sim_backends import ScriptedBackend

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
GOAL_S = 30.0  # every answer from the primary this long after it recovered
PER_WINDOW = 10  # requests per evaluation window


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def default_policy(primary: str, fallback: str) -> Policy:
    doc: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY.read_text())
    for name, url in (("primary", primary), ("fallback", fallback)):
        doc["backends"][name]["url"] = url
        # The app's own loop probes once at start; the test probes on its clock.
        doc["backends"][name]["health"]["interval_s"] = 3600
    doc["faq"]["file"] = None
    doc["ladder"]["throttle"]["scrape_interval_s"] = 0  # real time: off
    return parse_policy(yaml.safe_dump(doc), str(DEFAULT_POLICY), env={})


@dataclass
class Answer:
    rid: str
    at: float  # fake clock
    status: int
    backend: str
    tier: str
    text: str


@dataclass
class World:
    clock: Clock
    state: ProxyState
    evaluator: Evaluator
    client: aiohttp.ClientSession
    url: str
    primary: ScriptedBackend
    fallback: ScriptedBackend
    policy: Policy
    probe_every: float  # the shipped `health.interval_s`
    next_probe: float = 0.0
    asked: int = 0

    async def window(self) -> None:
        """One evaluation window on the fake clock, as the app's loops do it."""
        rt = self.state.current
        if self.clock.t >= self.next_probe:
            for up in rt.upstreams.values():
                await up.probe()
            self.next_probe = self.clock.t + self.probe_every
        self.clock.t += self.policy.ladder.recovery.window_s
        self.evaluator.tick()
        loop = asyncio.get_running_loop()
        limit = loop.time() + 5.0
        while self.evaluator.probing():
            assert loop.time() < limit, f"recovery probes hang: {self.evaluator.probing()}"
            await asyncio.sleep(0.002)
        await asyncio.sleep(0)  # the breakers' evaluate_soon

    async def ask(self, n: int) -> list[Answer]:
        out = []
        for _ in range(n):
            self.asked += 1
            rid = f"honest-{self.asked}"
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{self.asked}"}]}
            async with self.client.post(
                self.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                raw = await resp.read()
                h = resp.headers
                text = json.loads(raw)["choices"][0]["message"]["content"] if resp.ok else ""
                out.append(
                    Answer(
                        rid,
                        self.clock.t,
                        resp.status,
                        h["X-Brownout-Backend"],
                        h["X-Brownout-Tier"],
                        text,
                    )
                )
        return out

    async def run(self, seconds: float) -> list[Answer]:
        """Windows with load for `seconds` of the fake clock."""
        answers: list[Answer] = []
        end = self.clock.t + seconds
        while self.clock.t < end:
            await self.window()
            answers += await self.ask(PER_WINDOW)
        return answers


@pytest.fixture
async def world() -> AsyncIterator[World]:
    primary = await ScriptedBackend.start("primary")
    fallback = await ScriptedBackend.start("fallback")
    clock = Clock()
    policy = default_policy(primary.url, fallback.url)
    app = create_app(policy, clock=clock)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state = app[STATE]
    state.run_loops(lambda s: {k: v for k, v in wanted_loops(s).items() if k != "evaluate"})
    client = aiohttp.ClientSession()
    w = World(
        clock,
        state,
        Evaluator(state),
        client,
        f"http://127.0.0.1:{port}",
        primary,
        fallback,
        policy,
        yaml.safe_load(DEFAULT_POLICY.read_text())["backends"]["primary"]["health"]["interval_s"],
    )
    try:
        yield w
    finally:
        await client.close()
        await runner.cleanup()
        for b in (primary, fallback):
            await b.fake.stop()


async def test_primary_back_with_the_fallback_down_answers_honestly_and_soon(
    world: World,
) -> None:
    w = world
    assert w.policy.ladder.recovery.ramp == (0.05, 0.2, 0.5, 1.0)  # the shipped defaults
    before = await w.run(5)
    assert {(a.backend, a.tier) for a in before} == {("primary", "normal")}

    # Both go down under load: requests fail on both, both breakers open.
    await w.primary.set_mode("down")
    await w.fallback.set_mode("down")
    outage = await w.run(60)
    rt = w.state.current
    assert rt.tier == "maintenance", rt.ladder.snapshot()
    assert {u.breaker.state for u in rt.upstreams.values()} != {"closed"}
    assert outage[-1].backend == "maintenance"
    # Also the answers of requests no backend could answer before the
    # ladder moved (on 8c097b4 they said normal or failover).
    assert all(a.tier == "maintenance" for a in outage if a.backend == "maintenance")

    # The worst moment for the primary to recover: just after a recovery
    # probe failed (its breaker waits `reset_timeout_s` before the next one).
    b = rt.upstreams["primary"].breaker
    for _ in range(30):
        if b.state == "open" and b.retry_at() - w.clock.t >= b.policy.reset_timeout_s - 0.5:
            break
        outage += await w.run(1)
    else:
        raise AssertionError(f"no failed recovery probe: {b.state}")
    assert all(a.backend == "maintenance" for a in outage[-PER_WINDOW:])

    # The primary recovers; the fallback stays down.
    await w.primary.set_mode("healthy")
    t0 = w.clock.t
    with structlog.testing.capture_logs() as logs:
        after = await w.run(60)
    lines = {e["request_id"]: e for e in logs if e.get("event") == "request"}
    for a in after:
        assert a.status == 200, a
        assert a.backend in ("primary", "maintenance"), a
        if a.backend == "maintenance":
            # What the client is told matches what it got.
            assert a.tier == "maintenance", a
        else:
            assert a.text == "from primary", a
        # The access log says what the client was told.
        line = lines[a.rid]
        assert (line["backend"], line["tier"], line["status"]) == (a.backend, a.tier, 200), line
    late = [a for a in after if a.at - t0 >= GOAL_S]
    assert late and all(a.backend == "primary" for a in late), [
        (round(a.at - t0, 1), a.backend, a.tier) for a in late if a.backend != "primary"
    ]
    last_other = max((a.at - t0 for a in after if a.backend != "primary"), default=0.0)
    home = min(a.at - t0 for a in after if a.at - t0 > last_other)
    first_primary = min(a.at - t0 for a in after if a.backend == "primary")
    # Status and the log agree with the headers: normal at the end, the ramp over.
    st = rt.status()
    assert (st["tier"], st["ladder"]["ramp"]) == ("normal", None), st["ladder"]
    print(
        f"primary back at t0: first primary answer t0+{first_primary:.1f} s, "
        f"every answer from the primary from t0+{home:.1f} s "
        f"(answers are sampled once per {w.policy.ladder.recovery.window_s} s window)"
    )
