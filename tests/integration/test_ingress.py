"""Ingress: bad input never gets a plain-text 500 (defect 6), known paths are
answered by the proxy and odd paths never forwarded (defect 3), every error
is an OpenAI error object, every response carries the request id."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import CHAT_BODY, FakeUpstream, ProxyFactory
from tests.integration.rawhttp import RawResponse, raw_request

CHAT = b"/v1/chat/completions"
JSON_CT = [(b"Content-Type", b"application/json")]


def make_policy(url: str, server: str = "") -> Policy:
    text = f"""
server:
  heartbeat_s: 0.3
{server}
backends:
  primary:
    url: {url}
    timeouts: {{connect_s: 1, first_byte_s: 2, idle_s: 1}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    return parse_policy(text, "test-policy.yaml")


def assert_openai_error(resp: RawResponse, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status == status, resp.body
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def forwarded(fake: FakeUpstream) -> list[str]:
    """Paths of client requests that reached the backend (the proxy's own
    probes and scrapes carry no X-Request-Id)."""
    return [path for path, h, _b in fake.requests if "X-Request-Id" in h]


async def _ok_upstream(fake: FakeUpstream) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    fake.handlers["/v1/chat/completions"] = handler
    fake.handlers["/v1/completions"] = handler


def _chat(**over: Any) -> bytes:
    return json.dumps({**CHAT_BODY, "stream": False, **over}).encode()


# -- defect 6: valid HTTP, hostile content ------------------------------------------

DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BIG_INT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"7" * 5000 + b"}"
SURROGATE_MODEL = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
SURROGATE_TEXT = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
PART_NOT_TEXT = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (DEEP, "invalid_json"),
        (BIG_INT, "invalid_json"),
        (SURROGATE_TEXT, "invalid_json"),
    ],
    ids=["nested-100k", "5000-digit-int", "lone-surrogate"],
)
async def test_hostile_json_gets_400(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, body: bytes, code: str
) -> None:
    await _ok_upstream(fake_upstream)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(
        proxy.url, "POST", CHAT, [(b"Content-Type", b"application/json")], body
    )
    assert_openai_error(resp, 400, code)
    assert forwarded(fake_upstream) == []


@pytest.mark.parametrize(
    ("body", "code"),
    [(SURROGATE_MODEL, "invalid_json"), (PART_NOT_TEXT, "invalid_type")],
    ids=["surrogate-model", "non-string-part-text"],
)
async def test_hostile_bodies_in_maintenance_get_400(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, body: bytes, code: str
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url))
    proxy.app[STATE].current.force_tier("maintenance")
    for stream in (b"false", b"true"):
        sent = body[:-1] + b', "stream": ' + stream + b"}"
        resp = await raw_request(proxy.url, "POST", CHAT, [], sent)
        assert_openai_error(resp, 400, code)
    # A sane request is still served in maintenance, from the notice.
    resp = await raw_request(proxy.url, "POST", CHAT, [], _chat())
    assert resp.status in (200, 503)
    assert resp.headers["x-brownout-backend"] == "maintenance"


async def test_non_utf8_authorization_with_a_session(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(
        proxy.url,
        "POST",
        CHAT,
        [(b"Authorization", b"Bearer \xff\xfe\xfa"), (b"X-Session-Id", b"s1")],
        _chat(),
    )
    err = assert_openai_error(resp, 400, "invalid_header")
    assert err["param"] == "Authorization"
    assert forwarded(fake_upstream) == []


@pytest.mark.parametrize("target", [b"/brownout/tier", b"/brownout/reload"])
async def test_non_utf8_authorization_on_admin_endpoints(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, target: bytes
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url, server="  admin_token: s3"))
    resp = await raw_request(
        proxy.url, "POST", target, [(b"Authorization", b"Bearer s3\xff")], b'{"tier": null}'
    )
    assert_openai_error(resp, 400, "invalid_header")
    # The right token still works, and a wrong one is a 401.
    ok = await raw_request(
        proxy.url, "POST", b"/brownout/tier", [(b"Authorization", b"Bearer s3")], b'{"tier": null}'
    )
    assert ok.status == 200
    bad = await raw_request(
        proxy.url, "POST", b"/brownout/tier", [(b"Authorization", b"Bearer s4")], b"{}"
    )
    assert assert_openai_error(bad, 401, "unauthorized")["type"] == "authentication_error"


async def test_admin_body_nested_deep_gets_400(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url, server="  admin_token: s3"))
    resp = await raw_request(
        proxy.url, "POST", b"/brownout/tier", [(b"Authorization", b"Bearer s3")], b"[" * 50_000
    )
    assert_openai_error(resp, 400, "invalid_json")


# -- defect 3: routing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "status", "allow"),
    [
        ("POST", b"/v1/chat/completions/", 404, None),
        ("POST", b"/v1/completions/", 404, None),
        ("POST", b"/v1/chat/completions/extra", 404, None),
        ("GET", b"/v1/chat/completions", 405, "POST"),
        ("PUT", b"/v1/chat/completions", 405, "POST"),
        ("DELETE", b"/v1/completions", 405, "POST"),
        ("POST", b"/v1/models", 405, "GET"),
        ("GET", b"/v1/embeddings", 405, "POST"),
        ("PATCH", b"/v1/anything", 405, "DELETE,GET,POST"),
        ("POST", b"/v1/chat%2Fcompletions", 400, None),
        ("POST", b"/v1/chat%2fcompletions", 400, None),
        ("POST", b"/v1/./chat/completions", 400, None),
        ("POST", b"/v1/x/../chat/completions", 400, None),
        ("POST", b"/v1/x/%2e%2E/chat/completions", 400, None),
        ("POST", b"/v1//chat/completions", 400, None),
        ("POST", b"/v1/chat/completions%00", 400, None),
        ("POST", b"/v1/chat/completions%0a", 400, None),
        ("POST", b"/v1/chat\\completions", 400, None),
        ("GET", b"/nowhere", 404, None),
    ],
)
async def test_odd_paths_and_methods_are_answered_by_the_proxy(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    method: str,
    target: bytes,
    status: int,
    allow: str | None,
) -> None:
    await _ok_upstream(fake_upstream)
    # Anything that slipped past the proxy's routes would show up at the backend.
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(proxy.url, method, target, [], _chat())
    assert_openai_error(resp, status)
    if allow is not None:
        assert sorted(resp.headers["allow"].split(",")) == sorted(allow.split(","))
    assert forwarded(fake_upstream) == []
    assert resp.headers["x-request-id"]


