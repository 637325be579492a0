"""A malformed request head costs one warning-level log line, no traceback
(issue 20): `brownout serve` as a real process, raw bytes on a socket, its
stderr read back.

Before, aiohttp's parser refusals were logged by `aiohttp.server` at error
level as `Error handling request from ...` with the whole traceback, on top of
Brownout's own `request_rejected` line: anyone able to open a connection could
fill the logs with tracebacks and page whoever alerts on error lines.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.integration.conftest import free_port
from tests.integration.test_cli_serve import _serve, _stop

# What a client can get wrong before the app sees a request, one head each.
MALFORMED = {
    "bad-method": b"GARBAGE\r\n\r\n",
    "tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
    "bad-version": b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    "nul-in-header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x00b\r\n\r\n",
    "bare-lf": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\nX-B: b\r\n\r\n",
    "space-in-name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n",
    "no-colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "long-header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 10_000 + b"\r\n\r\n",
    "long-target": b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad-length": b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "two-lengths": (
        b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"
    ),
}


async def _send(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.slow
async def test_each_malformed_head_is_one_warning_line_without_traceback(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("backends:\n  primary:\n    url: http://127.0.0.1:9\n")
    port = free_port()
    proc = await _serve(policy, port)
    ids: dict[str, str] = {}
    try:
        for name, head in MALFORMED.items():
            reply = await _send(port, head)
            top, _, body = reply.partition(b"\r\n\r\n")
            lines = top.decode("latin-1").split("\r\n")
            assert lines[0].split()[1] == "400", (name, reply[:300])
            headers = dict(line.split(": ", 1) for line in lines[1:])
            assert json.loads(body)["error"]["code"] == "bad_request", name
            ids[name] = headers["X-Request-Id"]
    finally:
        records = _stop(proc)

    # Nothing at error level, no traceback, nothing from aiohttp's loggers.
    assert [r for r in records if r.get("level") in ("error", "critical")] == []
    assert [r for r in records if "exception" in r or "Traceback" in json.dumps(r)] == []
    assert [r for r in records if str(r.get("logger", "")).startswith("aiohttp")] == []
    # One warning line per head, carrying the id its client got back.
    refused = [r for r in records if r.get("event") == "request_rejected"]
    assert len(refused) == len(MALFORMED), refused
    for name, rid in ids.items():
        [line] = [r for r in refused if r["request_id"] == rid]
        assert line["level"] == "warning", (name, line)
        assert line["status"] == 400 and line["reason"] == "bad_request"
        assert line["error"] and line["detail"], (name, line)
        assert len(line["detail"]) <= 200
