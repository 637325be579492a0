"""The flight recorder in the running proxy: what a request leaves on disk,
`GET /brownout/recording`, and a stalled or full disk that never slows
serving (measured against the same proxy with the recorder off)."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port

TOKEN = "rec-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7}


def policy(upstream: str, rec_dir: Path | None, extra: str = "") -> Policy:
    text = f"""
server:
  admin_token: {TOKEN}
  heartbeat_s: 0.3
backends:
  primary:
    url: {upstream}
    timeouts: {{connect_s: 1, first_byte_s: 2, idle_s: 1}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    if rec_dir is not None:
        text += f"recorder:\n  enabled: true\n  dir: {rec_dir}\n"
    return parse_policy(text + extra, "rec-policy.yaml", env={})


def ok_upstream(fake: FakeUpstream) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    fake.handlers["/v1/chat/completions"] = handler


async def recording(
    session: aiohttp.ClientSession, url: str, want: int, **params: str
) -> list[dict[str, Any]]:
    """The recording's `req` records once `want` of them are on disk."""
    deadline = time.monotonic() + 10
    while True:
        async with session.get(f"{url}/brownout/recording", params=params, headers=ADMIN) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("application/x-ndjson")
            recs = [orjson.loads(x) for x in (await r.read()).splitlines() if x]
        if sum(1 for x in recs if x["k"] == "req") >= want or time.monotonic() > deadline:
            return recs
        await asyncio.sleep(0.2)


async def test_requests_and_signals_reach_the_recording(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    ok_upstream(fake_upstream)
    proxy = await start_proxy(policy(fake_upstream.url, tmp_path / "rec"))
    s = proxy.session
    for i in range(5):
        headers = {"X-Priority": "sheddable"} if i == 0 else {}
        async with s.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers) as r:
            assert r.status == 200
    recs = await recording(s, proxy.url, 5, since="-5m")
    kinds = {x["k"] for x in recs}
    assert {"policy", "req", "probe"} <= kinds
    reqs = [x for x in recs if x["k"] == "req"]
    assert len(reqs) == 5
    r0 = reqs[0]
    assert (r0["ep"], r0["st"], r0["be"], r0["s"], r0["o"], r0["mt"]) == (
        "chat",
        False,
        "primary",
        200,
        "complete",
        7,
    )
    assert r0["att"][0][:3] == ["primary", "answered", 200]
    assert sorted(x["pri"] for x in reqs) == ["normal"] * 4 + ["sheddable"]
    probes = [x for x in recs if x["k"] == "probe"]
    assert probes and all(p["b"] == "primary" and p["ok"] for p in probes)
    # Times are wall clock.
    assert abs(r0["t"] - time.time()) < 60
    # A window in the future is empty, an inverted one refused, no token refused.
    assert not [
        x for x in await recording(s, proxy.url, 0, since="-0s", until="-0s") if x["k"] == "req"
    ]
    async with s.get(
        f"{proxy.url}/brownout/recording", params={"since": "-1m", "until": "-2m"}, headers=ADMIN
    ) as r:
        assert r.status == 400
    async with s.get(f"{proxy.url}/brownout/recording") as r:
        assert r.status == 401
    # Status and metrics show the recorder.
    async with s.get(f"{proxy.url}/brownout/status") as r:
        st = (await r.json())["recorder"]
    assert st["enabled"] is True and st["written"] >= 5 and st["dropped"] == 0
    async with s.get(f"{proxy.url}/metrics") as r:
        text = await r.text()
    assert 'brownout_recorder_dropped_total{reason="queue_full"} 0.0' in text


async def test_the_recording_endpoint_says_when_the_recorder_is_off(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(policy(fake_upstream.url, None))
    async with proxy.session.get(f"{proxy.url}/brownout/recording", headers=ADMIN) as r:
        assert r.status == 409
        assert (await r.json())["error"]["code"] == "recorder_disabled"
    async with proxy.session.get(f"{proxy.url}/brownout/status") as r:
        assert (await r.json())["recorder"] == {"enabled": False}


class Stalled:
    """Writes block until `gate` is set (a disk that stopped answering)."""

    def __init__(self, real: IO[bytes], gate: threading.Event) -> None:
        self.real, self.gate = real, gate

    def write(self, data: bytes) -> int:
        self.gate.wait()
        return self.real.write(data)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


@pytest.fixture
async def two_proxies(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> AsyncIterator[tuple[str, str, web.Application, threading.Event]]:
    """The same upstream behind a proxy without recorder and one whose
    recording disk is stalled (its queue small, so it overflows)."""
    ok_upstream(fake_upstream)
    gate = threading.Event()
    runners = []
    urls = []
    app_rec: web.Application | None = None
    for rec_dir in (None, tmp_path / "rec"):
        app = create_app(policy(fake_upstream.url, rec_dir))
        rec = app[STATE].recorder
        if rec is not None:
            rec._open = lambda p: Stalled(p.open("ab"), gate)  # type: ignore[assignment,return-value]
            rec.queue_max = 50
            app_rec = app
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    assert app_rec is not None
    try:
        yield urls[0], urls[1], app_rec, gate
    finally:
        gate.set()
        for r in runners:
            await r.cleanup()


async def test_a_stalled_disk_never_slows_serving(
    two_proxies: tuple[str, str, web.Application, threading.Event],
) -> None:
    off, stalled, app, gate = two_proxies
    await asyncio.sleep(1.5)  # the writer's first flush is now stuck in write()
    times: dict[str, list[float]] = {off: [], stalled: []}
    async with aiohttp.ClientSession() as s:
        for _ in range(6):  # interleaved batches: the host's noise hits both alike
            for url in (off, stalled):
                for _ in range(40):
                    t0 = time.perf_counter()
                    async with s.post(f"{url}/v1/chat/completions", json=BODY) as r:
                        assert r.status == 200
                        await r.read()
                    times[url].append(time.perf_counter() - t0)
        off_p50, stalled_p50 = statistics.median(times[off]), statistics.median(times[stalled])
        print(
            f"\nrequest p50: recorder off {off_p50 * 1e3:.2f} ms, "
            f"disk stalled {stalled_p50 * 1e3:.2f} ms"
        )
        assert stalled_p50 <= off_p50 * 1.3 + 0.5e-3
        rec = app[STATE].recorder
        assert rec is not None and rec.dropped > 0
        async with s.get(f"{stalled}/brownout/status") as r:
            st = (await r.json())["recorder"]
        assert st["dropped"] == rec.dropped and st["queued"] <= 50
        async with s.get(f"{stalled}/metrics") as r:
            assert 'brownout_recorder_dropped_total{reason="queue_full"} 0.0' not in await r.text()
        # The disk answers again: the recording resumes and marks its hole.
        gate.set()
        recs = await recording(s, stalled, 1, since="-5m")
        gaps = [x for x in recs if x["k"] == "gap"]
        assert gaps and sum(g["dropped"] for g in gaps) >= 1


async def test_a_full_disk_stops_recording_never_serving(
    fake_upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full")
    ok_upstream(fake_upstream)
    app = create_app(policy(fake_upstream.url, tmp_path / "rec"))
    rec = app[STATE].recorder
    assert rec is not None
    rec._open = lambda p: full.open("wb")  # type: ignore[assignment]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 10
            while rec.last_error is None and time.monotonic() < deadline:
                async with s.post(f"{url}/v1/chat/completions", json=BODY) as r:
                    assert r.status == 200
                await asyncio.sleep(0.05)
            for _ in range(20):
                async with s.post(f"{url}/v1/chat/completions", json=BODY) as r:
                    assert r.status == 200
            async with s.get(f"{url}/brownout/status") as r:
                st = (await r.json())["recorder"]
            assert st["disk_full"] is True and "No space left" in st["last_error"]
            assert st["writing"] is False and st["lost"] > 0
    finally:
        await runner.cleanup()
