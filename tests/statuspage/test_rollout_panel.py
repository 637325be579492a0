"""The status page's gray-release panel in a real headless Chromium: hidden
without a candidate; with one, it follows a rollout started through the API
(state, step and share, gates) without a reload, and after the candidate
answers an OOM it shows the rollback, the failed gate and the bundle."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from proxy.policy import Policy, parse_policy
from tests.statuspage.conftest import (
    ADMIN,
    ADMIN_TOKEN,
    FakeLLM,
    StatusProxy,
    read_events,
    start_status_proxy,
    status_policy,
)
from tests.statuspage.test_browser import RENDERED, browser_page, wait_rendered
from tests.statuspage.test_statuspage import _next_status as next_status

ARTIFACT = Path(__file__).resolve().parents[2] / "test-artifacts" / "status-page-rollout.png"
PANEL_PARTS = ("#rollout", "#rollout-failure", "#rollout-reason", "#rollout-gates-wrap")


class CandidateLLM(FakeLLM):
    """The engine being rolled out: healthy until `oom` is set, then every
    chat answers vLLM's CUDA out-of-memory error."""

    oom: bool = False

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if self.oom:
            await request.read()
            return web.json_response(
                {
                    "error": {
                        "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
                        "type": "InternalServerError",
                        "code": 500,
                    }
                },
                status=500,
            )
        return await super().chat(request)


def rollout_policy(primary: str, candidate: str, snapshot_dir: Path) -> Policy:
    backend = "    health: {interval_s: 0.2, timeout_s: 0.5}\n"
    text = (
        f"server:\n  heartbeat_s: 0.3\n  admin_token: {ADMIN_TOKEN}\n"
        f"backends:\n  primary:\n    url: {primary}\n    kind: vllm\n{backend}"
        f"  candidate:\n    url: {candidate}\n    kind: vllm\n{backend}"
        "ladder:\n  maintenance: {enabled: false}\n  recovery: {window_s: 0.1}\n"
        "  failover: {retry_max: 0}\n"
        "rollout:\n  steps: [0.25, 0.5, 1.0]\n  step_s: 3600\n"
        f"  snapshot_dir: {json.dumps(str(snapshot_dir))}\n"
        "  gates: {min_samples: 5, window_s: 60}\n"
    )
    return parse_policy(text, "rollout-status-test.yaml")


async def shown(page: object, sel: str) -> bool:
    return bool(await page.evaluate(f"{RENDERED}({json.dumps(sel)})"))  # type: ignore[attr-defined]


async def act(proxy: StatusProxy, action: str) -> dict[str, object]:
    async with proxy.session.post(
        proxy.url + "/brownout/rollout", json={"action": action}, headers=ADMIN
    ) as resp:
        body: dict[str, object] = await resp.json()
        assert resp.status == 200, body
        return body


