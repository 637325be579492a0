"""What aiohttp's HTTP parser refuses before the app runs (a request line
over 8 KiB, a `Content-Encoding: br` it cannot decode) is answered with an
OpenAI error object on the real listening path of `brownout serve`
(`proxy.server.start_site`), never aiohttp's plain text, and never reaches
the backend."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import structlog
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.server import start_site
from tests.integration.conftest import CHAT_BODY, FakeUpstream, free_port
from tests.integration.rawhttp import raw_request
from tests.integration.test_ingress import assert_openai_error, forwarded, make_policy

BODY = json.dumps({**CHAT_BODY, "stream": False}).encode()
JSON_CT = (b"Content-Type", b"application/json")


@pytest.fixture
async def served(fake_upstream: FakeUpstream) -> AsyncIterator[str]:
    app = create_app(make_policy(fake_upstream.url))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await start_site(runner, app, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        (b"/v1/models/" + b"a" * 16384, [JSON_CT]),
        (b"/v1/chat/completions", [JSON_CT, (b"Content-Encoding", b"br")]),
    ],
    ids=["16KiB-path", "content-encoding-br"],
)
async def test_parser_refusals_are_openai_errors(
    served: str, fake_upstream: FakeUpstream, target: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    with structlog.testing.capture_logs() as logs:
        resp = await raw_request(served, "POST", target, headers, BODY)
    err = assert_openai_error(resp, 400, "bad_request")
    assert err["type"] == "invalid_request_error"
    # One log line, with the id the client got back.
    [line] = [e for e in logs if e["event"] in ("request", "request_rejected")]
    assert line["event"] == "request_rejected" and line["status"] == 400
    assert line["request_id"] == resp.headers["x-request-id"]
    assert forwarded(fake_upstream) == []
    # Counted like every other refusal (before, Prometheus never saw them).
    async with aiohttp.ClientSession() as session, session.get(served + "/metrics") as m:
        families = {f.name: f for f in text_string_to_metric_families(await m.text())}
    [sample] = [
        s for s in families["brownout_requests"].samples if s.name == "brownout_requests_total"
    ]
    assert sample.labels == {"backend": "none", "endpoint": "unknown", "status": "400"}
    assert sample.value == 1
    [bad] = [s for s in families["brownout_bad_requests"].samples if s.name.endswith("_total")]
    assert bad.labels == {"reason": "bad_request"} and bad.value == 1
