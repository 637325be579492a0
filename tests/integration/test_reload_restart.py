"""A reload never claims to apply what a running process cannot change:
restart-only knobs (schema mark `restart`) are listed under `needs_restart`,
left out of `changes`, and keep their running value."""

from __future__ import annotations

from pathlib import Path

from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_reload import ADMIN, write_policy


async def test_restart_only_knobs_are_reported_not_applied(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    text = path.read_text().replace(
        "  heartbeat_s: 0.3\n",
        "  heartbeat_s: 0.4\n  port: 18999\n  log_level: debug\n  max_body_bytes: 2048\n",
    )
    path.write_text(text)
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as resp:
        assert resp.status == 200
        result = await resp.json()
    assert result["ok"] is True
    assert result["changes"] == ["~ server.heartbeat_s: 0.3 -> 0.4"]
    assert result["needs_restart"] == [
        "~ server.log_level: 'info' -> 'debug'  (needs restart)",
        "~ server.max_body_bytes: 4194304 -> 2048  (needs restart)",
        "~ server.port: 8080 -> 18999  (needs restart)",
    ]
    running = proxy.app[STATE].current.policy.server
    assert (running.port, running.log_level, running.max_body_bytes) == (8080, "info", 4194304)
    assert running.heartbeat_s == 0.4
