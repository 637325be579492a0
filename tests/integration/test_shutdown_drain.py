"""SIGTERM on a real `brownout serve`: the drain a Kubernetes pod stop relies on.

At SIGTERM `/readyz` goes 503 first while the listener stays open, a new
API request gets 503 + `Retry-After` (and `Connection: close`), a stream in
flight runs to its end, and the process exits once it has; a stream that
outlives `server.shutdown_grace_s` is cut there.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.integration.conftest import CHAT_BODY, FakeUpstream, chunk, free_port
from tests.integration.test_cli_serve import _serve

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _policy(tmp_path: Path, upstream: str, grace_s: float) -> Path:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"""
server:
  shutdown_grace_s: {grace_s}
backends:
  primary:
    url: {upstream}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    )
    return policy


def _gated_stream(release: asyncio.Event, started: asyncio.Event) -> web.RequestHandler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("first "))
        started.set()
        await release.wait()
        await resp.write(chunk("last", "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler  # type: ignore[return-value]


async def _wait_ready(base: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.get(base + "/readyz") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("never ready")


def _records(proc: subprocess.Popen[bytes]) -> list[dict[str, object]]:
    _out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err.decode()
    return [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]


async def test_sigterm_drains_streams_in_flight_and_turns_new_requests_away(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    release, started = asyncio.Event(), asyncio.Event()
    fake_upstream.handlers["/v1/chat/completions"] = _gated_stream(release, started)  # type: ignore[assignment]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = await _serve(_policy(tmp_path, fake_upstream.url, grace_s=20), port)
    try:
        await _wait_ready(base)
        async with (
            aiohttp.ClientSession() as streaming,
            streaming.post(base + "/v1/chat/completions", json=CHAT_BODY) as stream,
        ):
            assert stream.status == 200
            first = await stream.content.readuntil(b"\n\n")
            assert b"first " in first
            await asyncio.wait_for(started.wait(), 5)

            proc.send_signal(signal.SIGTERM)
            # A fresh connection per call: what a kubelet probe or a client
            # routed here by a stale endpoint does.
            async with aiohttp.ClientSession() as probe:
                for _ in range(100):
                    async with probe.get(base + "/readyz") as r:
                        ready = (r.status, await r.json())
                    if ready[0] == 503:
                        break
                    await asyncio.sleep(0.02)
                assert ready[0] == 503 and ready[1]["draining"] is True
                assert ready[1]["ready"] is False

                async with probe.post(base + "/v1/chat/completions", json=CHAT_BODY) as r:
                    assert r.status == 503
                    assert r.headers["Retry-After"] == "1"
                    assert r.headers["Connection"] == "close"
                    error = (await r.json())["error"]
                    assert error["code"] == "shutting_down"
                    assert error["type"] == "server_error"
                # Liveness still answers: the kubelet must not kill a draining process.
                async with probe.get(base + "/healthz") as r:
                    assert r.status == 200
            assert proc.poll() is None, "exited with a stream still in flight"

            release.set()
            rest = await asyncio.wait_for(stream.content.read(), 5)
        assert b"last" in rest and rest.endswith(b"data: [DONE]\n\n")
        t0 = time.monotonic()
        records = await asyncio.to_thread(_records, proc)
        assert time.monotonic() - t0 < 5, "did not exit once the stream had ended"
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [r["event"] for r in records]
    assert "draining" in events and "drained" in events
    done = [r for r in records if r.get("event") == "request" and r.get("status") == 200]
    assert done, "the in-flight stream was logged as answered"


async def test_a_stream_past_the_grace_is_cut_and_the_process_exits(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    release, started = asyncio.Event(), asyncio.Event()  # never released
    fake_upstream.handlers["/v1/chat/completions"] = _gated_stream(release, started)  # type: ignore[assignment]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = await _serve(_policy(tmp_path, fake_upstream.url, grace_s=1), port)
    try:
        await _wait_ready(base)
        async with (
            aiohttp.ClientSession() as s,
            s.post(base + "/v1/chat/completions", json=CHAT_BODY) as stream,
        ):
            await stream.content.readuntil(b"\n\n")
            await asyncio.wait_for(started.wait(), 5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            records = await asyncio.to_thread(_records, proc)
            took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    # The grace (1 s) and the cleanup's moment (at most 1 s more).
    assert 0.9 <= took < 6, took
    cut = [r for r in records if r.get("event") == "drain_cut_short"]
    assert cut and cut[0]["inflight"] == 1


async def test_an_idle_process_exits_at_once(fake_upstream: FakeUpstream, tmp_path: Path) -> None:
    port = free_port()
    proc = await _serve(_policy(tmp_path, fake_upstream.url, grace_s=30), port)
    try:
        await _wait_ready(f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        records = await asyncio.to_thread(_records, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 6, "an idle drain must not wait out the grace (30 s)"
    assert any(r.get("event") == "drained" for r in records)
