"""Reloads racing requests and each other: what a client in flight sees."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.policy import load_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy, free_port

ADMIN = {"Authorization": "Bearer s3cret"}
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
).encode()


def write_policy(path: Path, upstream: str, extra: str = "") -> None:
    path.write_text(
        f"server:\n  admin_token: s3cret\n  heartbeat_s: 0.3\n{extra}"
        f"backends:\n  primary:\n    url: {upstream}\n    health: {{interval_s: 0.1}}\n"
    )


async def status(p: RunningProxy) -> dict[str, Any]:
    async with p.session.get(p.url + "/brownout/status") as resp:
        data: dict[str, Any] = await resp.json()
        return data


def answer(text: str) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
        )

    return handler


async def start_fake() -> tuple[FakeUpstream, web.AppRunner]:
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port).start()
    return fake, runner


async def test_a_request_still_sending_its_body_during_a_reload_is_served(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    other, runner = await start_fake()
    fake_upstream.handlers["/v1/chat/completions"] = answer("old")
    other.handlers["/v1/chat/completions"] = answer("new")
    try:
        path = tmp_path / "policy.yaml"
        write_policy(path, fake_upstream.url)
        proxy = await start_proxy(load_policy(path))
        port = int(proxy.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10]
        )
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler has taken the current generation
        write_policy(path, other.url)  # a new backend: the old one is closed when drained
        async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as r:
            assert (await r.json())["ok"] is True
        # Give a drainer the chance to close the old generation (it used to,
        # at once: the request was not counted in flight yet).
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            if (await status(proxy))["policy"]["generations_live"] == 1:
                break
            await asyncio.sleep(0.05)
        writer.write(BODY[10:])
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 "), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await reader.readexactly(length))
        writer.close()
        # Served whole, by the generation it started on.
        assert body["choices"][0]["message"]["content"] == "old"
    finally:
        await runner.cleanup()


async def test_concurrent_reloads_each_answer_and_apply_once(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    write_policy(path, fake_upstream.url, "  body_timeout_s: 0.5\n")

    async def reload() -> dict[str, Any]:
        async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as r:
            assert r.status == 200
            data: dict[str, Any] = await r.json()
            return data

    results = await asyncio.gather(*(reload() for _ in range(6)))
    assert all(r["ok"] for r in results)
    changed = [r["changes"] for r in results if r["changes"]]
    assert changed == [["~ server.body_timeout_s: 30.0 -> 0.5"]]
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert "brownout_policy_reloads_total 6.0" in text
    assert "brownout_policy_reload_failures_total 0.0" in text


async def test_a_reload_during_an_outage_keeps_answering_and_can_end_it(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    dead1, dead2 = free_port(), free_port()
    path = tmp_path / "policy.yaml"
    extra = "ladder:\n  maintenance:\n    notice: 'Down for now.'\n"
    fallback = "  fallback:\n    url: {}\n    health: {{interval_s: 0.1}}\n"
    path.write_text(
        "server:\n  admin_token: s3cret\n  body_timeout_s: 0.5\n"
        f"backends:\n  primary:\n    url: http://127.0.0.1:{dead1}\n"
        "    timeouts: {connect_s: 0.2}\n    health: {interval_s: 0.1}\n"
        + fallback.format(f"http://127.0.0.1:{dead2}")
        + extra
    )
    proxy = await start_proxy(load_policy(path))

    async def ask() -> tuple[int, str, str]:
        async with proxy.session.post(
            proxy.url + "/v1/chat/completions",
            data=BODY,
            headers={"Content-Type": "application/json"},
        ) as r:
            data = await r.json()
            return (
                r.status,
                r.headers["X-Brownout-Backend"],
                data["choices"][0]["message"]["content"],
            )

    deadline = time.monotonic() + 10
    while (await ask())[1] != "maintenance":
        assert time.monotonic() < deadline, "never reached maintenance"
        await asyncio.sleep(0.1)
    # A reload while both are down: applied, and answers go on.
    path.write_text(path.read_text().replace("Down for now.", "Still down."))
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as r:
        assert (r.status, (await r.json())["ok"]) == (200, True)
    assert await ask() == (200, "maintenance", "Still down.")

    # A reload that points the fallback at a live server ends the outage.
    live, runner = await start_fake()
    live.handlers["/v1/chat/completions"] = answer("back")
    try:
        path.write_text(path.read_text().replace(f"http://127.0.0.1:{dead2}", live.url))
        async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as r:
            assert (await r.json())["ok"] is True
        deadline = time.monotonic() + 30
        while (got := await ask())[1] != "fallback":
            assert time.monotonic() < deadline, f"still {got}"
            await asyncio.sleep(0.2)
        assert got == (200, "fallback", "back")
    finally:
        await runner.cleanup()
