"""The status page over real sockets: the HTML and its CSP, the event stream,
and the time series behind the chart."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from html.parser import HTMLParser
from typing import Any

import pytest

from proxy.ops import statuspage
from proxy.ops.statuspage import STATUS_PAGE, Series, csp_for, histogram_quantile, load_page
from proxy.policy import parse_policy
from proxy.runtime.state import ProxyState
from proxy.telemetry.metrics import Metrics
from tests.statuspage.conftest import (
    ADMIN,
    FakeLLM,
    StatusProxy,
    loads,
    read_events,
    start_status_proxy,
    status_policy,
)

# Elements the page must carry (tests and SREs' scripts find them by id).
PAGE_IDS = (
    "conn",
    "tier",
    "tier-reason",
    "tier-since",
    "tier-forced",
    "ramp",
    "inflight",
    "limit",
    "queue",
    "pressure",
    "signals",
    "backends",
    "timeline",
    "chart-ttft",
    "chart-rps",
    "admin-token",
    "admin-tier",
    "force-btn",
    "release-btn",
    "admin-result",
)


class _Scan(HTMLParser):
    """Ids, inline blocks and every URL-bearing attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.urls: list[tuple[str, str, str]] = []
        self.inline: dict[str, list[str]] = {"script": [], "style": []}
        self.style_attrs: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("src", "href", "action", "formaction", "srcset", "poster", "data"):
                self.urls.append((tag, name, value or ""))
            if name == "style" or name.startswith("on"):
                self.style_attrs.append(f"<{tag} {name}=...>")
        if tag in self.inline:
            self._in = tag
            self.inline[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == self._in:
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self.inline[self._in][-1] += data


def _sha(content: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(content.encode()).digest()).decode() + "'"


def _directives(csp: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in csp.split(";"):
        words = part.split()
        if words:
            out[words[0]] = words[1:]
    return out


async def _proxy(
    made: list[StatusProxy], upstream: str, interval_s: float = 1.0, **page: float
) -> StatusProxy:
    return await start_status_proxy(made, status_policy(upstream), interval_s, **page)


async def _next_status(events: Any, within: float = 3.0) -> dict[str, Any]:
    async with asyncio.timeout(within):
        async for kind, data in events:
            if kind == "status":
                return loads(data)
    raise AssertionError("the stream ended")


# -- the page ------------------------------------------------------------------------------


async def test_page_is_self_contained_with_strict_csp(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url)
    async with p.session.get(p.url + "/brownout/") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        csp = resp.headers["Content-Security-Policy"]
        html = await resp.text()

    d = _directives(csp)
    assert d["default-src"] == ["'none'"]
    assert d["connect-src"] == ["'self'"]
    assert d["img-src"] == ["data:"]  # the tier-colored favicon, nothing remote
    assert d["base-uri"] == ["'none'"] and d["form-action"] == ["'none'"]
    assert d["frame-ancestors"] == ["'none'"]
    for bad in ("'unsafe-inline'", "'unsafe-eval'", "http:", "https:", "*", "blob:"):
        assert bad not in csp.split(), csp

    scan = _Scan()
    scan.feed(html)
    # Exactly the page's own inline blocks are allowed, pinned by hash.
    assert len(scan.inline["script"]) == 1 and len(scan.inline["style"]) == 1
    assert d["script-src"] == [_sha(scan.inline["script"][0])]
    assert d["style-src"] == [_sha(scan.inline["style"][0])]
    # Nothing is loaded from anywhere: the only URL is the inline favicon.
    assert [(t, a) for t, a, v in scan.urls if not v.startswith("data:")] == []
    assert scan.style_attrs == []  # inline style/on* attributes would be blocked by the CSP
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", html)
    assert set(PAGE_IDS) <= scan.ids, set(PAGE_IDS) - scan.ids
    # The stream and the admin call are relative, so a path prefix keeps working.
    assert 'new EventSource("events")' in html
    assert 'fetch("tier"' in html
    assert "sessionStorage" in html and "localStorage" not in html


async def test_bare_path_redirects_to_the_page(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url)
    async with p.session.get(p.url + "/brownout", allow_redirects=False) as resp:
        assert resp.status == 301
        assert resp.headers["Location"] == "brownout/"
    async with p.session.get(p.url + "/brownout") as resp:
        assert resp.status == 200
        assert str(resp.url) == p.url + "/brownout/"
        assert "<title>" in await resp.text()
    async with p.session.head(p.url + "/brownout/") as resp:
        assert resp.status == 200


async def test_page_is_read_once_at_startup(
    llm: FakeLLM, status_proxies: list[StatusProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = await _proxy(status_proxies, llm.url)
    size = len(load_page().body)

    def no_files(*_a: object) -> None:
        raise AssertionError("file I/O on the request path")

    monkeypatch.setattr("importlib.resources.files", no_files)
    for _ in range(3):
        async with p.session.get(p.url + "/brownout/") as resp:
            assert resp.status == 200
            assert len(await resp.read()) == size


def test_csp_hashes_every_inline_block() -> None:
    html = "<style>a{}</style><script>x()</script><script>y()</script>"
    d = _directives(csp_for(html))
    assert d["script-src"] == [_sha("x()"), _sha("y()")]
    assert d["style-src"] == [_sha("a{}")]
    assert _directives(csp_for("<p>nothing inline</p>"))["script-src"] == ["'none'"]


# -- the event stream ----------------------------------------------------------------------


async def test_events_start_with_status_then_push_a_forced_tier_at_once(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    # A tick every 30 s: an event within a second can only be the change push.
    p = await _proxy(status_proxies, llm.url, interval_s=30.0)
    async with p.session.get(p.url + "/brownout/events") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers["X-Accel-Buffering"] == "no"
        events = read_events(resp)
        first = await _next_status(events)
        assert first["tier"] == "normal"
        assert first["ladder"]["forced"] is None
        assert set(first) >= {"backends", "concurrency", "pressure", "history", "series"}
        assert first["series"]["reset"] is True
        assert first["series"]["interval_s"] == 30.0
        assert first["version"]
        assert abs(first["now"] - time.time()) < 5

        t0 = time.monotonic()
        await p.force("maintenance")
        ev = await _next_status(events, within=2.0)
        while ev["tier"] != "maintenance":
            ev = await _next_status(events, within=2.0)
        assert time.monotonic() - t0 < 1.0
        assert ev["ladder"]["forced"] == "maintenance"
        assert [(h["from"], h["to"], h["reason"]) for h in ev["history"]] == [
            ("normal", "maintenance", "forced")
        ]
        assert ev["series"]["reset"] is False

        # Releasing changes no tier at once (the ladder steps down later) but
        # the forced flag, and that is pushed too.
        t0 = time.monotonic()
        await p.force(None)
        ev = await _next_status(events, within=2.0)
        while ev["ladder"]["forced"] is not None:
            ev = await _next_status(events, within=2.0)
        assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("admin", [True, False])
async def test_events_say_whether_the_admin_endpoints_answer(
    llm: FakeLLM, status_proxies: list[StatusProxy], admin: bool
) -> None:
    # The page shows its operator panel only when this is true.
    p = await start_status_proxy(status_proxies, status_policy(llm.url, admin=admin))
    async with p.session.get(p.url + "/brownout/events") as resp:
        first = await _next_status(read_events(resp))
    assert first["admin"] == {"enabled": admin}
    async with p.session.post(p.url + "/brownout/tier", json={"tier": None}, headers=ADMIN) as r:
        assert r.status == (200 if admin else 403)


async def test_events_carry_a_growing_series(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url, interval_s=0.2)
    for _ in range(3):
        assert await p.chat() == 200
    async with p.session.get(p.url + "/brownout/events") as resp:
        events = read_events(resp)
        await _next_status(events)
        seen: list[dict[str, Any]] = []
        traffic = asyncio.create_task(_chat_for(p, 1.2))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not any(pt["ttft_p50"] for pt in seen):
            ev = await _next_status(events)
            assert ev["series"]["reset"] is False
            seen.extend(ev["series"]["points"])
        await traffic
    ts = [pt["t"] for pt in seen]
    assert ts == sorted(set(ts)), "points are sent once each, oldest first"
    assert any(pt["rps"] > 0 for pt in seen)
    busy = [pt for pt in seen if pt["ttft_p50"] is not None]
    assert busy, seen
    # The fake answers its first token after 50-300 ms.
    assert all(0.025 <= pt["ttft_p50"] <= pt["ttft_p95"] <= 1.0 for pt in busy), busy
    assert {"inflight", "limit", "queued", "tier", "err_rps"} <= set(seen[-1])
    assert seen[-1]["limit"] == 16 and seen[-1]["tier"] == "normal"


async def _chat_for(p: StatusProxy, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.gather(*(p.chat() for _ in range(3)))


async def test_heartbeat_comments_keep_an_idle_stream(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url, interval_s=30.0, heartbeat_s=0.2)
    async with p.session.get(p.url + "/brownout/events") as resp:
        events = read_events(resp)
        await _next_status(events)
        async with asyncio.timeout(2):
            async for kind, data in events:
                if kind == "comment":
                    assert data == "ping"
                    break


async def test_stream_ends_when_the_client_leaves(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url, interval_s=0.1)
    assert p.app is not None
    sp = p.app[STATUS_PAGE]
    resps = [await p.session.get(p.url + "/brownout/events") for _ in range(3)]
    for r in resps:
        await _next_status(read_events(r))
    assert sp.clients == 3
    for r in resps:
        r.close()
    for _ in range(60):
        if not sp.clients:
            break
        await asyncio.sleep(0.05)
    assert sp.clients == 0


async def test_shutdown_does_not_wait_for_open_pages(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    p = await _proxy(status_proxies, llm.url)
    async with p.session.get(p.url + "/brownout/events") as resp:
        events = read_events(resp)
        await _next_status(events)
        t0 = time.monotonic()
        await p.stop()  # the runner's shutdown_timeout is 60 s
        assert time.monotonic() - t0 < 5
        async with asyncio.timeout(2):
            async for _ in events:
                pass  # the stream ends


async def test_admin_from_the_page_uses_the_existing_endpoint(
    llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    """What the page's Force/Release buttons send."""
    p = await _proxy(status_proxies, llm.url)
    url = p.url + "/brownout/tier"
    async with p.session.post(url, json={"tier": "throttle"}) as resp:
        assert resp.status == 401
    async with p.session.post(url, json={"tier": "throttle"}, headers=ADMIN) as resp:
        body = await resp.json()
        assert (resp.status, body["tier"]) == (200, "throttle")
    async with p.session.post(url, json={"tier": None}, headers=ADMIN) as resp:
        assert (await resp.json())["ladder"]["forced"] is None


# -- the series, unit ----------------------------------------------------------------------


def test_histogram_quantile_matches_prometheus() -> None:
    inf = float("inf")
    b = [(0.1, 0.0), (0.5, 50.0), (1.0, 90.0), (inf, 100.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.5)
    assert histogram_quantile(0.25, b) == pytest.approx(0.1 + 0.4 * 25 / 50)
    assert histogram_quantile(0.8, b) == pytest.approx(0.5 + 0.5 * 30 / 40)
    assert histogram_quantile(0.95, b) == pytest.approx(1.0)  # in +Inf: highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    # All in the first bucket: interpolated from 0.
    assert histogram_quantile(0.5, [(0.2, 10.0), (inf, 10.0)]) == pytest.approx(0.1)


def test_series_rates_and_windowed_ttft() -> None:
    metrics = Metrics()
    state = ProxyState(
        parse_policy("backends: {primary: {url: 'http://x:1'}}", "t"), metrics, time.monotonic
    )
    series = Series(interval_s=1.0, window_s=5.0, ttft_window_s=2.0)
    assert series.sample(metrics, state, 100.0) is None  # rates need two samples

    counter = metrics.requests.labels("primary", "chat", "200")
    ttft = metrics.ttft.labels("primary")
    counter.inc(4)
    metrics.requests.labels("primary", "chat", "503").inc(1)
    for v in (0.2, 0.2, 0.2, 3.0):
        ttft.observe(v)
    pt = series.sample(metrics, state, 101.0)
    assert pt is not None
    assert (pt["rps"], pt["err_rps"]) == (5.0, 1.0)
    assert 0.1 <= pt["ttft_p50"] <= 0.25 and 2.5 <= pt["ttft_p95"] <= 5.0
    assert (pt["limit"], pt["queued"], pt["inflight"], pt["tier"]) == (64, 0, 0, "normal")

    # No traffic: the TTFT window still covers the last observations...
    pt = series.sample(metrics, state, 102.0)
    assert pt is not None and pt["rps"] == 0 and pt["ttft_p50"] is not None
    # ...until they age out of it.
    pt = series.sample(metrics, state, 103.0)
    assert pt is not None and pt["ttft_p50"] is None and pt["ttft_p95"] is None

    for t in range(104, 120):
        series.sample(metrics, state, float(t))
    assert len(series.points) == 5  # bounded: window_s / interval_s
    assert series.total == 19  # 101..119: the first sample makes no point
    assert [p["t"] for p in series.since(17)] == [118.0, 119.0]
    assert series.since(19) == []
    assert [p["t"] for p in series.since(0)] == [115.0, 116.0, 117.0, 118.0, 119.0]
    assert len(series.since(None)) == 5
    # A wall-clock step back does not hide new points from a stream.
    series.sample(metrics, state, 50.0)
    assert [p["t"] for p in series.since(19)] == [50.0]


def test_two_apps_do_not_share_state() -> None:
    from proxy.app import create_app

    a = create_app(status_policy("http://127.0.0.1:9"))
    b = create_app(status_policy("http://127.0.0.1:9"))
    statuspage.setup_status_page(a)
    statuspage.setup_status_page(b)
    assert a[STATUS_PAGE] is not b[STATUS_PAGE]
    assert a[STATUS_PAGE].series is not b[STATUS_PAGE].series


def test_setting_up_twice_only_changes_the_settings() -> None:
    """The app factory may already call it; a test's own call then tunes it."""
    from proxy.app import create_app

    app = create_app(status_policy("http://127.0.0.1:9"))
    statuspage.setup_status_page(app)
    routes = len(app.router.routes())
    hooks = (len(app.cleanup_ctx), len(app.on_shutdown))
    statuspage.setup_status_page(app, interval_s=0.25, heartbeat_s=3.0)
    assert len(app.router.routes()) == routes
    assert (len(app.cleanup_ctx), len(app.on_shutdown)) == hooks
    assert app[STATUS_PAGE].series.interval_s == 0.25
    assert app[STATUS_PAGE].heartbeat_s == 3.0
