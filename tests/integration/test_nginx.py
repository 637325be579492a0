"""Through a real nginx running nginx/brownout.conf: chunks still arrive one by one."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.sse import SSEParser
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    chunk,
    free_port,
    make_policy,
)

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

pytestmark = pytest.mark.real


def nginx_conf(prefix: Path, listen: int, upstream_port: int) -> Path:
    site = (ROOT / "nginx" / "brownout.conf").read_text()
    assert "server 127.0.0.1:8080;" in site and "listen 80;" in site
    site = site.replace("server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream_port};")
    site = site.replace("listen 80;", f"listen 127.0.0.1:{listen};")
    (prefix / "site.conf").write_text(site)
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""
worker_processes 1;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    include {prefix}/site.conf;
}}
"""
    )
    return conf


@pytest.fixture
async def start_nginx(tmp_path: Path) -> AsyncIterator[Callable[[int], asyncio.Future[str]]]:
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed (.ci/run installs it with apt-get)")
    procs: list[subprocess.Popen[bytes]] = []

    async def start(upstream_port: int) -> str:
        port = free_port()
        conf = nginx_conf(tmp_path, port, upstream_port)
        proc = subprocess.Popen(
            [NGINX, "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off; user root;"],
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        for _ in range(100):
            try:
                _r, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                return f"http://127.0.0.1:{port}"
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "") from None
                await asyncio.sleep(0.05)
        raise RuntimeError("nginx did not start")

    yield start  # type: ignore[misc]
    for p in procs:
        p.terminate()
        p.wait(5)


async def test_chunks_pass_nginx_one_by_one(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    start_nginx: Callable[[int], asyncio.Future[str]],
) -> None:
    received = [asyncio.Event() for _ in range(5)]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(chunk(f"t{i} "))
            # Next token only once the client behind nginx has this one.
            await asyncio.wait_for(received[i].wait(), 3)
        await resp.write(chunk("", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    proxy_port = int(proxy.url.rsplit(":", 1)[1])
    nginx_url = await start_nginx(proxy_port)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            nginx_url + "/v1/chat/completions",
            json=CHAT_BODY,
            headers={"X-Request-Id": "via-nginx"},
        ) as resp,
    ):
        assert resp.status == 200
        # nginx consumes X-Accel-Buffering; the rest of our headers pass.
        assert "X-Accel-Buffering" not in resp.headers
        assert resp.headers["X-Brownout-Backend"] == "primary"
        assert resp.headers["X-Request-Id"] == "via-nginx"
        parser = SSEParser()
        n = 0
        async for data in resp.content.iter_any():
            for _ev in parser.feed(data):
                if n < 5:
                    received[n].set()
                n += 1
    assert n == 7


async def test_nginx_generates_a_request_id(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    start_nginx: Callable[[int], asyncio.Future[str]],
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    nginx_url = await start_nginx(int(proxy.url.rsplit(":", 1)[1]))
    async with (
        aiohttp.ClientSession() as s,
        s.post(nginx_url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}) as resp,
    ):
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
    assert len(rid) == 32  # nginx's $request_id, echoed by Brownout
    sent = [h for p, h, _ in fake_upstream.requests if p == "/v1/chat/completions"]
    assert sent[-1]["X-Request-Id"] == rid
