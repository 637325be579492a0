"""Policy hot reload: API, SIGHUP, file watch; failed reloads change nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.policy import load_policy
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    chunk,
    free_port,
)

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer s3cret"}


def write_policy(path: Path, upstream: str, notice: str = "Back soon.", extra: str = "") -> None:
    path.write_text(
        f"""server:
  admin_token: s3cret
  heartbeat_s: 0.3
  body_timeout_s: 0.5
backends:
  primary:
    url: {upstream}
    health: {{interval_s: 0.1}}
ladder:
  maintenance:
    notice: "{notice}"
{extra}"""
    )


async def status(p: RunningProxy) -> dict[str, Any]:
    async with p.session.get(p.url + "/brownout/status") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def maintenance_text(p: RunningProxy) -> str:
    async with p.session.post(
        p.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}
    ) as resp:
        body = await resp.json()
        assert resp.headers["X-Brownout-Backend"] == "maintenance"
        text: str = body["choices"][0]["message"]["content"]
        return text


async def test_reload_via_api_applies_and_a_broken_policy_changes_nothing(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, fake_upstream.url, "Back soon.")
    proxy = await start_proxy(load_policy(path))
    async with proxy.session.post(
        proxy.url + "/brownout/tier", json={"tier": "maintenance"}, headers=ADMIN
    ) as resp:
        assert resp.status == 200
    assert await maintenance_text(proxy) == "Back soon."

    # Not without the token.
    async with proxy.session.post(proxy.url + "/brownout/reload") as resp:
        assert resp.status == 401

    write_policy(path, fake_upstream.url, "Upgrading the engine.")
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as resp:
        assert resp.status == 200
        result = await resp.json()
    assert result["ok"] is True
    assert result["changes"] == [
        "~ ladder.maintenance.notice: 'Back soon.' -> 'Upgrading the engine.'"
    ]
    assert await maintenance_text(proxy) == "Upgrading the engine."
    st = await status(proxy)
    assert st["ladder"]["forced"] == "maintenance"  # the ladder's state carried over
    assert st["policy"]["last_reload"]["trigger"] == "api"

    # A broken edit: rejected with FILE:LINE, the running policy stays.
    path.write_text(path.read_text().replace("heartbeat_s: 0.3", "heartbeat_s: soon"))
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as resp:
        assert resp.status == 422
        result = await resp.json()
    assert result["ok"] is False
    assert result["errors"] == [f"{path}:3: server.heartbeat_s: expected a number, got 'soon'"]
    assert await maintenance_text(proxy) == "Upgrading the engine."
    st = await status(proxy)
    assert st["policy"]["last_reload"]["ok"] is False
    assert st["policy"]["last_reload"]["errors"][0].startswith(f"{path}:3:")
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert "brownout_policy_reload_failures_total 1.0" in text
    assert "brownout_policy_reloads_total 1.0" in text


async def test_in_flight_requests_finish_under_the_old_policy(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("old "))
        await release.wait()
        await resp.write(chunk("backend", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = slow
    other = FakeUpstream(free_port())
    other_app = web.Application()
    other_app.router.add_route("*", "/{tail:.*}", other.dispatch)
    runner = web.AppRunner(other_app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", other.port).start()

    async def fresh(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"choices": [{"message": {"content": "new"}, "finish_reason": "stop"}]}
        )

    other.handlers["/v1/chat/completions"] = fresh
    try:
        path = tmp_path / "policy.yaml"
        write_policy(path, fake_upstream.url)
        proxy = await start_proxy(load_policy(path))
        resp = await proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY)
        first = await resp.content.readany()
        assert b"old " in first

        write_policy(path, other.url)
        async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as r:
            assert (await r.json())["changes"][0].startswith("~ backends.primary.url")
        # New requests go to the new backend at once...
        async with proxy.session.post(
            proxy.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}
        ) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == "new"
        st = await status(proxy)
        assert st["policy"]["generations_live"] == 2
        # ...while the one in flight finishes on the old one, whole.
        release.set()
        rest = await resp.read()
        assert b"backend" in rest and rest.endswith(b"data: [DONE]\n\n")
        resp.close()
        deadline = time.monotonic() + 3
        while (await status(proxy))["policy"]["generations_live"] != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()


async def test_file_watch_reloads(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    watch = "  watch_policy: true\n  watch_interval_s: 0.05\n"
    write_policy(path, fake_upstream.url, "One.")
    path.write_text(path.read_text().replace("server:\n", "server:\n" + watch))
    proxy = await start_proxy(load_policy(path))
    await asyncio.sleep(0.2)
    text = path.read_text().replace('notice: "One."', 'notice: "Two."')
    path.write_text(text)
    deadline = time.monotonic() + 3
    while True:
        st = await status(proxy)
        last = st["policy"]["last_reload"]
        if last and last["ok"]:
            break
        assert time.monotonic() < deadline, st["policy"]
        await asyncio.sleep(0.05)
    assert last["trigger"] == "file_changed"
    assert any("notice" in c for c in last["changes"])


def test_sighup_reloads_a_running_server(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    port = free_port()
    write_policy(path, f"http://127.0.0.1:{free_port()}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path), "--port", str(port)],
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        url = f"http://127.0.0.1:{port}/brownout/status"

        def get() -> dict[str, Any]:
            import urllib.request

            with urllib.request.urlopen(url, timeout=2) as r:
                data: dict[str, Any] = json.loads(r.read())
                return data

        deadline = time.monotonic() + 20
        while True:
            try:
                get()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        write_policy(path, f"http://127.0.0.1:{free_port()}", "After HUP.")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not (get()["policy"]["last_reload"] or {}).get("ok"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert get()["policy"]["last_reload"]["trigger"] == "sighup"
    finally:
        proc.terminate()
        proc.wait(10)


def test_check_diff(tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    write_policy(old, "http://127.0.0.1:8000")
    write_policy(new, "http://127.0.0.1:9000", extra="  throttle:\n    max_inflight: 8\n")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(old), "--diff", str(new)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "~ backends.primary.url: 'http://127.0.0.1:8000' -> 'http://127.0.0.1:9000'",
        "~ ladder.throttle.max_inflight: 64 -> 8",
    ]
