"""The request id in every log line of `brownout serve` (structlog
contextvars, bound once per request, never leaking into the next request of
a keep-alive connection), and `log_prompts: true` with a lone surrogate
(defect 6: the JSON log renderer cannot write one; it was a plain-text 500)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.integration.conftest import CHAT_BODY, FakeUpstream, free_port
from tests.integration.test_cli_serve import _serve, _stop


async def test_log_lines_carry_the_request_id_and_prompts_are_safe(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f"server:\n  log_prompts: true\nbackends:\n  primary:\n    url: {fake_upstream.url}\n"
    )
    port = free_port()
    proc = await _serve(policy, port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    ok = json.dumps({**CHAT_BODY, "stream": False}).encode()
    lone = b'{"messages": [{"role": "user", "content": "x\\ud800"}], "stream": true}'
    ids = []
    # One connection: the keep-alive requests share the connection's task.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        async with s.post(url, data=lone, headers={"X-Request-Id": "lone-1"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_json"
        async with s.post(url, data=ok, headers={"X-Request-Id": "ok-2"}) as resp:
            assert resp.status == 200
        async with s.post(url, data=ok) as resp:  # no id: a fresh one
            assert resp.status == 200
            ids.append(resp.headers["X-Request-Id"])
        async with s.get(f"http://127.0.0.1:{port}/v1/chat/completions") as resp:
            assert resp.status == 405
            ids.append(resp.headers["X-Request-Id"])
    records = _stop(proc)
    by_event: dict[str, list[dict[str, object]]] = {}
    for r in records:
        by_event.setdefault(str(r["event"]), []).append(r)
    assert [r["request_id"] for r in by_event["prompt"]] == ["ok-2", ids[0]]
    assert [r["request_id"] for r in by_event["request"]] == ["ok-2", ids[0]]
    rejected = [(r["request_id"], r["status"]) for r in by_event["request_rejected"]]
    assert rejected == [("lone-1", 400), (ids[1], 405)]
    assert ids[0] not in ("ok-2", "lone-1") and ids[1] != ids[0]
