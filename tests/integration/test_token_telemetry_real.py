"""Issue 23 against the real fallback server (tiny model): Brownout asks it
for usage on every stream and counts it; the client that did not ask reads
the very events it reads when nobody asks (greedy decoding: the same text),
and one that asked reads the server's own usage chunk. A rescue continued on
that server counts the continuation's usage there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.openai.sse import SSEParser
from tests.fallback.conftest import FallbackServer, start_server, stop_server
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy
from tests.integration.test_pipeline import metrics, policy, total
from tests.integration.test_rescue_capabilities import cut_after
from tests.integration.test_token_telemetry import content

pytestmark = [pytest.mark.slow]

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me about Paris."}],
    "stream": True,
    "temperature": 0,
    "max_tokens": 12,
}
SLOW = {"connect_s": 2, "first_byte_s": 60, "idle_s": 30}


@pytest.fixture(scope="module")
def real_fallback(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp("fallback-tokens") / "server.log"
    server = start_server(tiny_model_dir, log_path, ["--served-model-name", "tiny"])
    try:
        yield server
    finally:
        stop_server(server)


def real_primary(url: str, *, ask: bool = True) -> Any:
    """The real server as the primary, kind transformers (asked by default;
    `ask=False`: `stream_usage: false`)."""
    primary = {"kind": "transformers", "stream_usage": ask, "timeouts": SLOW}
    return policy(url, primary_extra=primary, extra={"guard": {"enabled": False}})


async def events(
    proxy: RunningProxy, body: dict[str, Any], path: str = CHAT
) -> list[dict[str, Any]]:
    """The client's events, each without the fields that differ per answer."""
    async with proxy.session.post(proxy.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    parser = SSEParser()
    out = []
    for ev in parser.feed(raw) + parser.flush():
        if ev.data is None or ev.data == b"[DONE]":
            out.append({"raw": ev.data})
            continue
        obj = json.loads(ev.data)
        obj.pop("id", None)
        obj.pop("created", None)
        out.append(obj)
    return out


async def test_real_server_stream_counted_and_client_events_unchanged(
    real_fallback: FallbackServer, start_proxy: ProxyFactory
) -> None:
    asking = await start_proxy(real_primary(real_fallback.url))
    silent = await start_proxy(real_primary(real_fallback.url, ask=False))
    got = await events(asking, BODY)
    assert got == await events(silent, BODY)
    assert not [e for e in got if "usage" in e]
    assert got[-1] == {"raw": b"[DONE]"}
    # What the server itself says this answer used, asked by the client.
    asked = await events(silent, {**BODY, "stream_options": {"include_usage": True}})
    (usage,) = [e["usage"] for e in asked if "usage" in e]
    assert asked[-2]["choices"] == [] and asked[-2]["usage"] == usage
    assert [e for e in asked if "usage" not in e] == got
    m = await metrics(asking)
    assert total(m, "brownout_prompt_tokens_total", backend="primary") == usage["prompt_tokens"]
    completion = total(m, "brownout_completion_tokens_total", backend="primary")
    assert completion == usage["completion_tokens"] > 0
    assert total(m, "brownout_time_per_output_token_seconds_count", backend="primary") == 1
    assert total(m, "brownout_inter_token_seconds_count", backend="primary") >= 1


async def test_real_server_rescue_counts_its_continuation(
    real_fallback: FallbackServer, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = cut_after(content("Paris") + content(" is"))
    extra = {
        "backends": {"fallback": {"model": "tiny", "timeouts": SLOW}},
        "guard": {"enabled": False},
    }
    proxy = await start_proxy(policy(fake_upstream.url, real_fallback.url, extra=extra))
    got = await events(proxy, BODY)
    assert got[-1] == {"raw": b"[DONE]"}
    assert not [e for e in got if "usage" in e or "error" in e]
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 1
    assert total(m, "brownout_prompt_tokens_total", backend="primary") == 0
    # The continuation's prompt holds the question and the partial answer.
    assert total(m, "brownout_prompt_tokens_total", backend="fallback") > 5
    assert total(m, "brownout_completion_tokens_total", backend="fallback") > 0
