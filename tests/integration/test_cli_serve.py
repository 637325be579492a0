"""`brownout serve` as a real process: uvloop, JSON logs, no prompts in logs."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.integration.conftest import CHAT_BODY, FakeUpstream, free_port

ROOT = Path(__file__).resolve().parents[2]


async def _serve(policy: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(policy), "--port", str(port)],
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    for _ in range(100):
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc
        except OSError:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            await asyncio.sleep(0.05)
    raise AssertionError("brownout serve did not start")


def _stop(proc: subprocess.Popen[bytes]) -> list[dict[str, object]]:
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()
    return [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]


async def test_serve_logs_json_without_prompts(fake_upstream: FakeUpstream, tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    policy = tmp_path / "p.yaml"
    policy.write_text(f"backends:\n  primary:\n    url: {fake_upstream.url}\n")
    port = free_port()
    proc = await _serve(policy, port)
    secret = "my secret question"
    body = {**CHAT_BODY, "stream": False, "messages": [{"role": "user", "content": secret}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=body,
            headers={"X-Request-Id": "cli-1"},
        ) as resp:
            assert resp.status == 200
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{oops") as resp:
            assert resp.status == 400
    records = _stop(proc)
    req = [r for r in records if r.get("event") == "request"]
    assert req and req[0]["request_id"] == "cli-1"
    assert req[0]["status"] == 200 and req[0]["backend"] == "primary"
    assert any(r.get("event") == "request_rejected" for r in records)
    assert secret not in json.dumps(records)


async def test_serve_logs_prompts_when_the_policy_says_so(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f"server:\n  log_prompts: true\nbackends:\n  primary:\n    url: {fake_upstream.url}\n"
    )
    port = free_port()
    proc = await _serve(policy, port)
    body = {**CHAT_BODY, "stream": False, "messages": [{"role": "user", "content": "visible"}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
    records = _stop(proc)
    assert "visible" in json.dumps([r for r in records if r.get("event") == "prompt"])


def test_serve_refuses_a_broken_policy(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("backends:\n  primary:\n    url: http://x:1\n    kind: nope\n")
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(policy)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=30,
    )
    assert res.returncode == 2
    assert f"{policy}:4:" in res.stderr
