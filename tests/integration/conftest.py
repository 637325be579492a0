"""A scriptable fake upstream and the real proxy, both on real sockets."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.app import create_app
from proxy.policy import Policy, parse_policy

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class FakeUpstream:
    """An OpenAI-ish server whose handlers each test scripts."""

    port: int
    handlers: dict[str, Handler] = field(default_factory=dict)
    requests: list[tuple[str, CIMultiDict[str], bytes]] = field(default_factory=list)
    # Set when a streaming handler notices its client went away.
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.path, CIMultiDict(request.headers), body))
        handler = self.handlers.get(request.path)
        if handler is None:
            if request.path == "/health":
                return web.Response(status=200)
            return web.json_response({"error": {"message": "not scripted"}}, status=404)
        return await handler(request)


async def _start(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = await _start(app, fake.port)
    yield fake
    await runner.cleanup()


@pytest.fixture
async def fallback_upstream() -> AsyncIterator[FakeUpstream]:
    """A second scripted fake (the fallback's place)."""
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = await _start(app, fake.port)
    yield fake
    await runner.cleanup()


def make_policy(primary: str, fallback: str | None = None, extra: str = "") -> Policy:
    text = f"""
server:
  heartbeat_s: 0.3
backends:
  primary:
    url: {primary}
    timeouts: {{connect_s: 1, first_byte_s: 2, idle_s: 1}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    if fallback:
        text += f"""  fallback:
    url: {fallback}
    kind: transformers
    timeouts: {{connect_s: 1, first_byte_s: 2, idle_s: 1}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    return parse_policy(text + extra, "test-policy.yaml")


@dataclass
class RunningProxy:
    url: str
    app: web.Application
    session: aiohttp.ClientSession


ProxyFactory = Callable[[Policy], Awaitable[RunningProxy]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[ProxyFactory]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def factory(policy: Policy) -> RunningProxy:
        port = free_port()
        app = create_app(policy)
        runners.append(await _start(app, port))
        session = aiohttp.ClientSession()
        sessions.append(session)
        return RunningProxy(f"http://127.0.0.1:{port}", app, session)

    yield factory
    for s in sessions:
        await s.close()
    for r in runners:
        await r.cleanup()


def chunk(content: str, finish: str | None = None) -> bytes:
    import json

    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# The tiny test model has random weights and a byte-level tokenizer: it emits
# control bytes and loops by design. Tests that are not about the guard run
# its content rules in `log` mode (tests/integration/test_guard_flow.py
# measures what the default policy does to that output).
RANDOM_MODEL_GUARD = """
guard:
  control_chars: {action: log}
  replacement_chars: {action: log}
  special_tokens: {action: log}
  repetition: {action: log}
"""

NO_MAINTENANCE = "ladder:\n  maintenance:\n    enabled: false\n"

CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


# -- a real nginx running nginx/brownout.conf -----------------------------------

NGINX_SITE = Path(__file__).resolve().parents[2] / "nginx" / "brownout.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
# Strings of the site file the tests rewrite (production values → test values).
UPSTREAM_LINE = "server 127.0.0.1:8080;"
LISTEN_LINE = "listen 80;"

StartNginx = Callable[[int], Awaitable[str]]


def nginx_site_conf(prefix: Path, listen: int, upstream_port: int) -> Path:
    site = NGINX_SITE.read_text()
    for line in (UPSTREAM_LINE, LISTEN_LINE):
        assert line in site, f"{NGINX_SITE} no longer contains {line!r}"
    site = site.replace(UPSTREAM_LINE, f"server 127.0.0.1:{upstream_port};")
    site = site.replace(LISTEN_LINE, f"listen 127.0.0.1:{listen};")
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
async def start_nginx(tmp_path: Path) -> AsyncIterator[StartNginx]:
    if not Path(NGINX).exists():
        pytest.fail("nginx is not installed (.ci/run installs it with apt-get)")
    procs: list[subprocess.Popen[bytes]] = []

    async def start(upstream_port: int) -> str:
        port = free_port()
        conf = nginx_site_conf(tmp_path, port, upstream_port)
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
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"nginx did not start: {err}") from None
                await asyncio.sleep(0.05)
        raise RuntimeError("nginx did not start")

    yield start
    for p in procs:
        p.terminate()
        p.wait(5)
