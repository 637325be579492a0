"""The live status page: `GET /brownout/` and its event stream `GET /brownout/events`.

The page is one self-contained HTML file (`proxy/static/status.html`: inline
CSS and JS, no external assets, no build step), read once when the app is
built and served with a Content-Security-Policy that allows nothing but its
own inline script and style (pinned by hash) and requests to its own origin.

`/brownout/events` is a Server-Sent Events stream of `event: status` messages:
the JSON of `/brownout/status` plus `series`, a short time series kept by a
per-app sampler (`cleanup_ctx`):

    every interval_s (1 s)   one point: requests/s, errors/s, TTFT p50/p95
                             (from the deltas of the `brownout_ttft_seconds`
                             histogram over the last ttft_window_s), in-flight,
                             limit, queue, tier — kept for window_s (10 min)
    every watch_s (0.1 s)    a cheap fingerprint of tier, forced tier, last
                             transition, ramp and backend health/breakers; a
                             change is pushed at once instead of at the next tick

A client gets the whole series on connect, then only the new points. Comment
lines (`: ping`) go out every heartbeat_s so idle proxies keep the stream.
At most `server.max_event_watchers` streams are open at once (each costs
every push); one more gets a 503 OpenAI error with `Retry-After` before any
stream byte, and a slot frees as soon as a watcher leaves.
Streams end when the client leaves or the app shuts down (`on_shutdown`, so a
shutdown never waits for an open page).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from importlib import resources

from aiohttp import web

from proxy import __version__
from proxy.errors import error_response
from proxy.openai.headers import SSE_HEADERS
from proxy.ops.rollout import rollout_status
from proxy.ops.statusseries import Series
from proxy.runtime.keys import STATE
from proxy.runtime.state import ProxyState

_STATIC_PACKAGE = "proxy"
_PAGE_PATH = ("static", "status.html")
_INLINE_RE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)

_JSON_SEPARATORS = (",", ":")


@dataclass(frozen=True, slots=True)
class Page:
    """The HTML and the headers it is served with, computed once."""

    body: bytes
    headers: dict[str, str]


def load_page() -> Page:
    """Read the page from the package and pin its inline script and style by hash."""
    ref = resources.files(_STATIC_PACKAGE).joinpath(*_PAGE_PATH)
    text = ref.read_text(encoding="utf-8")
    return Page(text.encode("utf-8"), {**_PAGE_HEADERS, "Content-Security-Policy": csp_for(text)})


def csp_for(html: str) -> str:
    """A policy that allows only the page's own inline blocks (by SHA-256) and
    connections to its own origin; everything else is refused."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for kind, content in _INLINE_RE.findall(html):
        digest = base64.b64encode(hashlib.sha256(content.encode("utf-8")).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    script = " ".join(hashes["script"]) or "'none'"
    style = " ".join(hashes["style"]) or "'none'"
    return (
        "default-src 'none'; "
        f"script-src {script}; "
        f"style-src {style}; "
        "img-src data:; "
        "connect-src 'self'; "
        "base-uri 'none'; "
        "form-action 'none'; "
        "frame-ancestors 'none'"
    )


_PAGE_HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

_EVENT_HEADERS = {**SSE_HEADERS, "X-Content-Type-Options": "nosniff"}
# A full house: come back after this long (a page left open holds its slot
# until it is closed; a reload of the page frees and retakes one at once).
WATCHERS_RETRY_AFTER_S = 10


# -- the per-app state ---------------------------------------------------------------


@dataclass
class StatusPage:
    page: Page
    series: Series
    watch_s: float = 0.1
    heartbeat_s: float = 15.0
    clients: int = 0
    seq: int = 0  # bumped on every push (tick or change); streams wait for it to move
    closing: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The last push's event, per series cursor: every watcher woken by one
    # push shares one JSON encoding (it was one per watcher per push).
    _shared: tuple[int, int, bytes, int] | None = None

    def admit(self, cap: int) -> bool:
        """Take a watcher slot if one of `cap` is free (no await between the
        check and the count: concurrent connects cannot both take the last)."""
        if self.clients >= cap:
            return False
        self.clients += 1
        return True

    def push(self) -> None:
        """Wake every stream (a new point, a change, or shutdown)."""
        self.seq += 1
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def pushed_event(self, state: ProxyState, cursor: int) -> tuple[bytes, int]:
        """`status_event` for a watcher woken by the current push, built once
        per push and cursor (watchers that have all points share it)."""
        shared = self._shared
        if shared is not None and shared[0] == self.seq and shared[1] == cursor:
            return shared[2], shared[3]
        payload, new_cursor = status_event(state, self, cursor)
        self._shared = (self.seq, cursor, payload, new_cursor)
        return payload, new_cursor

    async def wait_push(self, seen: int) -> None:
        """Return once `seq` has moved past `seen` (at once while closing)."""
        if self.seq == seen and not self.closing:
            await self._changed.wait()


STATUS_PAGE: web.AppKey[StatusPage] = web.AppKey("status_page", StatusPage)


def fingerprint(state: ProxyState) -> Hashable:
    """What, when it changes, is worth pushing before the next tick."""
    rt = state.current
    lad = rt.ladder
    last = lad.history[-1] if lad.history else None
    ramp = lad.ramp
    canary = rt.canary
    return (
        id(rt),
        lad.tier,
        lad.forced,
        None if last is None else (last.at, last.to_tier, last.reason),
        None if ramp is None else (ramp.target, ramp.step),
        tuple(
            (
                name,
                up.breaker.state,
                up.health.healthy,
                up.down,
                tuple((m, b.state) for m, b in up.model_breakers.items()),
                up.probe_misconfigured,
            )
            for name, up in rt.upstreams.items()
        ),
        rt.pressure.active,
        None
        if canary is None
        else (
            canary.rollout.state,
            canary.rollout.step,
            canary.rollout.failed_gate,
            len(canary.bundles),
            canary.bundle_error,
        ),
    )


def status_event(state: ProxyState, sp: StatusPage, cursor: int | None) -> tuple[bytes, int]:
    """One `event: status` message, and the series cursor the client is now at.
    `cursor` None = the client has nothing yet: it gets the whole series."""
    body = state.status()
    body["version"] = __version__
    body["now"] = round(time.time(), 3)
    # The page shows its operator panel only when the admin endpoints answer.
    body["admin"] = {"enabled": bool(state.current.policy.server.admin_token)}
    # The rollout panel: shown only with a candidate (`configured`), with its health.
    body["rollout"] = rollout_status(state.current)
    body["series"] = {
        "interval_s": sp.series.interval_s,
        "window_s": sp.series.window_s,
        "reset": cursor is None,
        "points": sp.series.since(cursor),
    }
    data = json.dumps(body, separators=_JSON_SEPARATORS, default=str)
    return b"event: status\ndata: " + data.encode("utf-8") + b"\n\n", sp.series.total


# -- handlers ------------------------------------------------------------------------


async def page(request: web.Request) -> web.Response:
    p = request.app[STATUS_PAGE].page
    return web.Response(body=p.body, headers=p.headers)


async def page_redirect(request: web.Request) -> web.Response:
    # Relative, so the page also works under a path prefix behind a reverse proxy.
    raise web.HTTPMovedPermanently(location="brownout/")


async def events(request: web.Request) -> web.StreamResponse:
    sp = request.app[STATUS_PAGE]
    state = request.app[STATE]
    cap = state.current.policy.server.max_event_watchers
    if not sp.admit(cap):
        return error_response(
            503,
            f"too many status page watchers ({cap}, server.max_event_watchers); "
            f"retry after {WATCHERS_RETRY_AFTER_S} s",
            type_="server_error",
            code="too_many_watchers",
            headers={"Retry-After": str(WATCHERS_RETRY_AFTER_S), "Cache-Control": "no-store"},
        )
    loop = asyncio.get_running_loop()
    try:
        resp = web.StreamResponse(headers=_EVENT_HEADERS)
        await resp.prepare(request)
        # Reconnect after 1 s when the stream breaks; the page shows "disconnected".
        await resp.write(b"retry: 1000\n\n")
        seen = sp.seq
        payload, cursor = status_event(state, sp, None)
        await resp.write(payload)
        next_ping = loop.time() + sp.heartbeat_s
        while True:
            try:
                async with asyncio.timeout_at(next_ping):
                    await sp.wait_push(seen)
            except TimeoutError:
                pass
            if sp.closing:
                break
            if sp.seq != seen:
                seen = sp.seq
                payload, cursor = sp.pushed_event(state, cursor)
                await resp.write(payload)
            if loop.time() >= next_ping:
                await resp.write(b": ping\n\n")
                next_ping = loop.time() + sp.heartbeat_s
    except ConnectionResetError:
        pass  # the client left (aiohttp's ClientConnectionResetError is one)
    finally:
        sp.clients -= 1
    return resp


# -- lifecycle -----------------------------------------------------------------------


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    state, sp = app[STATE], app[STATUS_PAGE]
    task = state.supervisor.start("status_page", lambda: _sample_forever(state, sp))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _sample_forever(state: ProxyState, sp: StatusPage) -> None:
    loop = asyncio.get_running_loop()
    seen = fingerprint(state)
    next_sample = loop.time()
    while True:
        now = loop.time()
        if now >= next_sample:
            sp.series.sample(state.metrics, state, time.time())
            next_sample += sp.series.interval_s
            if next_sample <= now:  # the loop was stalled: skip, do not catch up
                next_sample = now + sp.series.interval_s
            seen = fingerprint(state)
            sp.push()
        else:
            fp = fingerprint(state)
            if fp != seen:
                seen = fp
                sp.push()
        await asyncio.sleep(min(sp.watch_s, max(0.0, next_sample - loop.time())))


async def _close_streams(app: web.Application) -> None:
    sp = app[STATUS_PAGE]
    sp.closing = True
    sp.push()


def setup_status_page(
    app: web.Application,
    *,
    interval_s: float = 1.0,
    window_s: float = 600.0,
    ttft_window_s: float = 10.0,
    watch_s: float = 0.1,
    heartbeat_s: float = 15.0,
) -> None:
    """Add `GET /brownout/` (and `/brownout` → `/brownout/`) and `GET /brownout/events`.

    Calling it again before the app starts only replaces the settings (routes
    and the sampler are added once), so a test can tune the intervals of an
    app whose factory already set the page up."""
    first = STATUS_PAGE not in app
    app[STATUS_PAGE] = StatusPage(
        page=load_page(),
        series=Series(interval_s=interval_s, window_s=window_s, ttft_window_s=ttft_window_s),
        watch_s=watch_s,
        heartbeat_s=heartbeat_s,
    )
    if not first:
        return
    app.cleanup_ctx.append(_sampler)
    app.on_shutdown.append(_close_streams)
    app.router.add_get("/brownout", page_redirect)
    app.router.add_get("/brownout/", page)
    app.router.add_get("/brownout/events", events)
