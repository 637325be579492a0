"""Request bodies in a Content-Encoding (defect 4): the backend gets the
bytes the proxy forwards with headers that describe them, so a client's
gzip body is never a backend failure."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    _start,
    free_port,
    make_policy,
)
from tests.integration.rawhttp import raw_request
from tests.integration.test_ingress import assert_openai_error, forwarded

CHAT = b"/v1/chat/completions"
BODY = json.dumps({**CHAT_BODY, "stream": False}).encode()


def _answer(name: str) -> web.StreamResponse:
    return web.json_response(
        {
            "object": "chat.completion",
            "model": name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": name},
                    "finish_reason": "stop",
                }
            ],
        }
    )


async def _strict(request: web.Request) -> web.StreamResponse:
    # An aiohttp backend (like Brownout's fallback server) decodes by the
    # header: a Content-Encoding that lies about the bytes is its 500.
    body = await request.read()
    return _answer("primary" if json.loads(body) else "?")


@pytest.fixture
async def two_backends(
    fake_upstream: FakeUpstream,
) -> AsyncIterator[tuple[FakeUpstream, FakeUpstream]]:
    fallback = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fallback.dispatch)
    runner = await _start(app, fallback.port)
    fake_upstream.handlers["/v1/chat/completions"] = _strict
    fallback.handlers["/v1/chat/completions"] = _strict
    yield fake_upstream, fallback
    await runner.cleanup()


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("GZIP", gzip.compress),
    ],
)
async def test_encoded_bodies_leave_both_breakers_closed(
    two_backends: tuple[FakeUpstream, FakeUpstream],
    start_proxy: ProxyFactory,
    coding: str,
    encode: Callable[[bytes], bytes],
) -> None:
    primary, fallback = two_backends
    proxy = await start_proxy(make_policy(primary.url, fallback.url))
    sent = encode(BODY)
    for _ in range(6):
        resp = await raw_request(
            proxy.url,
            "POST",
            CHAT,
            [(b"Content-Encoding", coding.encode()), (b"Content-Type", b"application/json")],
            sent,
        )
        assert resp.status == 200, resp.body
        assert resp.json()["choices"][0]["message"]["content"] == "primary"
    rt = proxy.app[STATE].current
    assert {n: u.breaker.state for n, u in rt.upstreams.items()} == {
        "primary": "closed",
        "fallback": "closed",
    }
    assert rt.tier == "normal"
    # What the backend got: the decoded bytes, and no header describing others.
    calls = [(h, b) for p, h, b in primary.requests if p == "/v1/chat/completions"]
    assert len(calls) == 6
    for headers, body in calls:
        assert "Content-Encoding" not in headers
        assert int(headers["Content-Length"]) == len(body)
        assert json.loads(body) == json.loads(BODY)


async def test_pass_through_bodies_are_forwarded_decoded(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers["/v1/embeddings"] = _strict
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(
        proxy.url, "POST", b"/v1/embeddings", [(b"Content-Encoding", b"gzip")], gzip.compress(BODY)
    )
    assert resp.status == 200, resp.body
    (headers, body) = next((h, b) for p, h, b in fake_upstream.requests if p == "/v1/embeddings")
    assert "Content-Encoding" not in headers
    assert body == BODY


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ([(b"Content-Encoding", b"gzip")], b"not gzip at all", 400, "invalid_body"),
        ([(b"Content-Encoding", b"compress")], BODY, 415, "unsupported_content_encoding"),
        ([(b"Content-Encoding", b"gzip, gzip")], BODY, 415, "unsupported_content_encoding"),
    ],
    ids=["corrupt-gzip", "compress", "double"],
)
async def test_bodies_the_proxy_cannot_decode_are_refused(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    status: int,
    code: str,
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url))
    for target in (CHAT, b"/v1/embeddings"):
        resp = await raw_request(proxy.url, "POST", target, headers, body)
        assert_openai_error(resp, status, code)
    assert forwarded(fake_upstream) == []


async def test_a_gzip_bomb_is_a_413(fake_upstream: FakeUpstream, start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url))
    bomb = gzip.compress(b"{" + b" " * (8 * 1024 * 1024))  # 8 MiB inflated, ~8 KiB sent
    resp = await raw_request(proxy.url, "POST", CHAT, [(b"Content-Encoding", b"gzip")], bomb)
    assert_openai_error(resp, 413, "request_too_large")


async def test_hop_by_hop_and_connection_named_headers_stay_here(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers["/v1/chat/completions"] = _strict
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await raw_request(
        proxy.url,
        "POST",
        CHAT,
        [
            (b"Connection", b"close, X-Hop"),
            (b"X-Hop", b"1"),
            (b"Keep-Alive", b"timeout=5"),
            (b"TE", b"trailers"),
            (b"Proxy-Authorization", b"Basic eA=="),
            (b"X-Priority", b"normal"),
            (b"X-Custom", b"kept"),
        ],
        BODY,
    )
    assert resp.status == 200
    headers = next(h for p, h, _b in fake_upstream.requests if p == "/v1/chat/completions")
    for gone in ("X-Hop", "Keep-Alive", "TE", "Proxy-Authorization", "X-Priority"):
        assert gone not in headers, gone
    assert headers["X-Custom"] == "kept"
    assert headers["Accept-Encoding"] == "identity"
