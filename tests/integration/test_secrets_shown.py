"""Secrets never reach what the proxy shows without authentication: the
status JSON, the status page's event stream, and the reload result (its
`changes` are also the `policy_reloaded` log line). Redaction follows the
schema's secret marks, so `margin_tokens` is shown and a new
`backends.fallback.api_key` is not."""

from __future__ import annotations

from pathlib import Path

from proxy.policy import load_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy

ADMIN = {"Authorization": "Bearer adm1n-t0ken"}
SECRETS = ("adm1n-t0ken", "pw-primary", "pw-fallback", "sk-fallback", "client-key", "alice")


def write(path: Path, upstream: str, extra: str = "") -> None:
    host = upstream.removeprefix("http://")
    path.write_text(
        f"""server:
  admin_token: adm1n-t0ken
  heartbeat_s: 0.3
backends:
  primary:
    url: http://alice:pw-primary@{host}
    health: {{interval_s: 0.1}}
{extra}"""
    )


async def shown(p: RunningProxy) -> str:
    async with p.session.get(p.url + "/brownout/status") as resp:
        text = await resp.text()
    async with p.session.get(p.url + "/brownout/events") as resp:
        first = await resp.content.readuntil(b"\n\n")
    return text + first.decode()


async def test_status_events_and_reload_result_never_show_secrets(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    write(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))
    before = await shown(proxy)
    assert f"http://***@{fake_upstream.url.removeprefix('http://')}" in before
    write(
        path,
        fake_upstream.url,
        f"""  fallback:
    url: http://bob:pw-fallback@{fake_upstream.url.removeprefix("http://")}
    api_key: sk-fallback
sessions:
  trimming: {{margin_tokens: 99}}
""",
    )
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=ADMIN) as resp:
        assert resp.status == 200
        result = await resp.text()
    assert "+ backends.fallback.api_key: '<redacted>'" in result
    assert "~ sessions.trimming.margin_tokens: 64 -> 99" in result
    after = await shown(proxy)
    for secret in (*SECRETS, "bob"):
        assert secret not in before + result + after, secret