async def test_trailing_slash_names_the_path_it_meant(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(proxy.url, "POST", b"/v1/chat/completions/", [], _chat())
    err = assert_openai_error(resp, 404, "unknown_url")
    assert "/v1/chat/completions?" in err["message"]


async def test_known_and_other_v1_paths_still_pass_through(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    fake_upstream.handlers["/v1/models"] = models
    fake_upstream.handlers["/v1/embeddings"] = models
    fake_upstream.handlers["/v1/brand/new"] = models
    proxy = await start_proxy(make_policy(fake_upstream.url))
    for method, target in [("GET", b"/v1/models"), ("POST", b"/v1/embeddings")]:
        resp = await raw_request(proxy.url, method, target, [], b'{"input": "x"}')
        assert resp.status == 200, resp.body
    resp = await raw_request(proxy.url, "POST", b"/v1/brand/new", [], b"{}")
    assert resp.status == 200
    assert forwarded(fake_upstream) == ["/v1/models", "/v1/embeddings", "/v1/brand/new"]


# -- middlewares ------------------------------------------------------------------------


async def test_api_key_is_checked_against_every_key(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    policy = make_policy(fake_upstream.url, server="  api_keys: [k-one, k-two]")
    proxy = await start_proxy(policy)
    for auth, status in [
        (b"Bearer k-two", 200),
        (b"bearer k-one", 200),
        (b"Bearer k-on", 401),
        (b"Basic k-one", 401),
        (b"Bearer ", 401),
    ]:
        resp = await raw_request(proxy.url, "POST", CHAT, [(b"Authorization", auth)], _chat())
        assert resp.status == status, (auth, resp.body)
        if status == 401:
            assert_openai_error(resp, 401, "invalid_api_key")
    # Every /v1 route needs the key, the pass-through too.
    resp = await raw_request(proxy.url, "GET", b"/v1/models", [], b"")
    assert_openai_error(resp, 401, "invalid_api_key")


async def test_request_id_is_sent_back_on_every_answer(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    for method, target, body in [
        ("POST", CHAT, _chat()),
        ("POST", CHAT, b"{"),
        ("GET", CHAT, b""),
        ("GET", b"/healthz", b""),
        ("GET", b"/nowhere", b""),
    ]:
        resp = await raw_request(proxy.url, method, target, [(b"X-Request-Id", b"rid-7")], body)
        assert resp.headers["x-request-id"] == "rid-7", (method, target)
    # The id reaches the backend too.
    assert fake_upstream.requests[-1][1]["X-Request-Id"] == "rid-7"
    # An id that is not a sane token is replaced.
    resp = await raw_request(proxy.url, "GET", b"/healthz", [(b"X-Request-Id", b"a b;<x>")], b"")
    assert len(resp.headers["x-request-id"]) == 32


async def test_unexpected_exception_is_an_openai_500(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url))

    def boom(*_args: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(proxy.app[STATE].current, "priority_for", boom)
    resp = await raw_request(proxy.url, "POST", CHAT, [], _chat())
    err = assert_openai_error(resp, 500, "internal_error")
    assert err["type"] == "server_error"
    assert "ZeroDivisionError" not in err["message"]  # no internals on the wire


async def test_oversized_bodies_get_openai_413(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    policy = make_policy(fake_upstream.url, server="  max_body_bytes: 2048\n  admin_token: s3")
    proxy = await start_proxy(policy)
    big = b'{"input": "' + b"x" * 4096 + b'"}'
    for target, headers in [
        (b"/v1/embeddings", []),
        (CHAT, []),
        (b"/brownout/tier", [(b"Authorization", b"Bearer s3")]),
    ]:
        resp = await raw_request(proxy.url, "POST", target, headers, big * 20)
        assert_openai_error(resp, 413, "request_too_large")


async def test_exception_mid_stream_ends_it_with_an_in_band_error(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from proxy.guard.core import StreamGuard
    from tests.integration.conftest import chunk

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("Hel"))
        await asyncio.sleep(0.1)
        await resp.write(chunk("lo", finish="stop") + b"data: [DONE]\n\n")
        return resp

    feed = StreamGuard.feed
    calls: list[int] = []

    def broken_feed(self: StreamGuard, *args: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("a bug in the middle of a stream")
        return feed(self, *args)  # type: ignore[arg-type]

    fake_upstream.handlers["/v1/chat/completions"] = stream
    monkeypatch.setattr(StreamGuard, "feed", broken_feed)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    body = json.dumps({**CHAT_BODY, "stream": True}).encode()
    resp = await raw_request(proxy.url, "POST", CHAT, [], body)
    assert resp.status == 200
    events = [e for e in resp.body.split(b"\n\n") if e.startswith(b"data: ")]
    # What was relayed, then an error event the SDKs raise, then the end: not
    # a stream cut without its terminator, which a client takes for success.
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "Hel"
    error = json.loads(events[-2][6:])["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 3, events