@pytest.mark.real  # a browser
async def test_the_panel_is_hidden_without_a_candidate(
    tmp_path: Path, llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    async with browser_page(tmp_path) as page:
        proxy = await start_status_proxy(status_proxies, status_policy(llm.url), interval_s=0.5)
        await page.navigate(proxy.url + "/brownout/")
        await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")
        await page.wait_text("#tier", lambda t: t == "normal", "the first render")
        assert not await shown(page, "#rollout")
        # The stream says why: no candidate configured.
        st = await page.evaluate("JSON.stringify(document.getElementById('rollout').hidden)")
        assert st == "true"
        assert page.problems == [], page.problems


@pytest.mark.real  # a browser
async def test_the_panel_follows_a_rollout_and_shows_the_rollback(
    tmp_path: Path, llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    candidate = CandidateLLM("Qwen2.5-7B-Instruct-AWQ", 8192, ttft=(0.0, 0.02))
    await candidate.start()
    try:
        bundles = tmp_path / "bundles"
        pol = rollout_policy(llm.url, candidate.url, bundles)
        async with browser_page(tmp_path) as page:
            proxy = await start_status_proxy(status_proxies, pol, interval_s=0.5)
            await page.navigate(proxy.url + "/brownout/")
            await page.wait_text("#conn", lambda t: t == "live", "the stream to connect")

            # A candidate, not started: the panel is there, idle.
            await wait_rendered(page, "#rollout", True, "the rollout panel")
            assert await page.text("#rollout-state") == "idle"
            assert await page.text("#rollout-step") == "not started"
            assert await page.text("#rollout-steps") == "25 %50 %100 %"
            assert await page.text("#rollout-candidate") == "healthy · breaker closed"
            assert not await shown(page, "#rollout-failure")

            # Started through the API: the page follows without a reload.
            await page.evaluate("window.__sameDocument = 1")
            t0 = time.monotonic()
            started = await act(proxy, "start")
            _, waited = await page.wait_text(
                "#rollout-step", lambda t: t == "step 1/3 · 25 %", "step 1/3 · 25 %", within=3.0
            )
            assert waited < 2.0, f"the page took {waited:.2f}s to show the step"
            assert time.monotonic() - t0 < 3.0
            assert await page.text("#rollout-state") == "step"
            assert await page.text("#rollout-id") == f"· {started['id']}"
            assert await page.text("#rollout-steps li.on") == "25 %"
            width = await page.evaluate("document.getElementById('rollout-bar').style.width")
            assert width == "25%"
            held, _ = await page.wait_text(
                "#rollout-held", lambda t: t.startswith("held "), "the time held"
            )
            assert held.endswith(" of 1h 00m")

            # Traffic on both arms: the gates table fills in at the next window.
            for _ in range(12):
                assert await proxy.chat() == 200
            await wait_rendered(page, "#rollout-gates-wrap", True, "the gates", within=5.0)
            await page.wait_text(
                "#rollout-gate-oom", lambda t: t.startswith("oompass0"), "the oom gate passing"
            )
            limit = await page.text("#rollout-gate-ttft_ratio td:nth-child(4)")
            assert limit == "0.80"
            assert await page.text("#rollout-gates-note") == "Gates"
            samples = await page.text("#rollout-samples")
            assert samples.startswith("primary ") and " · candidate " in samples

            # The candidate runs out of memory: the page shows the rollback.
            candidate.oom = True
            t0 = time.monotonic()
            while (await proxy.status())["rollout"]["state"] != "rolled_back":  # type: ignore[index]
                assert time.monotonic() - t0 < 10, "no rollback"
                assert await proxy.chat() == 200  # retried on the primary: no client sees it
            await wait_rendered(page, "#rollout-failure", True, "the rollback box", within=3.0)
            assert await page.text("#rollout-failed-gate") == "oom"
            await page.wait_for(
                "document.getElementById('rollout-gate-oom').className",
                lambda c: c == "failed",
                "the oom row marked as the failed gate",
            )
            assert await page.text("#rollout-gates-note") == (
                "Gates, last evaluation before the rollout ended"
            )
            await page.wait_for(
                "document.getElementById('rollout-bar').style.width",
                lambda w: w == "0%",
                "the share bar at 0",
            )
            reason = await page.text("#rollout-failure-reason")
            st = await proxy.status()
            assert reason == st["rollout"]["reason"]  # type: ignore[index]
            assert await page.text("#rollout-state") == "rolled back"
            assert await page.text("#rollout-step") == (
                "rolled back at step 1/3 · all traffic on the primary"
            )
            bundle, _ = await page.wait_text(
                "#rollout-bundles", lambda t: t.startswith(str(bundles)), "the bundle path"
            )
            assert bundle == str(bundles / str(started["id"]))
            assert (bundles / str(started["id"]) / "verdict.json").is_file()
            assert await page.evaluate("window.__sameDocument") == 1, "the page was reloaded"
            for sel in PANEL_PARTS:
                assert await page.evaluate(f"{RENDERED}({json.dumps(sel)})") is not None, sel
            assert not await shown(page, "#rollout-reason")
            assert page.problems == [], page.problems
            await page.screenshot(ARTIFACT)
    finally:
        await candidate.stop()


async def test_the_feed_carries_the_rollout_and_pushes_its_changes_at_once(
    tmp_path: Path, llm: FakeLLM, status_proxies: list[StatusProxy]
) -> None:
    """A tick every 30 s: an event within a second of an action can only be
    the change push. Without a candidate the feed says `configured: false`."""
    candidate = CandidateLLM("cand", 4096)
    await candidate.start()
    try:
        pol = rollout_policy(llm.url, candidate.url, tmp_path)
        p = await start_status_proxy(status_proxies, pol, interval_s=30.0)
        async with p.session.get(p.url + "/brownout/events") as resp:
            events = read_events(resp)
            first = await next_status(events)
            ro = first["rollout"]
            assert ro["configured"] is True and ro["state"] == "idle"
            assert ro["candidate"] == {
                "healthy": ro["candidate"]["healthy"],
                "down": False,
                "breaker": "closed",
            }
            for action, want in (("start", "step"), ("pause", "paused"), ("abort", "aborted")):
                t0 = time.monotonic()
                await act(p, action)
                ev = await next_status(events, within=2.0)
                while ev["rollout"]["state"] != want:
                    ev = await next_status(events, within=2.0)
                assert time.monotonic() - t0 < 1.0, action
        plain = await start_status_proxy(status_proxies, status_policy(llm.url))
        async with plain.session.get(plain.url + "/brownout/events") as resp:
            first = await next_status(read_events(resp))
        assert first["rollout"] == {"state": "idle", "configured": False}
    finally:
        await candidate.stop()
