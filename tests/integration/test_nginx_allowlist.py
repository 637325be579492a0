"""The public site (nginx/brownout.conf, a real nginx) is an allowlist.

Only the OpenAI API (`/v1/*`) and the health endpoints reach Brownout;
`/metrics`, `/brownout/*` (status page, event feed, admin API) and any
other path are answered 404 by nginx itself and never forwarded — also when
spelled to slip past a prefix match (dot-segments, encoded dots, doubled
slashes), and for every method.

The first test runs the real proxy behind nginx, with an admin token, to show
what a user would otherwise reach; the others use a fake upstream that
records every request it gets.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from proxy.policy import parse_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, StartNginx
from tests.integration.rawhttp import raw_request

pytestmark = pytest.mark.real

#: What the public must never reach, as a client could spell it.
BLOCKED = (
    b"/metrics",
    b"/brownout/",
    b"/brownout/status",
    b"/brownout/events",
    b"/brownout/tier",
    b"/brownout/reload",
    b"/brownout/rollout",
    b"/v1/../metrics",
    b"/v1/%2e%2e/metrics",
    b"/v1/%2E%2E/brownout/status",
    b"/healthz/../brownout/status",
    b"//metrics",
    b"/./brownout/status",
    b"/brownout%2Fstatus",
    b"/metrics?format=prometheus",
    b"/",
    b"/docs",
)


def assert_nginx_404(status: int, body: bytes, target: bytes) -> None:
    assert status == 404, target
    err = json.loads(body)["error"]
    assert err["code"] == "not_found", target


async def test_the_real_proxy_behind_nginx_exposes_only_the_api(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, start_nginx: StartNginx
) -> None:
    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    fake_upstream.handlers["/v1/models"] = models
    policy = parse_policy(
        f"""
server:
  admin_token: s3cret
backends:
  primary:
    url: {fake_upstream.url}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
""",
        "allowlist-policy.yaml",
    )
    proxy = await start_proxy(policy)
    port = int(proxy.url.rsplit(":", 1)[1])
    nginx_url = await start_nginx(port)
    auth = {"Authorization": "Bearer s3cret"}
    async with aiohttp.ClientSession() as s:
        # Directly, on Brownout's own port: all of it answers.
        async with s.get(proxy.url + "/metrics") as r:
            assert r.status == 200 and b"brownout_requests_total" in await r.read()
        async with s.post(proxy.url + "/brownout/tier", json={"tier": None}, headers=auth) as r:
            assert r.status == 200
        # Through nginx: the API and health, nothing else.
        async with s.get(nginx_url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        async with s.get(nginx_url + "/healthz") as r:
            assert r.status == 200
        async with s.get(nginx_url + "/readyz") as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        for path in ("/metrics", "/brownout/", "/brownout/status", "/brownout/events"):
            async with s.get(nginx_url + path) as r:
                assert_nginx_404(r.status, await r.read(), path.encode())
        for path in ("/brownout/tier", "/brownout/reload", "/brownout/rollout"):
            async with s.post(nginx_url + path, json={"tier": "maintenance"}, headers=auth) as r:
                assert_nginx_404(r.status, await r.read(), path.encode())
        # The forced tier above did not happen: the admin call never arrived.
        async with s.get(proxy.url + "/brownout/status") as r:
            assert (await r.json())["tier"] == "normal"


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "DELETE"])
async def test_blocked_paths_never_reach_the_upstream(
    method: str, fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    async def secret(request: web.Request) -> web.StreamResponse:
        return web.Response(text="brownout_requests_total 1\n")

    for path in ("/metrics", "/brownout/status", "/brownout/tier", "/", "/docs"):
        fake_upstream.handlers[path] = secret
    nginx_url = await start_nginx(fake_upstream.port)
    for target in BLOCKED:
        resp = await raw_request(nginx_url, method, target, body=b"{}" if method == "POST" else b"")
        if method == "HEAD":
            assert resp.status == 404, target
        else:
            assert_nginx_404(resp.status, resp.body, target)
        assert b"brownout_requests_total" not in resp.body
    assert fake_upstream.requests == [], [p for p, _h, _b in fake_upstream.requests]


async def test_allowed_paths_reach_the_upstream(
    fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    for path in ("/healthz", "/readyz", "/v1/models", "/v1/embeddings"):
        fake_upstream.handlers[path] = ok
    nginx_url = await start_nginx(fake_upstream.port)
    async with aiohttp.ClientSession() as s:
        for method, path in (
            ("GET", "/healthz"),
            ("GET", "/readyz"),
            ("GET", "/v1/models"),
            ("POST", "/v1/embeddings"),
        ):
            async with s.request(
                method, nginx_url + path, json={} if method == "POST" else None
            ) as r:
                assert r.status == 200, path
    assert [p for p, _h, _b in fake_upstream.requests] == [
        "/healthz",
        "/readyz",
        "/v1/models",
        "/v1/embeddings",
    ]
