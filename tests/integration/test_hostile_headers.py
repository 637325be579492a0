"""Header bytes that are not UTF-8 (aiohttp hands them over surrogate-escaped):
never a plain-text 500."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from proxy.policy import parse_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, make_policy

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
).encode()


async def raw_request(url: str, head: bytes, body: bytes = BODY) -> tuple[bytes, bytes]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        head + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status, _, rest = data.partition(b"\r\n")
    return status, rest.partition(b"\r\n\r\n")[2]


async def test_a_session_request_with_a_non_utf8_bearer_is_served(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}
        )

    fake_upstream.handlers["/v1/chat/completions"] = answer
    proxy = await start_proxy(make_policy(fake_upstream.url))
    status, body = await raw_request(
        proxy.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer k\xff\r\nX-Session-Id: abc\r\n",
    )
    # Used to be a plain-text 500 (UnicodeEncodeError hashing the key's scope);
    # the ingress now refuses the header with an OpenAI error object, and the
    # session key's scope no longer raises for such a key either.
    assert status == b"HTTP/1.1 400 Bad Request", body
    assert json.loads(body)["error"]["code"] == "invalid_header"


async def test_an_admin_request_with_a_non_utf8_bearer_is_refused_with_json(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(
        parse_policy(
            "server:\n  admin_token: s3cret\n"
            f"backends:\n  primary:\n    url: {fake_upstream.url}\n",
            env={},
        )
    )
    status, body = await raw_request(
        proxy.url, b"POST /brownout/reload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s\xff\r\n"
    )
    assert status == b"HTTP/1.1 400 Bad Request", body
    assert json.loads(body)["error"]["code"] == "invalid_header"
