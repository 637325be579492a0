"""A stateful simulation of the whole proxy (issue 14, "Proof").

The real app (pipeline, ladder, breakers, retry budget, admission, rescue,
memory sessions) runs in-process on a free port in front of two scripted
fakes (`sim_backends`: a vLLM-like primary, a Transformers-like fallback).
Hypothesis drives random schedules of rules: each backend's behaviour
(healthy, down, 5xx storm, flapping, stall before the first byte, stream cut
mid-answer, slow first token, 429 with Retry-After, prefill rejection, the
engine's waiting queue), load (streaming and not, with priorities, session
ids, fields the fallback does not honour, prompts too long for the
fallback, client deadlines), an operator forcing and releasing tiers
through the admin API, and time. An initialize rule runs the proxy with
recovery probes (the default) or without (real requests are the breakers'
trials). Settings: the `ladder-sim` profile (12 examples × 25 steps, about
25 s here); `BROWNOUT_SIM_EXAMPLES` / `BROWNOUT_SIM_STEPS` search longer,
`SIM_NOSHRINK=1` skips shrinking.

Time: the app runs on an injectable clock (`create_app(policy, clock)`) that
only the `advance` rules move. The app's own evaluation loop is replaced by
the test's: each window it probes both backends' health, reads vLLM's
/metrics, moves the clock by `window_s` and runs `Evaluator.tick()`
(recovery probes included, awaited) — so dwell, healthy windows, ramps,
breaker reset timeouts and admission's drain rate all follow the fake clock,
and no example sleeps for them. Only the backends' own timeouts (first byte,
idle) and client deadlines are real time, shrunk to tenths of a second.

What a client notices, checked after every request and every step:

- every answer is complete (a stream ends with `data: [DONE]` after a
  `finish_reason`, or with an explicit error event; a JSON answer has
  choices) or an OpenAI error object: 429 with Retry-After, 503 with
  Retry-After or naming the fields, 400 naming its param, 502
  `request_failed_everywhere` only while both backends flap — never a plain-text
  500, never a silently truncated stream, never a hang past the client's
  bound;
- no fault other than host timing is ever charged to a healthy backend
  (`brownout_failures_total{attribution="backend"}`, its probes); host timing (a late
  first byte on this shared machine) restarts its healthy clock;
- `X-Brownout-Backend` names who answered (the text says so too), never a
  backend the schedule has down, never the fallback for a field it does not
  honour;
- a maintenance answer says `X-Brownout-Tier: maintenance`, whatever the
  ladder's tier or an operator's forced one;
- liveness: with nothing forced, once the primary has been healthy for
  `maintenance_bound` + breaker reset + two windows no answer comes from
  maintenance; once for the whole-proxy bound (`recovery_bound` + breaker
  reset + two windows) the tier is normal or throttle — normal with no
  ramp when no pressure signal was active in that time either; once the
  fallback has been healthy that long, no maintenance answer either (a
  healthy backend is never starved by the other's failures);
- no sequence of requests from one client opens the breaker of a backend
  whose probe succeeds (`hostile`: poison sampling values both engines
  answer 500 to) — its negative control is `storm_outage`, where the probe
  fails too and the breakers still open;
- a forced tier holds until released;
- when the load stops, the in-flight counters are back at zero and
  each request has exactly one access-log line (its status and backend as
  the client saw them) and `brownout_requests_total` grew by exactly one per
  line (a client whose deadline passed before its request was sent has
  none);
- no completed turn is lost from a session: every later request of that
  session reaches the backend with the whole history before it.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
import yaml
from aiohttp import web
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.control.ladder import TIERS, Tier, maintenance_bound, recovery_bound
from proxy.control.pressure import parse_vllm_metrics
from proxy.openai.sse import SSEParser
from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from proxy.runtime.loops import Evaluator, wanted_loops
from tests.integration.conftest import free_port
from tests.integration.sim_backends import MODES, PARTIAL, POISON_TOP_P, Mode, ScriptedBackend

W = 0.5  # the ladder's window, in (fake) seconds
TOKEN = "sim-admin-token"
NOTICE = "down for maintenance (simulated)"
CLIENT_BOUND_S = 5.0  # no request may take longer than this (real seconds)
# Client deadlines (real seconds): before the first byte, mid-stream, mid-rescue.
DEADLINES = (0.01, 0.05, 0.15)
# A question too long for the fallback's window (4,096) but not the primary's.
LONG = "word " * 4000
# Faults a healthy backend may still be charged with on a busy host (the
# backends' deadlines are real time): a late first byte or event, a pooled
# connection the restarted fake had closed. Any other fault charged to a
# healthy backend fails the test; these restart its healthy clock (a glitch).
HOST_TIMING = frozenset({"connect_timeout", "first_byte_timeout", "idle_timeout", "request"})
HOST_TIMING_REASONS = ("Timeout", "Disconnected", "ClientOSError")

settings.register_profile(
    "ladder-sim",
    max_examples=int(os.environ.get("BROWNOUT_SIM_EXAMPLES", "12")),
    stateful_step_count=int(os.environ.get("BROWNOUT_SIM_STEPS", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("SIM_NOSHRINK")
    else list(Phase),
)


def sim_policy(primary: str, fallback: str, recovery_probe: bool = True) -> Policy:
    def backend(url: str, kind: str) -> dict[str, Any]:
        return {
            "url": url,
            "kind": kind,
            "timeouts": {"connect_s": 0.5, "first_byte_s": 0.3, "idle_s": 0.3},
            # The test probes health once per window; the app's own loop
            # probes at start only.
            "health": {"interval_s": 3600, "timeout_s": 0.5},
        }

    doc: dict[str, Any] = {
        "server": {"heartbeat_s": 0, "admin_token": TOKEN},
        "backends": {
            "primary": backend(primary, "vllm"),
            "fallback": backend(fallback, "transformers"),
        },
        "sessions": {"store": "memory://", "max_turns": 8},
        "ladder": {
            # A small pool: a load step of six queues, evicts and sheds.
            "throttle": {
                "scrape_interval_s": 0,
                "max_inflight": 2,
                "queue_size": 2,
                "queue_timeout_s": 0.5,
            },
            "failover": {
                "retry_backoff_s": 0.01,
                "retry_backoff_max_s": 0.02,
                "recovery_probe": recovery_probe,
            },
            "recovery": {
                "window_s": W,
                "min_dwell_s": 1.0,
                "healthy_windows": 2,
                "ramp": [0.25, 0.5, 1.0],
                "ramp_step_s": 1.0,
            },
            "breaker": {"fail_max": 3, "reset_timeout_s": 2.0},
            "maintenance": {"notice": NOTICE, "retry_after_s": 5},
        },
    }
    return parse_policy(yaml.safe_dump(doc), "ladder-sim.yaml")


# Each mode once, and more of those whose interplay matters most (recovery,
# rescue of cut streams, concurrency that builds up behind a slow engine).
modes = st.sampled_from([*MODES, "healthy", "healthy", "cut", "slow"])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Ask:
    """One client request of a load step."""

    stream: bool
    priority: str | None
    session: bool
    logprobs: bool  # a field the fallback does not honour
    deadline: float | None  # the client gives up after this long
    long: bool = False  # too long for the fallback's context window


asks = st.builds(
    Ask,
    stream=st.booleans(),
    priority=st.sampled_from([None, "critical", "normal", "sheddable"]),
    session=st.booleans(),
    logprobs=st.sampled_from([False, False, False, True]),
    deadline=st.sampled_from([None, None, None, None, None, *DEADLINES]),
    long=st.sampled_from([False] * 9 + [True]),
)


@dataclass
class Reply:
    ask: Ask
    question: str
    sid: str | None
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""
    gave_up: bool = False  # the client's deadline passed first

    @property
    def rid(self) -> str:
        return "sim-" + self.question.split()[0]


@dataclass
class Turn:
    user: str
    assistant: str


class ProxySimulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.recorded = 0  # access-log lines so far
        self.questions = 0
        self.forced: Tier | None = None
        self.released_at = self.clock.t
        self.pressure_at = -1e9  # last window with a pressure signal active
        self.healthy_since: dict[str, float | None] = {
            "primary": self.clock.t,
            "fallback": self.clock.t,
        }
        self.charged: dict[tuple[str, str], float] = {}  # upstream_errors seen so far
        self.glitches: list[str] = []
        self.sessions: dict[str, list[Turn]] = {}
        self.tainted: set[str] = set()  # sessions whose last turn is unknown
        self.started = False

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize(recovery_probe=st.sampled_from([True, True, False]))
    def start(self, recovery_probe: bool) -> None:
        """With recovery probes (the default), or without: then real requests
        are the breakers' half-open trials, and coming home needs traffic, so
        the liveness checks are off (the probe variant makes them)."""
        self.recovery_probe = recovery_probe
        self.run(self._start())
        self.started = True

    async def _start(self) -> None:
        self.backends = {
            "primary": await ScriptedBackend.start("primary"),
            "fallback": await ScriptedBackend.start("fallback"),
        }
        urls = self.backends["primary"].url, self.backends["fallback"].url
        self.policy = sim_policy(*urls, recovery_probe=self.recovery_probe)
        self.bound = (
            recovery_bound(self.policy.ladder.recovery)
            + self.policy.ladder.breaker.reset_timeout_s
            + 2 * W
        )
        # No maintenance answer once the primary has been healthy this long
        # (issue 20: its ramp no longer holds requests back for maintenance).
        self.maintenance_bound = (
            maintenance_bound(self.policy.ladder.recovery)
            + self.policy.ladder.breaker.reset_timeout_s
            + 2 * W
        )
        self.app = create_app(self.policy, clock=self.clock)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self.state = self.app[STATE]
        # The test is the evaluation loop (on the fake clock), not the app's.
        self.state.run_loops(
            lambda s: {k: v for k, v in wanted_loops(s).items() if k != "evaluate"}
        )
        self.evaluator = Evaluator(self.state)
        self.client = aiohttp.ClientSession()
        await self._windows(1)

    def teardown(self) -> None:
        if not self.started:
            self.loop.close()
            return
        if self.glitches:
            print(f"host-timing glitches (healthy clock restarted): {self.glitches}")

        async def stop() -> None:
            await self.client.close()
            await self.runner.cleanup()
            for b in self.backends.values():
                await b.fake.stop()

        self.run(stop())
        self.loop.close()

    # -- helpers -------------------------------------------------------------------

    @property
    def rt(self) -> Any:
        return self.state.current

    def healthy_for(self, name: str) -> float:
        """Fake seconds the backend has been healthy, nothing forced since."""
        since = self.healthy_since[name]
        if since is None or self.forced is not None or not self.recovery_probe:
            return -1.0
        return self.clock.t - max(since, self.released_at)

    async def _windows(self, n: int) -> None:
        """`n` evaluation windows on the fake clock, as the app's loop does them."""
        loop = asyncio.get_running_loop()
        for _ in range(n):
            probed = {name: up.breaker._opened_at for name, up in self.rt.upstreams.items()}
            for up in self.rt.upstreams.values():
                await up.probe()
            await self._scrape()
            self.clock.t += W
            self.evaluator.tick()
            limit = loop.time() + CLIENT_BOUND_S
            while self.evaluator.probing():
                assert loop.time() < limit, f"recovery probes hang: {self.evaluator.probing()}"
                await asyncio.sleep(0.002)
            await asyncio.sleep(0)  # the breakers' evaluate_soon
            if self.rt.pressure.active:
                self.pressure_at = self.clock.t
            self._probes_blame(probed)
        await self._blame()

    def _glitch(self, name: str, why: str) -> None:
        self.glitches.append(f"{name}: {why}")
        if self.healthy_since[name] is not None:
            self.healthy_since[name] = self.clock.t

    def _probes_blame(self, before: dict[str, float]) -> None:
        """A healthy backend's health or recovery probe may fail only by host timing."""
        for name, up in self.rt.upstreams.items():
            if self.backends[name].mode != "healthy":
                continue
            if up.health.healthy is False:
                why = up.health.last_error or ""
                assert any(r in why for r in HOST_TIMING_REASONS), f"healthy {name}: {why}"
                self._glitch(name, f"health: {why}")
            if up.breaker._opened_at != before[name]:
                why = up.breaker.last_reason
                assert any(r in why for r in HOST_TIMING_REASONS), f"healthy {name}: {why}"
                self._glitch(name, f"breaker: {why}")

    async def _blame(self) -> None:
        """Faults the proxy charged to each backend since the last look: a
        healthy one is charged with host timing only."""
        async with self.client.get(self.url + "/metrics") as resp:
            text = await resp.text()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                # What was charged to the backend (issue 20's attribution).
                if smp.name != "brownout_failures_total" or smp.labels["attribution"] != "backend":
                    continue
                key = (smp.labels["backend"], smp.labels["fault"])
                new = smp.value - self.charged.get(key, 0.0)
                self.charged[key] = smp.value
                name, kind = key
                if new and self.backends[name].mode == "healthy":
                    assert kind in HOST_TIMING, f"the healthy {name} was charged with {kind}"
                    self._glitch(name, kind)

    async def _scrape(self) -> None:
        """What `scrape_forever` does, once (vLLM's load gauges)."""
        p = self.backends["primary"]
        if p.mode == "down":
            return
        async with self.client.get(p.url + "/metrics") as resp:
            text = await resp.text()
        self.rt.pressure.update_engine(parse_vllm_metrics(text))

    async def _metric_total(self, name: str) -> float:
        async with self.client.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name
        )

    async def _admin_tier(self, tier: Tier | None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with self.client.post(
            self.url + "/brownout/tier", json={"tier": tier}, headers=headers
        ) as resp:
            assert resp.status == 200, await resp.text()
            data: dict[str, Any] = await resp.json()
            return data

    # -- rules: the backends ---------------------------------------------------------

    @rule(
        name=st.sampled_from(["primary", "fallback"]),
        mode=modes,
        retry_after=st.sampled_from(["0", "1", "30"]),
    )
    def set_mode(self, name: str, mode: Mode, retry_after: str) -> None:
        b = self.backends[name]
        b.retry_after = retry_after
        self.run(b.set_mode(mode))
        if mode == "healthy":
            if self.healthy_since[name] is None:
                self.healthy_since[name] = self.clock.t
        else:
            self.healthy_since[name] = None
        if name == "primary" and b.waiting:
            self.healthy_since[name] = None

    @rule(
        primary=modes,
        fallback=modes,
        rejects_prefill=st.booleans(),
        retry_after=st.sampled_from(["0", "1", "30"]),
    )
    def schedule(
        self, primary: Mode, fallback: Mode, rejects_prefill: bool, retry_after: str
    ) -> None:
        """Both backends change at once (compound faults)."""
        self.set_mode("primary", primary, retry_after)
        self.set_mode("fallback", fallback, retry_after)
        self.backends["fallback"].rejects_prefill = rejects_prefill

    @rule(rejects=st.booleans())
    def fallback_prefill(self, rejects: bool) -> None:
        self.backends["fallback"].rejects_prefill = rejects

    @rule(waiting=st.sampled_from([0, 0, 20]))
    def engine_queue(self, waiting: int) -> None:
        p = self.backends["primary"]
        p.waiting = waiting
        if waiting:
            self.healthy_since["primary"] = None
        elif p.mode == "healthy" and self.healthy_since["primary"] is None:
            self.healthy_since["primary"] = self.clock.t

    # -- rules: operators and time -------------------------------------------------------

    @rule(tier=st.sampled_from(TIERS))
    def force(self, tier: Tier) -> None:
        body = self.run(self._admin_tier(tier))
        assert (body["tier"], body["ladder"]["forced"]) == (tier, tier)
        self.forced = tier

    @rule()
    def release(self) -> None:
        body = self.run(self._admin_tier(None))
        assert body["ladder"]["forced"] is None
        if self.forced is not None:
            self.released_at = self.clock.t
        self.forced = None

    @rule(windows=st.integers(1, 8))
    def advance(self, windows: int) -> None:
        self.run(self._windows(windows))

    @rule(stream=st.booleans())
    def settle(self, stream: bool) -> None:
        """Longer than any recovery the schedule allows, with a request every
        window (a ramp towards a dead backend only fails under traffic)."""
        plain = Ask(stream=stream, priority=None, session=True, logprobs=False, deadline=None)
        for _ in range(int(self.bound / W) + 2):
            self.run(self._load([plain]))
            self.run(self._windows(1))

    @rule(primary=modes, fallback=modes)
    def outage(self, primary: Mode, fallback: Mode) -> None:
        """Both backends down until the ladder is in maintenance, then each
        comes back in its own way (or not)."""
        self.set_mode("primary", "down", "0")
        self.set_mode("fallback", "down", "0")
        self.run(self._windows(2))
        if self.forced is None:
            assert self.rt.tier == "maintenance", self.rt.ladder.snapshot()
        self.set_mode("primary", primary, "0")
        self.set_mode("fallback", fallback, "0")

    @rule(primary=modes, fallback=modes, logprobs=st.booleans())
    def storm_outage(self, primary: Mode, fallback: Mode, logprobs: bool) -> None:
        """Both backends answer 500 until their breakers open (maintenance,
        with probes health still passes), then each comes back in its own way;
        a little load follows while their breakers are open or half-open."""
        self.set_mode("primary", "storm", "0")
        self.set_mode("fallback", "storm", "0")
        plain = Ask(stream=False, priority=None, session=False, logprobs=False, deadline=None)
        self.run(self._load([plain] * 4))
        self.set_mode("primary", primary, "0")
        self.set_mode("fallback", fallback, "0")
        self.run(self._windows(int(self.policy.ladder.breaker.reset_timeout_s / W) + 1))
        ask = Ask(stream=True, priority=None, session=False, logprobs=logprobs, deadline=None)
        self.run(self._load([ask, plain]))

    @rule(rejects_prefill=st.booleans(), session=st.booleans())
    def cut_mid_answer(self, rejects_prefill: bool, session: bool) -> None:
        """The primary starts cutting streams mid-answer, under streaming load
        (rescued on the fallback by prefill, or by prompt where it refuses a
        prefill, or ended with an error event — whatever the fallback does)."""
        self.set_mode("primary", "cut", "0")
        self.backends["fallback"].rejects_prefill = rejects_prefill
        cut = Ask(stream=True, priority=None, session=session, logprobs=False, deadline=None)
        self.run(self._load([cut, cut]))

    @rule(n=st.integers(1, 12), stream=st.booleans(), with_load=st.booleans())
    def hostile(self, n: int, stream: bool, with_load: bool) -> None:
        """One client sends poison requests (a sampling value both engines
        answer 500 to, whatever their mode; their probes pass), alone or
        beside ordinary load. Invariant (issue 20): no sequence of requests
        from one client opens the breaker of a backend whose probe succeeds —
        a healthy backend's closed breaker stays closed. (The negative
        control is `storm_outage`: a backend whose probe fails too still
        opens, within the policy's bound.)"""
        before = {
            name: (self.backends[name].mode, up.breaker.state)
            for name, up in self.rt.upstreams.items()
        }
        plain = Ask(stream=stream, priority=None, session=False, logprobs=False, deadline=None)
        self.run(self._hostile(n, stream, [plain, plain] if with_load else []))
        for name, up in self.rt.upstreams.items():
            mode, state = before[name]
            if mode == "healthy" and state == "closed":
                assert up.breaker.state == "closed", (
                    f"one client's poison requests opened the healthy {name}'s breaker: "
                    f"{up.breaker.last_reason}"
                )

    async def _hostile(self, n: int, stream: bool, others: list[Ask]) -> None:
        rids = [f"hostile-{self.questions}-{i}" for i in range(n)]
        self.questions += 1
        replies = [Reply(a, f"q{self.questions}-{i}", None) for i, a in enumerate(others)]

        async def one(rid: str) -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "poison"}],
                "stream": stream,
                "top_p": POISON_TOP_P,
            }
            async with self.client.post(
                self.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:  # an OpenAI error object, never plain text
                    assert "error" in json.loads(raw), raw[:200]

        with structlog.testing.capture_logs() as logs:
            await asyncio.gather(*(one(rid) for rid in rids), *(self._send(r) for r in replies))
            for r in replies:
                self._check_reply(r)
            await self._quiet()
        mine = [e for e in logs if e.get("event") == "request" and e["request_id"] in rids]
        assert len(mine) == n, mine
        self.recorded += n
        self._check_access_log(replies, [e for e in logs if e not in mine])

    # -- rules: load -----------------------------------------------------------------------

    @rule(batch=st.lists(asks, min_size=2, max_size=6))
    def load(self, batch: list[Ask]) -> None:
        self.run(self._load(batch))
        self.run(self._windows(1))  # time goes on under load

    async def _load(self, batch: list[Ask]) -> None:
        replies = []
        for i, ask in enumerate(batch):
            self.questions += 1
            # One request per session at a time: turn order is then defined.
            # (A long question stays out of sessions: it would trim their history.)
            sid = f"sim-{i}" if ask.session and not ask.long else None
            question = f"q{self.questions}" + (" " + LONG if ask.long else "")
            replies.append(Reply(ask, question, sid))
        with structlog.testing.capture_logs() as logs:
            await asyncio.gather(*(self._send(r) for r in replies))
            for r in replies:
                self._check_reply(r)
            await self._quiet()
        self._check_access_log(replies, logs)
        total = await self._metric_total("brownout_requests_total")
        assert total == self.recorded, f"{total} request records for {self.recorded} log lines"
        for r in replies:
            self._check_history(r)
            self._record_turn(r)

    async def _send(self, r: Reply) -> None:
        # Only the new message: the proxy prepends the session's history.
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": r.question}],
            "stream": r.ask.stream,
        }
        if r.ask.logprobs:
            body["logprobs"] = True
        headers = {"X-Request-Id": r.rid}
        if r.ask.priority is not None:
            headers["X-Priority"] = r.ask.priority
        if r.sid is not None:
            headers["X-Session-Id"] = r.sid
        limit = r.ask.deadline or CLIENT_BOUND_S
        try:
            async with asyncio.timeout(limit):
                async with self.client.post(
                    self.url + "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    r.status = resp.status
                    r.headers = dict(resp.headers)
                    r.raw = await resp.read()
        except TimeoutError:
            assert r.ask.deadline is not None, f"{r.question} hung past {CLIENT_BOUND_S} s"
            r.gave_up = True

    def _check_access_log(self, replies: list[Reply], logs: list[dict[str, Any]]) -> None:
        """One access-log line per request, saying what its client got."""
        lines: dict[str, list[dict[str, Any]]] = {}
        for e in logs:
            if e.get("event") == "request":
                lines.setdefault(e["request_id"], []).append(e)
        assert set(lines) <= {r.rid for r in replies}, sorted(lines)
        assert all(len(v) == 1 for v in lines.values()), lines
        self.recorded += len(lines)
        for r in replies:
            if r.gave_up:
                # Answered just before, cut, or never received (a deadline
                # shorter than the connect): at most one line.
                continue
            (line,) = lines[r.rid]
            got = (r.status, r.headers["X-Brownout-Backend"])
            assert (line["status"], line["backend"]) == got, line
            if got[1] == "maintenance":
                assert line["tier"] == "maintenance", line  # as its header says

    async def _quiet(self) -> None:
        """The load stopped: in-flight counters back at zero, one record each."""
        loop = asyncio.get_running_loop()
        limit = loop.time() + CLIENT_BOUND_S
        rt = self.rt
        while rt.inflight or rt.admission.inflight or rt.admission.queued:
            assert loop.time() < limit, (rt.inflight, rt.admission.snapshot())
            await asyncio.sleep(0.005)
        # A corroboration probe the load set off judges its failures before
        # the schedule moves on: its charges belong to the backend's mode now.
        while probing := self._corroborating():
            assert loop.time() < limit, f"corroboration probes hang: {probing}"
            await asyncio.sleep(0.002)
        await self._blame()

    def _corroborating(self) -> list[str]:
        return [
            name
            for name, up in self.rt.upstreams.items()
            if any(led.probing for led in up.judge.ledgers.values())
        ]

    # -- per-request checks ----------------------------------------------------------------

    def _check_reply(self, r: Reply) -> None:
        if r.gave_up:
            if r.sid is not None:
                self.tainted.add(r.sid)
            return
        h = r.headers
        backend, tier = h.get("X-Brownout-Backend"), h.get("X-Brownout-Tier")
        where = f"{r.question[:12]} {r.ask}: {r.status} {h} {r.raw[:400]!r}"
        assert backend in ("primary", "fallback", "maintenance", "none"), where
        assert backend != "none" or r.status != 200, where
        assert tier in TIERS, where
        if backend == "maintenance":
            # Issue 20: a maintenance answer says so, whatever the ladder's
            # tier (on 8c097b4 a ramp's rest got it under `normal`).
            assert tier == "maintenance", f"a maintenance answer under tier {tier}: {where}"
        ct = h.get("Content-Type", "")
        if r.status != 200:
            assert ct.startswith("application/json"), where
            err = json.loads(r.raw)["error"]
            assert err["message"] and err["type"], where
            if r.status == 503 and err.get("code") == "unsupported_fields":
                assert r.ask.logprobs and "logprobs" in err["message"], where
                assert backend == "fallback", where
                # In maintenance the fallback only had a trial: the tier's answer stands.
                assert tier != "maintenance", f"a trial's refusal as the answer: {where}"
            elif r.status in (429, 503):
                assert "Retry-After" in h, where
            elif r.status == 400 and err.get("code") == "context_length_exceeded":
                assert r.ask.long and err.get("param") == "messages", where
            elif r.status == 502 and err.get("code") == "request_failed_everywhere":
                # Issue 20's verdict on a request that got a 5xx from every
                # backend while their probes pass — a poison request's. Two
                # backends flapping in step (each 500 to the request, 200 to
                # its probe) look the same from the proxy: a clear error then,
                # never while any backend answers every request.
                modes = {b.mode for b in self.backends.values()}
                assert "flap" in modes and modes <= {"flap", "storm"}, where
            else:
                raise AssertionError(f"unexpected status: {where}")
            return
        if self.forced is not None and backend != "maintenance":
            assert tier == self.forced, f"forced {self.forced}: {where}"
            if self.forced == "maintenance":
                assert backend == "maintenance", f"forced maintenance: {where}"
        if backend != "maintenance":
            assert self.backends[backend].mode != "down", f"answered by a dead backend: {where}"
            assert not (backend == "fallback" and r.ask.logprobs), f"logprobs dropped: {where}"
        elif self.forced != "maintenance":
            for name in ("primary", "fallback"):
                bound = self.maintenance_bound if name == "primary" else self.bound
                assert self.healthy_for(name) < bound, (
                    f"maintenance answer with the {name} healthy for "
                    f"{self.healthy_for(name):.1f} s > bound {bound:.1f} s: {where}"
                )
        text, errored = self._answer(r, where)
        if errored:
            assert r.ask.stream, where
            return
        expected = {
            "primary": {"from primary", PARTIAL + "from fallback"},
            "fallback": {"from fallback"},
            "maintenance": {NOTICE},
        }[backend]
        assert text in expected, f"{text!r} not in {expected}: {where}"
        r.headers["x-sim-text"] = text

    def _answer(self, r: Reply, where: str) -> tuple[str, bool]:
        """(the answer's text, whether it ended with an explicit error event)."""
        ct = r.headers.get("Content-Type", "")
        if not r.ask.stream:
            assert ct.startswith("application/json"), where
            data = json.loads(r.raw)
            assert data["choices"][0]["finish_reason"] in ("stop", "length"), where
            content: str = data["choices"][0]["message"]["content"]
            return content, False
        assert ct.startswith("text/event-stream"), where
        events = [e.data for e in SSEParser().feed(r.raw) if e.data is not None]
        assert events and events[-1] == b"[DONE]", f"stream without [DONE]: {where}"
        parts, finished = [], False
        for i, d in enumerate(events[:-1]):
            obj = json.loads(d)
            if "error" in obj:
                assert i == len(events) - 2, f"events after the error: {where}"
                return "".join(parts), True
            for c in obj["choices"]:
                parts.append(c["delta"].get("content") or "")
                finished = finished or c.get("finish_reason") is not None
        assert finished, f"a stream ended without finish_reason or error: {where}"
        return "".join(parts), False

    # -- sessions ------------------------------------------------------------------------------

    def _check_history(self, r: Reply) -> None:
        """Every body a backend got for this request carries the session's turns."""
        if r.sid is None or r.sid in self.tainted:
            return
        want: list[dict[str, str]] = []
        keep = self.policy.sessions.max_turns  # the store keeps the last ones only
        for t in self.sessions.get(r.sid, [])[-keep:]:
            want += [
                {"role": "user", "content": t.user},
                {"role": "assistant", "content": t.assistant},
            ]
        for name, b in self.backends.items():
            for body in b.chat_bodies():
                msgs = body["messages"]
                if msgs[-1].get("content") == r.question or (
                    len(msgs) >= 2 and msgs[-2].get("content") == r.question
                ):
                    i = next(k for k, m in enumerate(msgs) if m.get("content") == r.question)
                    assert msgs[:i] == want, f"{name} got {msgs} for session {r.sid}; want {want}"

    def _record_turn(self, r: Reply) -> None:
        if r.sid is None or r.gave_up:
            return
        text = r.headers.get("x-sim-text")
        if (
            r.status == 200
            and text is not None
            and r.headers["X-Brownout-Backend"] != "maintenance"
        ):
            self.sessions.setdefault(r.sid, []).append(Turn(r.question, text))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def forced_tier_holds(self) -> None:
        if self.forced is not None:
            assert self.rt.tier == self.forced
            assert self.rt.ladder.forced == self.forced

    @invariant()
    def recovery_comes_home(self) -> None:
        tier = self.rt.tier
        if self.healthy_for("primary") >= self.bound:
            assert tier in ("normal", "throttle"), (tier, self.rt.status()["history"][-5:])
            if self.clock.t - self.pressure_at >= self.bound:
                assert (tier, self.rt.ladder.ramp) == ("normal", None), self.rt.ladder.snapshot()
        if self.healthy_for("fallback") >= self.bound:
            assert tier != "maintenance", self.rt.status()["history"][-5:]

    @invariant()
    def counters_idle(self) -> None:
        rt = self.rt
        assert rt.inflight == 0 and rt.admission.inflight == 0 and rt.admission.queued == 0


ProxySimulation.TestCase.settings = settings.get_profile("ladder-sim")
TestProxySimulation = ProxySimulation.TestCase


def test_replay_a_maintenance_trial_refused_for_its_fields() -> None:
    """The schedule that shows the maintenance-trial bug (fixed in
    proxy.pipeline.flow): without recovery probes, both backends' breakers
    open in a 500 storm; the primary then goes down and the fallback heals;
    the next request asks for logprobs (which the fallback does not honour)
    and is the fallback's half-open trial. On the old code the client got the
    fallback's 503 `unsupported_fields` under `X-Brownout-Tier: maintenance`."""
    sim = ProxySimulation()
    sim.start(recovery_probe=False)
    try:
        sim.storm_outage(primary="down", fallback="healthy", logprobs=True)
        sim.forced_tier_holds()
        sim.counters_idle()
    finally:
        sim.teardown()


def test_replay_a_corroboration_probe_judging_after_the_schedule_moved_on() -> None:
    """The schedule hypothesis found (2026-12-04): the primary cuts streams,
    a corroboration probe goes out for them and is still out when the
    schedule makes the primary healthy; its failure then charged the cut
    streams to a backend the checker already saw healthy. The charges were
    right (the streams were cut while it was broken): the checker now waits
    for corroboration probes before the schedule moves on, and the primary's
    breaker is open by then, on the probe's verdict."""
    sim = ProxySimulation()
    sim.start(recovery_probe=False)
    try:
        sim.advance(windows=1)
        sim.cut_mid_answer(rejects_prefill=False, session=True)
        sim.release()
        sim.cut_mid_answer(rejects_prefill=True, session=False)
        assert sim._corroborating() == []
        sim.set_mode(mode="healthy", name="primary", retry_after="0")
        sim.set_mode(mode="slow", name="fallback", retry_after="1")
        sim.hostile(n=11, stream=False, with_load=False)
        sim.counters_idle()
    finally:
        sim.teardown()


def test_replay_two_backends_flapping_in_step() -> None:
    """The schedule hypothesis found (2026-12-04): both backends flap (500 and
    200 in turn), a streaming question gets a 500 from each while their
    probes get 200s — the proxy's verdict is issue 20's `502
    request_failed_everywhere`, a clear error the checker did not know."""
    sim = ProxySimulation()
    sim.start(recovery_probe=True)
    try:
        sim.advance(windows=1)
        sim.schedule(fallback="slow", primary="slow", rejects_prefill=True, retry_after="0")
        sim.schedule(fallback="slow", primary="healthy", rejects_prefill=False, retry_after="0")
        sim.schedule(fallback="healthy", primary="flap", rejects_prefill=False, retry_after="0")
        sim.set_mode(mode="flap", name="fallback", retry_after="0")
        sim.engine_queue(waiting=0)
        sim.settle(stream=True)
        sim.counters_idle()
    finally:
        sim.teardown()
