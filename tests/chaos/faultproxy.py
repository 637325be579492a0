"""Drill 9's candidate engine: a fault proxy in front of a real one.

    brownout ─► fault proxy (this module, its own process) ─► vLLM

Healthy, it forwards every request to the real engine and relays the answer
(streams event by event, as the engine wrote them), so the candidate's
answers, TTFTs and streams are a real engine's. Told to degrade
(`POST /_fault {"mode": "oom"}`), it plays an engine that ran out of memory
under the load of a larger rollout step:

- each stream it is relaying ends with the error event vLLM sends its open
  streams when its engine core fails (`EngineCore encountered an issue`),
  then `[DONE]` — at its next event once it has relayed `cut_after` events
  (16 unless the POST says otherwise), so that the cut lands mid-answer:
  on a CPU an answer's tokens come in one short burst after a long prefill,
  and a cut "at the next event" would almost always fall before the first
  token (a failure before the first byte, which new requests already show);
- each new generation request (`/v1/chat/completions`, `/v1/completions`)
  is answered 500 with a CUDA out-of-memory error body — a failure before
  the first byte;
- everything else (`/health`, `/metrics`, `/v1/models`) still passes: the
  API server is up and says so, only its answers show the fault (the
  hardest case for a gate: no health probe sees it).

`"wait_streams": N` (with `"limit_s"`) holds the switch until N generation
requests are in flight that have not yet relayed `cut_after` events — so
the fault finds streams to cut, decided inside this process, without the
race of a separate look; past `limit_s` it switches anyway.
`POST /_fault {"mode": "healthy"}` ends it. `GET /_fault` returns the mode,
when it last changed, the generation requests in flight, and every one seen:
arrival time, `X-Request-Id`, what became of it (`passed`, `oom`, `cut`,
`upstream_error`), the time it failed, the events it relayed, when it ended.

    python -m tests.chaos.faultproxy --upstream http://127.0.0.1:8000 --port 9000

Only the standard library and aiohttp: the process starts in about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

__all__ = ["ENGINE_ERROR", "GENERATION", "MODES", "OOM_ERROR", "FaultProxy", "Seen", "main"]

Mode = Literal["healthy", "oom"]
MODES: tuple[Mode, ...] = ("healthy", "oom")
GENERATION = frozenset({"/v1/chat/completions", "/v1/completions"})

# What vLLM and torch say (the bodies the proxy's attribution recognises as
# out-of-memory and as engine death: proxy/control/attribution.py).
OOM_ERROR: dict[str, Any] = {
    "error": {
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.77 GiB total "
        "capacity; 14.92 GiB already allocated; 312.00 MiB free)",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
ENGINE_ERROR: dict[str, Any] = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
CUT_AFTER = 16  # events a stream relays before a degraded engine cuts it

_HOP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
)


@dataclass
class Seen:
    """One generation request as the fault proxy saw it (wall-clock seconds)."""

    at: float
    request_id: str
    path: str
    action: Literal["passed", "oom", "cut", "upstream_error"] = "passed"
    failed_at: float | None = None
    events: int = 0  # SSE events relayed (a stream)
    ended: float | None = None


class FaultProxy:
    def __init__(self, upstream: str, clock: Callable[[], float] = time.time) -> None:
        self.upstream = upstream.rstrip("/")
        self.clock = clock
        self.mode: Mode = "healthy"
        self.cut_after = CUT_AFTER
        self.changed_at: float | None = None
        self.seen: list[Seen] = []
        self._arrived = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/_fault", self.get_fault)
        app.router.add_post("/_fault", self.set_fault)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )

    async def _close(self, _: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    # -- control ---------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "cut_after": self.cut_after,
            "changed_at": self.changed_at,
            "inflight": sum(1 for s in self.seen if s.ended is None),
            "seen": [asdict(s) for s in self.seen],
        }

    async def get_fault(self, _: web.Request) -> web.Response:
        return web.json_response(self.report())

    async def set_fault(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            mode, cut_after = body.get("mode"), body.get("cut_after", CUT_AFTER)
            wait, limit_s = body.get("wait_streams", 0), body.get("limit_s", 10)
        except (ValueError, AttributeError):
            mode = cut_after = wait = limit_s = None
        if (
            mode not in MODES
            or not isinstance(cut_after, int)
            or cut_after < 0
            or not isinstance(wait, int)
            or not isinstance(limit_s, int | float)
        ):
            return web.json_response(
                {
                    "error": f"expected mode (one of {MODES}) and optionally cut_after "
                    "(events), wait_streams (count), limit_s (seconds)"
                },
                status=400,
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(float(limit_s)):
                while self._early(cut_after) < wait:
                    self._arrived.clear()
                    await self._arrived.wait()  # only an arrival adds one
        early = self._early(cut_after)
        self.mode, self.cut_after = mode, cut_after
        self.changed_at = self.clock()
        return web.json_response({"mode": self.mode, "at": self.changed_at, "early": early})

    def _early(self, cut_after: int) -> int:
        """Generation requests in flight that have relayed fewer than `cut_after` events."""
        return sum(1 for s in self.seen if s.ended is None and s.events < cut_after)

    # -- the proxy --------------------------------------------------------------------

    def _fail(self, seen: Seen, action: Literal["oom", "cut", "upstream_error"]) -> None:
        seen.action = action
        seen.failed_at = self.clock()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        seen: Seen | None = None
        if request.method == "POST" and request.path in GENERATION:
            seen = Seen(self.clock(), request.headers.get("X-Request-Id", ""), request.path)
            self.seen.append(seen)
            self._arrived.set()
        # Decided on arrival: a request that came before the switch is under way.
        refuse = seen is not None and self.mode == "oom"
        try:
            return await self._forward(request, seen, refuse)
        finally:
            if seen is not None:
                seen.ended = self.clock()

    async def _forward(
        self, request: web.Request, seen: Seen | None, refuse: bool
    ) -> web.StreamResponse:
        body = await request.read()
        if seen is not None and refuse:
            self._fail(seen, "oom")
            return web.json_response(OOM_ERROR, status=500)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert self._http is not None
        try:
            async with self._http.request(
                request.method,
                self.upstream + request.path_qs,
                data=body,
                headers=headers,
                allow_redirects=False,
            ) as up:
                ctype = up.headers.get("Content-Type", "")
                if not ctype.startswith("text/event-stream"):
                    data = await up.read()
                    if seen is not None and self.mode == "oom":
                        self._fail(seen, "oom")  # the answer was lost with the engine
                        return web.json_response(OOM_ERROR, status=500)
                    kept = {"Content-Type": ctype} if ctype else {}
                    return web.Response(status=up.status, body=data, headers=kept)
                return await self._relay(request, up, seen)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if seen is not None:
                self._fail(seen, "upstream_error")
            return web.json_response(
                {"error": {"message": f"fault proxy: {type(exc).__name__}", "code": 502}},
                status=502,
            )

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientResponse, seen: Seen | None
    ) -> web.StreamResponse:
        """The engine's stream, one whole SSE event at a time (so a cut never
        splits one); degraded, the engine's error instead of the next event
        once `cut_after` events went through."""
        resp = web.StreamResponse(
            status=up.status,
            headers={"Content-Type": up.headers["Content-Type"], "Cache-Control": "no-cache"},
        )
        await resp.prepare(request)
        buf = b""
        try:
            async for chunk in up.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if self.mode == "oom" and (seen is None or seen.events >= self.cut_after):
                        if seen is not None:
                            self._fail(seen, "cut")
                        await resp.write(
                            b"data: " + json.dumps(ENGINE_ERROR).encode() + b"\n\ndata: [DONE]\n\n"
                        )
                        await resp.write_eof()
                        return resp  # leaving the block closes the engine's stream
                    await resp.write(event + b"\n\n")
                    if seen is not None:
                        seen.events += 1
            if buf:
                await resp.write(buf)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientError):
            pass  # the proxy went away (its client left), or the engine did
        return resp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the real engine's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    web.run_app(
        FaultProxy(args.upstream).app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
