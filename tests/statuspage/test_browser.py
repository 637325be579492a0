"""The status page in a real headless Chromium (Debian's `chromium` package):
it loads, goes live over SSE, follows tier changes made through the API and
through its own admin form without a reload, and reconnects after a restart.

The screenshot is kept as `test-artifacts/status-page.png`; it is copied to
`docs/status-page.png` (the README's picture) when that file is missing or
when `BROWNOUT_UPDATE_SCREENSHOT=1`, so a test run does not dirty the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.statuspage.cdp import Page, chromium, find_chromium
from tests.statuspage.conftest import (
    ADMIN_TOKEN,
    FakeLLM,
    StatusProxy,
    start_status_proxy,
    status_policy,
)

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "test-artifacts" / "status-page.png"
DOCS_SHOT = ROOT / "docs" / "status-page.png"

TIER = "document.getElementById('tier').textContent"
CONN = "document.getElementById('conn').textContent"

# Elements the page shows or hides depending on the state. Their `hidden`
# property says nothing about what is rendered (a CSS `display` rule beats the
# attribute), so the tests ask the layout: is the element drawn at all?
CONDITIONAL = ("#tier-forced", "#ramp", "#admin", "#stale-banner", "#rollout")
RENDERED = """(sel => {
  const e = document.querySelector(sel);
  if (!e) return null;
  const cs = getComputedStyle(e);
  return cs.display !== "none" && cs.visibility !== "hidden"
    && e.getClientRects().length > 0 && e.checkVisibility({visibilityProperty: true});
})"""


async def rendered(page: Page) -> dict[str, bool]:
    """Which conditional elements are drawn now (computed style and layout)."""
    shown: dict[str, bool] = {}
    for sel in CONDITIONAL:
        value = await page.evaluate(f"{RENDERED}({json.dumps(sel)})")
        assert value is not None, f"{sel} is missing from the page"
        shown[sel] = bool(value)
    return shown


async def wait_rendered(page: Page, sel: str, shown: bool, what: str, within: float = 5.0) -> None:
    await page.wait_for(f"{RENDERED}({json.dumps(sel)})", lambda v: v is shown, what, within)


@contextlib.asynccontextmanager
async def browser_page(tmp_path: Path) -> AsyncIterator[Page]:
    """Headless Chromium's page. A missing browser fails the test (in its call
    phase, so it reads FAILED, not skipped and not a setup error)."""
    exe = find_chromium()
    if exe is None:
        pytest.fail(
            "chromium is not installed: the status-page test needs a real browser. "
            "Install Debian's package (`apt-get update && apt-get install -y chromium`; "
            ".ci/run does it when missing) or point BROWNOUT_CHROMIUM at a Chromium binary."
        )
    async with chromium(exe, tmp_path / "chromium-profile") as p:
        try:
            yield p
        except BaseException:
            # What the page looked like when the test failed.
            with contextlib.suppress(Exception):
                await p.screenshot(ARTIFACT.with_name("status-page-failure.png"))
            raise


async def _traffic(proxy: StatusProxy, stop: asyncio.Event) -> None:
    """A light, uneven chat load, so the chart has something to show."""
    while not stop.is_set():
        await asyncio.gather(*(proxy.chat() for _ in range(random.randint(1, 4))))
        await asyncio.sleep(random.uniform(0.0, 0.2))


async def test_status_page_follows_tier_changes_live(
    tmp_path: Path,
    llm: FakeLLM,
    llm_fallback: FakeLLM,
    status_proxies: list[StatusProxy],
) -> None:
    async with browser_page(tmp_path) as page:
        proxy = await start_status_proxy(
            status_proxies, status_policy(llm.url, llm_fallback.url), interval_s=0.5
        )
        # The bare path redirects; the page then goes live from its first event.
        await page.navigate(proxy.url + "/brownout")
        assert await page.evaluate("location.pathname") == "/brownout/"
        await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")
        await page.wait_text("#tier", lambda t: t == "normal", "the tier badge to say normal")
        await page.wait_for(
            "document.querySelectorAll('#backends tr').length",
            lambda n: n == 2,
            "both backends in the table",
        )
        await page.wait_text(
            "#backend-primary",
            lambda t: "8192" in t and "healthy" in t,
            "the primary's model facts",
        )
        assert "fallback" in await page.text("#backends")
        assert await page.text("#limit") == "16"
        # Nothing forced, no ramp, connected, admin enabled: only the operator panel.
        assert await rendered(page) == {
            "#tier-forced": False,
            "#ramp": False,
            "#admin": True,
            "#stale-banner": False,
            "#rollout": False,
        }

        stop = asyncio.Event()
        load = asyncio.create_task(_traffic(proxy, stop))
        try:
            await page.wait_for(
                "+document.getElementById('last-rps').textContent || 0",
                lambda v: v > 0,
                "requests/s on the chart",
                within=5.0,
            )
            await asyncio.sleep(6)  # a chart worth a screenshot

            # 1. Forced through the API: the badge follows without a reload.
            marker = await page.evaluate("window.__sameDocument = 1")
            assert marker == 1
            t0 = time.monotonic()
            await proxy.force("maintenance")
            _, waited = await page.wait_text(
                "#tier", lambda t: t == "maintenance", "maintenance after the API call", within=3.0
            )
            assert waited < 2.0, f"the page took {waited:.2f}s to show the new tier"
            assert time.monotonic() - t0 < 3.0
            assert await page.evaluate("window.__sameDocument") == 1, "the page was reloaded"
            assert await rendered(page) == {
                "#tier-forced": True,
                "#ramp": False,
                "#admin": True,
                "#stale-banner": False,
                "#rollout": False,
            }
            assert await page.text("#tier-forced") == "forced: maintenance"
            assert await page.evaluate(
                "document.getElementById('tier-card').classList.contains('t-maintenance')"
            )
            timeline = await page.text("#timeline li:first-child")
            assert "normal" in timeline and "maintenance" in timeline and "forced" in timeline

            # 2. A wrong token is refused, and the page says so.
            await page.type_into("#admin-token", "not-the-token")
            await page.click("#release-btn")
            result, _ = await page.wait_text("#admin-result", lambda t: "401" in t, "the 401")
            assert "wrong admin token" in result
            assert await page.text("#tier") == "maintenance"

            # 3. Released from the page's own form: straight back to normal, through the ramp.
            await page.type_into("#admin-token", ADMIN_TOKEN)
            await page.click("#release-btn")
            await page.wait_text("#admin-result", lambda t: t.startswith("Released"), "release ok")
            await wait_rendered(page, "#tier-forced", False, "the forced pill to go", within=2.0)
            # Back to the primary through the ramp (0.5 s a step): shown while it runs.
            await wait_rendered(page, "#ramp", True, "the recovery ramp", within=10.0)
            await page.wait_text("#tier", lambda t: t == "normal", "normal again", within=10.0)
            await wait_rendered(page, "#ramp", False, "the ramp to end", within=5.0)
            assert await rendered(page) == {
                "#tier-forced": False,
                "#ramp": False,
                "#admin": True,
                "#stale-banner": False,
                "#rollout": False,
            }

            # 4. Forced from the page's own form.
            await page.evaluate(
                "(() => { const s = document.getElementById('admin-tier');"
                " s.value = 'maintenance'; s.dispatchEvent(new Event('change')); })()"
            )
            assert await page.text("#force-btn") == "Force maintenance"
            await page.click("#force-btn")
            _, waited = await page.wait_text(
                "#tier", lambda t: t == "maintenance", "maintenance from the form", within=3.0
            )
            assert waited < 2.0
            assert (await page.text("#admin-result")).startswith("Forced maintenance")
            st = await proxy.status()
            assert st["tier"] == "maintenance"
            assert st["ladder"]["forced"] == "maintenance"  # type: ignore[index]
            # The token stays in this tab only.
            token = "sessionStorage.getItem('brownout.admin_token')"
            assert await page.evaluate(token) == ADMIN_TOKEN
            assert await page.evaluate("localStorage.length") == 0

            await asyncio.sleep(2.5)  # a few more points on the chart after the change
        finally:
            stop.set()
            await load

        edges = await page.evaluate(
            "[...document.querySelectorAll('#timeline li .edge')].map(e => e.textContent)"
        )
        # forced, released (straight back to normal, issue 14), forced again.
        assert len(edges) >= 3, edges
        drawn = await page.evaluate(
            "document.querySelectorAll('#chart-ttft path.line, #chart-rps path.line').length"
        )
        assert drawn >= 3, "TTFT and throughput lines are drawn"
        assert await page.evaluate("window.__sameDocument") == 1
        # The one error the console may show is the refused wrong token (step 2).
        unexpected = [p for p in page.problems if "status of 401" not in p]
        assert unexpected == [], unexpected

        await page.evaluate("document.activeElement && document.activeElement.blur()")
        await page.screenshot(ARTIFACT)
        assert ARTIFACT.stat().st_size > 20_000
        if not DOCS_SHOT.exists() or os.environ.get("BROWNOUT_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(ARTIFACT, DOCS_SHOT)


async def test_status_page_shows_disconnected_and_reconnects(
    tmp_path: Path, llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    async with browser_page(tmp_path) as page:
        proxy = await start_status_proxy(status_proxies, status_policy(llm.url), interval_s=0.5)
        await page.navigate(proxy.url + "/brownout/")
        await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")
        await proxy.force("throttle")
        await page.wait_text("#tier", lambda t: t == "throttle", "throttle")

        await proxy.stop()
        await page.wait_text("#conn", lambda t: t.startswith("disconnected"), "disconnected")
        assert await page.evaluate("document.body.classList.contains('stale')")
        assert (await rendered(page))["#stale-banner"] is True
        assert await page.text("#tier") == "throttle", "the last known state stays, marked stale"

        await proxy.start()  # same port, fresh state
        await page.wait_text("#conn", lambda t: t == "live", "reconnected", within=10.0)
        await page.wait_text("#tier", lambda t: t == "normal", "the new process's tier")
        assert not await page.evaluate("document.body.classList.contains('stale')")
        assert (await rendered(page))["#stale-banner"] is False
        assert page.problems == [], page.problems


async def test_status_page_without_admin_has_no_operator_panel(
    tmp_path: Path, llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    """Without server.admin_token the admin endpoints answer 403: no form to
    fill in. A tier forced another way (here: in-process) still shows."""
    async with browser_page(tmp_path) as page:
        proxy = await start_status_proxy(
            status_proxies, status_policy(llm.url, admin=False), interval_s=0.5
        )
        await page.navigate(proxy.url + "/brownout/")
        await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")
        await page.wait_text("#tier", lambda t: t == "normal", "normal")
        assert await rendered(page) == {
            "#tier-forced": False,
            "#ramp": False,
            "#admin": False,
            "#stale-banner": False,
            "#rollout": False,
        }
        assert proxy.app is not None
        proxy.app[STATE].current.force_tier("maintenance")
        await page.wait_text("#tier", lambda t: t == "maintenance", "maintenance")
        assert await rendered(page) == {
            "#tier-forced": True,
            "#ramp": False,
            "#admin": False,
            "#stale-banner": False,
            "#rollout": False,
        }
        assert page.problems == [], page.problems


class TwoModelLLM(FakeLLM):
    """An OpenAI-compatible gateway serving two models."""

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m-a"}, {"id": "m-b"}]})


async def test_status_page_shows_per_model_breakers(
    tmp_path: Path, status_proxies: list[StatusProxy]
) -> None:
    """A multi-model backend (kind openai): one model's open breaker shows on
    its backend's row, next to the backend's own (still closed) breaker."""
    fake = TwoModelLLM("m-a", 4096)
    await fake.start()
    try:
        policy = status_policy(fake.url)
        b = policy.backends
        primary = dataclasses.replace(b.primary, kind="openai")
        policy = dataclasses.replace(policy, backends=dataclasses.replace(b, primary=primary))
        async with browser_page(tmp_path) as page:
            proxy = await start_status_proxy(status_proxies, policy, interval_s=0.5)
            assert proxy.app is not None
            rt = proxy.app[STATE].current
            up = rt.upstreams["primary"]
            for _ in range(200):
                if up.served_models:
                    break
                await asyncio.sleep(0.01)
            for _ in range(rt.policy.ladder.breaker.fail_max):
                permit = up.breaker_for("m-a").allow()
                assert permit is not None
                rt.report_failure(up, "http_500", permit=permit)
            up.breaker_for("m-b")
            await page.navigate(proxy.url + "/brownout/")
            await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")
            text, _ = await page.wait_text(
                "#backend-primary", lambda t: "m-a" in t, "the model breakers"
            )
            assert "open m-a" in text and "closed m-b" in text
            assert await page.text("#tier") == "normal"
            assert page.problems == [], page.problems
    finally:
        await fake.stop()
