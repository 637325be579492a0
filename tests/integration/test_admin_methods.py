"""The admin endpoints take POST only: any other method is a 405 with
`Allow: POST` and an OpenAI error object, whoever asks (issue 20).

Before, `GET /brownout/tier` was a 403 (`admin_disabled`) or a 401
(`unauthorized`): the credential was checked before the method, so an
operator trying `curl /brownout/tier` was told to fix a token that was never
the problem. A trailing slash names no route (404, with the path meant).
"""

from __future__ import annotations

import json

import pytest

from proxy.policy import parse_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory

TOKEN = "s3cret"
ADMIN = ("/brownout/tier", "/brownout/reload")
METHODS = ("GET", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS")


def _policy(upstream: str, admin_token: str) -> str:
    server = f"server:\n  admin_token: {admin_token}\n" if admin_token else ""
    return server + f"backends:\n  primary:\n    url: {upstream}\n"


@pytest.mark.parametrize("admin_token", [TOKEN, ""], ids=["admin-on", "admin-off"])
async def test_other_methods_on_admin_endpoints_are_405_with_allow_post(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, admin_token: str
) -> None:
    proxy = await start_proxy(parse_policy(_policy(fake_upstream.url, admin_token), env={}))
    for path in ADMIN:
        for method in METHODS:
            for auth in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": "Bearer x"}):
                async with proxy.session.request(method, proxy.url + path, headers=auth) as r:
                    body = await r.read()
                    where = (path, method, auth)
                    assert r.status == 405, (where, body)
                    assert r.headers["Allow"] == "POST", where
                    assert r.headers["Content-Type"].startswith("application/json"), where
                    assert r.headers["X-Request-Id"], where
                if method == "HEAD":
                    assert body == b"", where
                    continue
                err = json.loads(body)["error"]
                assert err["code"] == "method_not_allowed", where
                assert err["type"] == "invalid_request_error"
                assert f"{method} {path}" in err["message"] and "POST" in err["message"]


async def test_post_still_asks_for_the_token(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(parse_policy(_policy(fake_upstream.url, TOKEN), env={}))
    async with proxy.session.post(proxy.url + "/brownout/tier", json={"tier": None}) as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "unauthorized"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with proxy.session.post(
        proxy.url + "/brownout/tier", json={"tier": None}, headers=auth
    ) as r:
        assert r.status == 200


@pytest.mark.parametrize("path", [*(p + "/" for p in ADMIN), "/brownout/status/"])
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_trailing_slash_is_404_naming_the_path_meant(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, path: str, method: str
) -> None:
    proxy = await start_proxy(parse_policy(_policy(fake_upstream.url, TOKEN), env={}))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with proxy.session.request(
        method, proxy.url + path, headers=auth, allow_redirects=False
    ) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "unknown_url"
    assert f"did you mean {path.rstrip('/')}?" in err["message"]


async def test_the_status_page_keeps_its_slash(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(parse_policy(_policy(fake_upstream.url, ""), env={}))
    async with proxy.session.get(proxy.url + "/brownout/") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/html")
    async with proxy.session.get(proxy.url + "/brownout", allow_redirects=False) as r:
        assert r.status == 301 and r.headers["Location"] == "brownout/"
