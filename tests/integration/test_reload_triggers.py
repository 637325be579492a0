"""Reload triggers that come in bursts or from the files a policy names.

- a burst of SIGHUPs (a deploy script in a loop, `kill -HUP` from several
  hooks) runs at most two reloads — the one running and one that reads the
  file after the last signal — not one per signal;
- with `server.watch_policy`, an edit of the FAQ file the policy names
  reloads it too (before, only the policy file itself was watched, and an
  edited FAQ waited for a SIGHUP).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web

import proxy.runtime.state as state_module
from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from proxy.runtime.loops import changed, merge
from proxy.server import _reload_on_sighup
from tests.integration.conftest import CHAT_BODY, FakeUpstream, ProxyFactory, chunk
from tests.integration.test_reload_state import status, wait_for, write
from tests.integration.test_sessions_flow import metric

FAQ = "entries:\n  - question: How long do refunds take?\n    answer: {answer}\n"


async def test_a_burst_of_sighups_runs_at_most_two_reloads(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    await _reload_on_sighup(proxy.app)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(20):
            os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.05)  # the signals are handled on the loop

        async def settled() -> bool:
            state = proxy.app[STATE]
            return not state._lock.locked() and not state._queued

        await wait_for(settled, "the reloads to finish")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
    reloads = await metric(proxy, "brownout_policy_reloads_total")
    assert 1 <= reloads <= 2, reloads
    assert (await status(proxy))["policy"]["last_reload"]["trigger"] == "sighup"


async def test_a_sighup_after_the_file_was_read_gets_its_own_reload(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    state = proxy.app[STATE]
    first = await state.reload_coalesced("sighup")
    second = await state.reload_coalesced("sighup")
    assert first is not None and first["ok"] and second is not None and second["ok"]
    assert await metric(proxy, "brownout_policy_reloads_total") == 2


async def test_an_edited_faq_file_is_reloaded_by_the_watch(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    faq = tmp_path / "faq.yaml"
    faq.write_text(FAQ.format(answer="Refunds take 5 days."))
    watch = "  watch_policy: true\n  watch_interval_s: 0.05\n"
    write(path, fake_upstream.url, server=watch, rest="faq:\n  file: faq.yaml\n")
    proxy = await start_proxy(load_policy(path))
    entries = proxy.app[STATE].current.policy.faq.entries
    assert [e.answer for e in entries] == ["Refunds take 5 days."]

    await asyncio.sleep(0.2)  # the watch has its first stamps
    faq.write_text(FAQ.format(answer="Refunds take 3 days now."))

    async def reloaded() -> bool:
        return await metric(proxy, "brownout_policy_reloads_total") >= 1

    await wait_for(reloaded, "the FAQ edit to be reloaded")
    entries = proxy.app[STATE].current.policy.faq.entries
    assert [e.answer for e in entries] == ["Refunds take 3 days now."]
    assert (await status(proxy))["policy"]["last_reload"]["trigger"] == "file_changed"


def test_a_file_missing_for_a_moment_is_no_change() -> None:
    a, b = (1, 10, 100), (2, 11, 101)
    assert not changed((a, b), (a, None))  # the FAQ being renamed into place
    assert changed((a, b), (a, (3, 11, 101)))
    assert changed((a, b), (a, (2, 11, 102)))  # same size and mtime, another file
    assert merge((a, b), (a, None)) == (a, b)
    assert changed((a,), (a, b))  # the reload named an FAQ file


async def test_a_stream_longer_than_the_drain_limit_is_not_cut_by_a_reload(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload replaces the generation; the old one's backends used to be
    closed after a fixed 15 minutes whatever was still streaming. Now it
    lives until its last request ends and says once that it is still
    draining (the limit is shortened here)."""
    monkeypatch.setattr(state_module, "_DRAIN_LIMIT_S", 0.3)

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            await resp.write(chunk(f"w{i} "))
            await asyncio.sleep(0.15)
        await resp.write(chunk("", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = slow
    path = tmp_path / "policy.yaml"
    body = "  body_timeout_s: 0.5\n"  # how long a drain waits for bodies in flight
    write(path, fake_upstream.url, server=body)
    proxy = await start_proxy(load_policy(path))
    state = proxy.app[STATE]
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            # A new pool for the primary: the old generation's must be closed, later.
            write(path, fake_upstream.url, server=body, primary="    pool: {max_connections: 8}\n")
            assert (await state.reload("test"))["ok"]
            rest = await resp.content.read()
        text = (first + rest).decode()
        assert all(f"w{i} " in text for i in range(8)), text
        assert text.rstrip().endswith("data: [DONE]")

        async def drained() -> bool:
            return len(state.live) == 1

        await wait_for(drained, "the old generation to be closed after its stream")
    assert [e for e in logs if e["event"] == "generation_still_draining"]


async def test_an_edit_landing_while_the_watch_reload_runs_is_reloaded_too(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deploy writes the policy, then the FAQ: the watch sees the policy edit and
    reloads; the FAQ edit lands after the reload read it. The watch took its stamps
    after the reload, so that edit looked already loaded and never was."""
    path = tmp_path / "policy.yaml"
    faq = tmp_path / "faq.yaml"
    faq.write_text(FAQ.format(answer="Refunds take 5 days."))
    watch = "  watch_policy: true\n  watch_interval_s: 0.05\n"
    write(path, fake_upstream.url, server=watch, rest="faq:\n  file: faq.yaml\n")
    proxy = await start_proxy(load_policy(path))
    real_load = state_module.load_policy
    edits = ["Refunds take 3 days now."]

    def load_then_edit(source: str | Path) -> Any:
        policy = real_load(source)
        if edits:  # the FAQ edit lands just after this reload read the files
            faq.write_text(FAQ.format(answer=edits.pop()))
        return policy

    monkeypatch.setattr(state_module, "load_policy", load_then_edit)
    await asyncio.sleep(0.2)  # the watch has its first stamps
    write(path, fake_upstream.url, server=watch, rest="faq:\n  file: faq.yaml\n  threshold: 0.4\n")

    async def faq_reloaded() -> bool:
        entries = proxy.app[STATE].current.policy.faq.entries
        return [e.answer for e in entries] == ["Refunds take 3 days now."]

    await wait_for(faq_reloaded, "the FAQ edit made during the reload to be reloaded")
