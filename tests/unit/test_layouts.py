"""`proxy.runtime.layouts`: aiohttp's per-request objects keep the compact
attribute layout whatever ran first (issue 21: the +1.4 % an idle rollout
seemed to cost was response writers with a dictionary each, after the
candidate's health probes had made the class's first few dozen writers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh interpreter: the layouts are settled by the first instances.
SCRIPT = r"""
import asyncio, gc, json, sys
from aiohttp import ClientSession, ClientTimeout, web
if sys.argv[1] == "settle":
    from proxy.runtime.layouts import settle_layouts
    settle_layouts()
    settle_layouts()  # idempotent

def own_dict(o):
    # An instance with a dictionary of its own refers to it and its type only.
    refs = gc.get_referents(o)
    return len(refs) == 2 and type(refs[0]) is dict and len(refs[0]) > 2

SSE = b"data: {}\n\n" * 4 + b"data: [DONE]\n\n"

async def upstream(reader, writer):
    # A backend (not aiohttp: only the proxy's side makes aiohttp objects).
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST"):
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(SSE), SSE))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

seen = {"server_writer": [], "client_response": []}

async def main():
    up = await asyncio.start_server(upstream, "127.0.0.1", 0)
    base = "http://127.0.0.1:%d" % up.sockets[0].getsockname()[1]
    session = ClientSession()
    for _ in range(60):  # health probes before the first request
        async with session.get(base + "/health", timeout=ClientTimeout(total=5)) as r:
            await r.read()

    async def relay(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with session.post(base + "/v1/chat/completions", json={"a": 1}) as r:
            seen["client_response"].append(own_dict(r))
            async for data in r.content.iter_any():
                await resp.write(data)
        seen["server_writer"].append(own_dict(request._payload_writer))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with ClientSession() as client:
        for _ in range(5):
            async with client.post("http://127.0.0.1:%d/v1/chat/completions" % port, json={}) as r:
                await r.read()
    await runner.cleanup()
    await session.close()
    up.close()

asyncio.run(main())
print(json.dumps({k: sum(v) for k, v in seen.items()}))
"""


def run(mode: str) -> tuple[dict[str, int], str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        env={
            **os.environ,
            "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's layouts")
def test_settled_layouts_keep_the_request_path_objects_compact() -> None:
    """After a minute of probes, streamed requests' writers and the backend
    responses still share their class's layout (no dictionary each), and the
    throwaway instances leave no warning behind."""
    counts, err = run("settle")
    assert counts == {"server_writer": 0, "client_response": 0}
    assert "Exception ignored" not in err and "Unclosed" not in err


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="CPython 3.11's shared keys")
def test_without_them_probes_first_leave_every_writer_a_dictionary() -> None:
    """The mechanism (CPython 3.11): what the first few dozen instances did
    not set, later ones keep in a dictionary of their own."""
    counts, _ = run("plain")
    assert counts["server_writer"] == 5
