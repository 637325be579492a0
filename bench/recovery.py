"""Time back to the primary after it recovers (issue 14, items 1 and 3).

The proxy in front of scripted fakes on real sockets, a steady load of chat
requests (`--rate` per second), two scenarios:

    storm      a chat-only OpenAI-compatible primary (404 on /v1/completions)
               answers 500 until its breaker opened and a recovery probe
               failed, then recovers; the fallback is healthy
    both-down  both backends refuse connections, then the primary comes back
               while the fallback stays down

For each: seconds from the primary's recovery to its first answer, to tier
`normal`, and to the end of the ramp; the answers by backend meanwhile; and
the ladder's recovery bound (`proxy.control.ladder.recovery_bound`) for comparison.

    .venv/bin/python bench/recovery.py [--policy default|test] [--rate 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.app import create_app  # noqa: E402
from proxy.control.ladder import recovery_bound  # noqa: E402
from proxy.policy import parse_policy  # noqa: E402

TEST_TIMINGS: dict[str, Any] = {
    "ladder": {
        "recovery": {
            "window_s": 0.05,
            "min_dwell_s": 0.3,
            "healthy_windows": 2,
            "ramp": [0.25, 0.5, 1.0],
            "ramp_step_s": 0.2,
        },
        "breaker": {"fail_max": 3, "reset_timeout_s": 0.3},
    },
    "backend": {"health": {"interval_s": 0.05, "timeout_s": 0.5}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Fake:
    """A chat-only OpenAI-compatible server that can fail, stop and start."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.failing = False
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get(
            "/v1/models", lambda r: web.json_response({"data": [{"id": f"{self.name}-model"}]})
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        if self.failing:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        return web.json_response(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.name}}],
            }
        )


def policy_text(kind: str, primary: str, fallback: str) -> str:
    backend: dict[str, Any] = TEST_TIMINGS["backend"] if kind == "test" else {}
    doc: dict[str, Any] = {
        "server": {"heartbeat_s": 0},
        "backends": {
            "primary": {"url": primary, "kind": "openai", **backend},
            "fallback": {"url": fallback, "kind": "transformers", **backend},
        },
    }
    if kind == "test":
        doc["ladder"] = TEST_TIMINGS["ladder"]
    return yaml.safe_dump(doc)


async def status(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/brownout/status") as r:
        data: dict[str, Any] = await r.json()
        return data


async def scenario(name: str, kind: str, rate: float) -> dict[str, Any]:
    primary, fallback = Fake("primary"), Fake("fallback")
    await primary.start()
    await fallback.start()
    port = free_port()
    policy = parse_policy(policy_text(kind, primary.url, fallback.url), f"{kind}.yaml")
    app = create_app(policy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    answers: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as s:

            async def ask() -> str:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.headers.get("X-Brownout-Backend", f"HTTP {r.status}")

            async def until(pred: Any, limit: float) -> None:
                t0 = loop.time()
                while not pred(await status(s, url)):
                    if loop.time() - t0 > limit:
                        raise RuntimeError(f"{name}: timed out; {json.dumps(await status(s, url))}")
                    await ask()
                    await asyncio.sleep(1 / rate)

            await until(lambda st: st["backends"]["primary"]["healthy"], 30)
            if name == "storm":
                primary.failing = True
                await until(lambda st: st["tier"] == "failover", 60)
                await until(
                    lambda st: (
                        "recovery probe"
                        in (st["backends"]["primary"]["breaker_detail"]["last_failure"] or "")
                    ),
                    60,
                )
                primary.failing = False
            else:
                await primary.stop()
                await fallback.stop()
                await until(lambda st: st["tier"] == "maintenance", 60)
                await asyncio.sleep(2)
                await primary.start()
            t0 = loop.time()
            first = normal = None
            while True:
                b = await ask()
                answers[b] = answers.get(b, 0) + 1
                now = loop.time() - t0
                if b == "primary" and first is None:
                    first = now
                st = await status(s, url)
                if st["tier"] == "normal" and normal is None:
                    normal = now
                if st["tier"] == "normal" and st["ladder"]["ramp"] is None:
                    home = now
                    break
                if now > 300:
                    raise RuntimeError(f"{name}: never home; {json.dumps(st)}")
                await asyncio.sleep(1 / rate)
            edges = [f"{h['from']}→{h['to']} ({h['reason']})" for h in st["history"]]
    finally:
        await runner.cleanup()
        await primary.stop()
        await fallback.stop()
    return {
        "scenario": name,
        "policy": kind,
        "first_primary_answer_s": round(first or -1, 2),
        "tier_normal_s": round(normal or -1, 2),
        "ramp_done_s": round(home, 2),
        "ladder_bound_s": round(recovery_bound(policy.ladder.recovery), 2),
        "answers_meanwhile": answers,
        "history": edges,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=["default", "test"], default="test")
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--scenarios", default="storm,both-down")
    args = ap.parse_args()
    for name in args.scenarios.split(","):
        print(json.dumps(await scenario(name, args.policy, args.rate)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
