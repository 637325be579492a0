"""A ConfigMap edit reaches the running proxy (`server.watch_policy`).

The policy and its FAQ are mounted as the kubelet mounts a ConfigMap
(`tests/integration/kubelet_volume.py`): symlinks through `..data`, updated
by renaming a `..data_tmp` symlink over `..data` and deleting the old
version's directory. The watch follows the mounted paths, so the swap is a
change of both files; the deleted directory is never mistaken for a missing
file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp

from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port
from tests.integration.kubelet_volume import DATA, ConfigMapVolume
from tests.integration.test_cli_serve import _serve
from tests.integration.test_reload_state import wait_for
from tests.integration.test_sessions_flow import metric

TOKEN = "s3cret"
QUESTION = "How long do refunds take?"


def policy_text(upstream: str, retry_after_s: int) -> str:
    return f"""server:
  admin_token: {TOKEN}
  watch_policy: true
  watch_interval_s: 0.1
backends:
  primary:
    url: {upstream}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
ladder:
  maintenance:
    retry_after_s: {retry_after_s}
faq:
  file: faq.yaml
"""


def faq_text(answer: str) -> str:
    return f"entries:\n  - question: {QUESTION}\n    keywords: [refund]\n    answer: {answer}\n"


async def _maintenance_answer(s: aiohttp.ClientSession, base: str) -> tuple[str, str]:
    """(Retry-After, the FAQ answer's text) of a chat turn in maintenance."""
    body = {"model": "chat", "messages": [{"role": "user", "content": QUESTION}]}
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        answer = await r.json()
        assert r.headers["X-Brownout-Tier"] == "maintenance", answer
        return r.headers["Retry-After"], answer["choices"][0]["message"]["content"]


async def test_a_configmap_update_reaches_the_running_brownout_serve(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    vol = ConfigMapVolume(
        tmp_path / "etc-brownout",
        {
            "policy.yaml": policy_text(fake_upstream.url, 30),
            "faq.yaml": faq_text("Refunds take 5 days."),
        },
    )
    mounted = vol.root / "policy.yaml"
    assert os.readlink(mounted) == f"{DATA}/policy.yaml"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = await _serve(mounted, port)
    try:
        async with aiohttp.ClientSession() as s:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with s.post(
                base + "/brownout/tier", json={"tier": "maintenance"}, headers=auth
            ) as r:
                assert r.status == 200
            assert await _maintenance_answer(s, base) == ("30", "Refunds take 5 days.")
            await asyncio.sleep(0.3)  # the watch has taken its first stamps

            old_dir = vol.versions[-1]
            vol.update(
                {
                    "policy.yaml": policy_text(fake_upstream.url, 45),
                    "faq.yaml": faq_text("Refunds take 3 days now."),
                }
            )
            assert not (vol.root / old_dir).exists(), "the kubelet deletes the old version"
            deadline = time.monotonic() + 5
            seen = await _maintenance_answer(s, base)
            while seen != ("45", "Refunds take 3 days now."):
                assert time.monotonic() < deadline, f"the edit never arrived: {seen}"
                await asyncio.sleep(0.05)
                seen = await _maintenance_answer(s, base)
            async with s.get(base + "/brownout/status") as r:
                last = (await r.json())["policy"]["last_reload"]
            assert last["ok"] is True and last["trigger"] == "file_changed"
            # The forced tier outlives the reload.
            async with s.get(base + "/brownout/status") as r:
                assert (await r.json())["tier"] == "maintenance"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 15)


async def test_a_swap_to_files_of_the_same_size_and_mtime_is_still_seen(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """Two edits of the same length within the file system's timestamp
    granularity: only the inode behind the mounted path tells them apart."""
    vol = ConfigMapVolume(
        tmp_path / "etc-brownout",
        {
            "policy.yaml": policy_text(fake_upstream.url, 30),
            "faq.yaml": faq_text("Refunds take 5 days."),
        },
    )
    proxy = await start_proxy(load_policy(vol.root / "policy.yaml"))
    await asyncio.sleep(0.3)  # the watch has taken its first stamps
    before = os.stat(vol.root / "faq.yaml")
    vol.update(
        {
            "policy.yaml": policy_text(fake_upstream.url, 30),
            "faq.yaml": faq_text("Refunds take 3 days."),  # same length
        },
        same_stat_as_before=True,
    )
    after = os.stat(vol.root / "faq.yaml")
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)

    async def reloaded() -> bool:
        return await metric(proxy, "brownout_policy_reloads_total") >= 1

    await wait_for(reloaded, "the swapped ConfigMap to be reloaded", within=3)
    entries = proxy.app[STATE].current.policy.faq.entries
    assert [e.answer for e in entries] == ["Refunds take 3 days."]
