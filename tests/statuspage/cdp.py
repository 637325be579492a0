"""Headless Chromium driven over the Chrome DevTools Protocol (aiohttp websockets).

No browser automation package: Debian's `chromium` is started with
`--remote-debugging-port=0`, the port is read from `DevToolsActivePort` in its
profile directory, and the page target's websocket takes JSON commands.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
)


class CDPError(Exception):
    pass


def find_chromium() -> str | None:
    """Debian's chromium (`apt-get install -y chromium`), or BROWNOUT_CHROMIUM."""
    env = os.environ.get("BROWNOUT_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("chromium")
    if found:
        return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@dataclass
class Page:
    """One page target: commands, events, and the few helpers the tests need."""

    ws: aiohttp.ClientWebSocketResponse
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self.ws.close()

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            self.events.append(data)
            self._note_problem(data)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(CDPError("the browser closed the DevTools connection"))

    def _note_problem(self, ev: dict[str, Any]) -> None:
        """Page errors, console errors and CSP violations: a test asserts none."""
        method, params = ev.get("method"), ev.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            self.problems.append(f"exception: {d.get('exception', {}).get('description') or d}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.problems.append(f"console.error: {params.get('args')}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                self.problems.append(f"log {entry.get('source')}: {entry.get('text')}")

    async def send(self, method: str, within: float = 10.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(within):
            reply = await fut
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        r = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise CDPError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def text(self, selector: str) -> str:
        value = await self.evaluate(
            f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent ?? null"
        )
        return "" if value is None else str(value)

    async def wait_for(
        self, expression: str, check: Callable[[Any], bool], what: str, within: float = 5.0
    ) -> tuple[Any, float]:
        """Poll `expression` until `check(value)`; returns (value, seconds waited)."""
        t0 = time.monotonic()
        value: Any = None
        while time.monotonic() - t0 < within:
            value = await self.evaluate(expression)
            if check(value):
                return value, time.monotonic() - t0
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {within}s waiting for {what}; last value {value!r}")

    async def wait_text(
        self, selector: str, check: Callable[[str], bool], what: str, within: float = 5.0
    ) -> tuple[str, float]:
        expr = f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent ?? ''"
        value, waited = await self.wait_for(expr, lambda v: check(str(v)), what, within)
        return str(value), waited

    async def navigate(self, url: str, within: float = 10.0) -> None:
        start = len(self.events)
        r = await self.send("Page.navigate", url=url)
        if r.get("errorText"):
            raise CDPError(f"navigating to {url}: {r['errorText']}")
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any(e.get("method") == "Page.loadEventFired" for e in self.events[start:]):
                return
            await asyncio.sleep(0.05)
        raise CDPError(f"{url} did not load within {within}s")

    async def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element."""
        rect = await self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = rect
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
            )

    async def type_into(self, selector: str, text: str) -> None:
        """Focus the field and type, as a keyboard would."""
        await self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.focus(); e.select && e.select(); })()"
        )
        await self.send("Input.insertText", text=text)

    async def screenshot(self, path: Path) -> None:
        """The whole page (not just the viewport) as PNG."""
        m = await self.send("Page.getLayoutMetrics")
        size = m.get("cssContentSize") or m["contentSize"]
        shot = await self.send(
            "Page.captureScreenshot",
            within=30.0,
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def chromium(
    executable: str, profile: Path, width: int = 1440, height: int = 1000
) -> AsyncIterator[Page]:
    """Start headless Chromium and yield its page, closed and killed on exit."""
    profile.mkdir(parents=True, exist_ok=True)
    log_path = profile / "chromium.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            executable,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--window-size={width},{height}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    session = aiohttp.ClientSession()
    page: Page | None = None
    try:
        port = await _devtools_port(profile, proc, log_path)
        page_ws = await _page_websocket(session, port)
        page = Page(await session.ws_connect(page_ws, max_msg_size=0))
        page.start()
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        yield page
    finally:
        if page is not None:
            await page.close()
        await session.close()
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _devtools_port(profile: Path, proc: asyncio.subprocess.Process, log: Path) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            break
        if marker.exists():
            first = marker.read_text().splitlines()[:1]
            if first and first[0].isdigit():
                return int(first[0])
        await asyncio.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise CDPError(
        f"chromium did not start its DevTools endpoint (exit {proc.returncode}):\n{tail}"
    )


async def _page_websocket(session: aiohttp.ClientSession, port: int) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        for t in targets:
            if t.get("type") == "page" and "webSocketDebuggerUrl" in t:
                url: str = t["webSocketDebuggerUrl"]
                return url
        await asyncio.sleep(0.1)
    raise CDPError("chromium has no page target")
