"""The floor: a bare aiohttp + uvloop streaming relay with no features.

python bench/bare_relay.py UPSTREAM_URL PORT
"""

import sys

import aiohttp
import uvloop
from aiohttp import web

UPSTREAM, PORT = sys.argv[1], int(sys.argv[2])


async def relay(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    body = await request.read()
    async with session.post(
        UPSTREAM + request.path, data=body, headers={"Content-Type": "application/json"}
    ) as up:
        resp = web.StreamResponse(
            status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")}
        )
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        return resp


async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app["session"].close()


app = web.Application()
app.cleanup_ctx.append(session_ctx)
app.router.add_post("/{tail:.*}", relay)
web.run_app(
    app, host="127.0.0.1", port=PORT, access_log=None, print=None, loop=uvloop.new_event_loop()
)
