"""Issue 23: token counters from the answers' `usage`, and the client's bytes.

A scripted vLLM-like backend (real sockets) sends its usage chunk only when
the request asks for it (`stream_options.include_usage`), as vLLM does.
Brownout asks on every stream and counts it; a client that did not ask gets
exactly the bytes it got before (the same backend, `stream_usage: false`),
one that asked gets the chunk as the backend sent it. Also: JSON answers, a
stream rescued on the fallback (each leg's usage on its own backend), the
maintenance answer (counted nowhere), inter-token latency and time per
output token, build_info.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.openai.sse import DONE_EVENT
from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy
from tests.integration.test_pipeline import (
    CHAT,
    SSE,
    fallback_upstream,  # noqa: F401  (fixture)
    metrics,
    policy,
    total,
)
from tests.integration.test_rescue_capabilities import cut_after

PROMPT_TOKENS = 12


def vllm_chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """vLLM's layout: compact JSON, `usage` (when there) after `choices`."""
    obj = {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def content(text: str, finish: str | None = None) -> bytes:
    delta = {"content": text} if text else {}
    return vllm_chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])


def usage_chunk(prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    return vllm_chunk([], usage=usage)


def vllm_stream(
    words: list[str], *, gap_s: float = 0.0, split_done: bool = False, burst: bool = False
) -> Any:
    """A stream handler: a role chunk, one chunk per word (`gap_s` apart), a
    finish chunk, then — only if the request asked — the usage chunk, then
    [DONE] (in the same write as the usage, or apart with `split_done`).
    `burst`: the whole answer in one write (one region for the relay)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked = (body.get("stream_options") or {}).get("include_usage") is True
        resp: Any = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        if burst:
            out = resp
            pieces: list[bytes] = []

            class Buffered:
                async def write(self, data: bytes) -> None:
                    pieces.append(data)

            resp = Buffered()
        await resp.write(
            vllm_chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        )
        for w in words:
            if gap_s:
                await asyncio.sleep(gap_s)
            await resp.write(content(w))
        await resp.write(content("", "stop"))
        tail = usage_chunk(PROMPT_TOKENS, len(words)) if asked else b""
        if split_done and tail:
            await resp.write(tail)
            await asyncio.sleep(0.02)
            tail = b""
        await resp.write(tail + DONE_EVENT)
        if burst:
            await out.write(b"".join(pieces))
            return out
        return resp

    return handler


async def post(proxy: RunningProxy, body: dict[str, Any]) -> tuple[int, bytes]:
    async with proxy.session.post(proxy.url + CHAT, json=body) as r:
        return r.status, await r.read()


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "stream": stream,
        **extra,
    }


def tokens_of(samples: dict[Any, float], backend: str) -> tuple[float, float]:
    return (
        total(samples, "brownout_prompt_tokens_total", backend=backend),
        total(samples, "brownout_completion_tokens_total", backend=backend),
    )


WORDS = ["one", " two", " three", " four"]


@pytest.mark.parametrize(
    ("words", "split_done", "burst"),
    [
        (WORDS, False, False),
        (WORDS, True, False),
        # A 1,024-chunk answer in one write (issue 24): the usage chunk is
        # cut out of a region of many events, however the reads fall.
        ([f" w{i}" for i in range(1024)], False, True),
    ],
)
async def test_stream_counted_and_client_bytes_unchanged_when_it_did_not_ask(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    words: list[str],
    split_done: bool,
    burst: bool,
) -> None:
    fake_upstream.handlers[CHAT] = vllm_stream(words, split_done=split_done, burst=burst)
    asking = await start_proxy(policy(fake_upstream.url))
    silent = await start_proxy(policy(fake_upstream.url, primary_extra={"stream_usage": False}))
    status, with_usage_asked = await post(asking, chat())
    assert status == 200
    status, never_asked = await post(silent, chat())
    assert status == 200
    # Byte for byte what the client gets when nobody asks the backend for usage.
    assert with_usage_asked == never_asked
    assert b'"usage"' not in with_usage_asked
    assert with_usage_asked.endswith(content("", "stop") + DONE_EVENT)
    # The backend was asked on the first proxy's behalf only.
    sent = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT]
    assert sent[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in sent[1]
    m = await metrics(asking)
    assert tokens_of(m, "primary") == (PROMPT_TOKENS, len(words))
    labels = {
        dict(k[1])["model"] + "/" + dict(k[1])["tier"]
        for k in m
        if k[0] == "brownout_prompt_tokens_total"
    }
    assert labels == {"tiny/normal"}
    assert tokens_of(await metrics(silent), "primary") == (0, 0)


async def test_openai_kind_is_not_asked_unless_the_policy_says_so(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """OpenAI itself adds `"usage": null` to every chunk once asked, other
    servers may refuse the field: kind openai is asked only with
    `stream_usage: true`."""
    fake_upstream.handlers[CHAT] = vllm_stream(WORDS)
    plain = await start_proxy(policy(fake_upstream.url, primary_extra={"kind": "openai"}))
    asked = await start_proxy(
        policy(fake_upstream.url, primary_extra={"kind": "openai", "stream_usage": True})
    )
    for proxy in (plain, asked):
        status, got = await post(proxy, chat())
        assert status == 200 and b'"usage"' not in got
    first, second = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT]
    assert "stream_options" not in first
    assert second["stream_options"] == {"include_usage": True}
    assert tokens_of(await metrics(plain), "primary") == (0, 0)
    assert tokens_of(await metrics(asked), "primary") == (PROMPT_TOKENS, len(WORDS))


async def test_client_that_asked_gets_the_usage_chunk_as_the_backend_sent_it(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = vllm_stream(WORDS)
    proxy = await start_proxy(policy(fake_upstream.url))
    body = chat(stream_options={"include_usage": True})
    raw = json.dumps(body).encode()
    async with proxy.session.post(
        proxy.url + CHAT, data=raw, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 200
        got = await r.read()
    assert got.endswith(usage_chunk(PROMPT_TOKENS, len(WORDS)) + DONE_EVENT)
    # The client's request went upstream as it was: nothing to add.
    [(_, _, sent)] = [(p, h, b) for p, h, b in fake_upstream.requests if p == CHAT]
    assert sent == raw
    assert tokens_of(await metrics(proxy), "primary") == (PROMPT_TOKENS, len(WORDS))


async def test_stream_options_without_include_usage_are_kept_and_completed(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = vllm_stream(WORDS)
    proxy = await start_proxy(policy(fake_upstream.url))
    status, got = await post(proxy, chat(stream_options={"include_usage": False}))
    assert status == 200 and b'"usage"' not in got
    [sent] = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT]
    assert sent["stream_options"] == {"include_usage": True}
    assert tokens_of(await metrics(proxy), "primary") == (PROMPT_TOKENS, len(WORDS))


async def test_continuous_usage_without_include_usage_is_not_asked(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """vLLM would put usage in every chunk once include_usage is set: the
    client's chunks would change, so Brownout does not ask (nothing counted)."""
    fake_upstream.handlers[CHAT] = vllm_stream(WORDS)
    proxy = await start_proxy(policy(fake_upstream.url))
    opts = {"continuous_usage_stats": True}
    status, _ = await post(proxy, chat(stream_options=opts))
    assert status == 200
    [sent] = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT]
    assert sent["stream_options"] == opts
    assert tokens_of(await metrics(proxy), "primary") == (0, 0)


async def test_json_answer_counted_from_its_usage(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    answer = (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"tiny",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":'
        b'"the \\"usage\\": {\\"prompt_tokens\\": 999}"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":30,"total_tokens":37,"completion_tokens":7,'
        b'"prompt_tokens_details":null}}'
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=answer, content_type="application/json")

    fake_upstream.handlers[CHAT] = handler
    proxy = await start_proxy(policy(fake_upstream.url))
    status, got = await post(proxy, chat(stream=False))
    assert status == 200 and got == answer
    # A JSON request is sent as the client sent it (usage is always in the body).
    [sent] = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT]
    assert "stream_options" not in sent
    assert tokens_of(await metrics(proxy), "primary") == (30, 7)


@pytest.mark.parametrize("client_asks", [False, True])
async def test_rescued_stream_counts_the_continuation_on_the_fallback(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,  # noqa: F811
    start_proxy: ProxyFactory,
    client_asks: bool,
) -> None:
    """The primary dies mid-answer (no usage from it: nothing counted for
    it); the fallback continues with a prefill and is asked for usage: its
    usage (the continuation's prompt includes the partial answer) counts on
    the fallback. The client sees its usage chunk only if it asked."""
    fake_upstream.handlers[CHAT] = cut_after(content("one") + content(" two"))
    fallback_upstream.handlers[CHAT] = vllm_stream([" three", " four"])
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    extra = {"stream_options": {"include_usage": True}} if client_asks else {}
    status, got = await post(proxy, chat(**extra))
    assert status == 200
    assert b": brownout-rescue" in got
    assert got.endswith(
        (usage_chunk(PROMPT_TOKENS, 2) if client_asks else content("", "stop")) + DONE_EVENT
    )
    assert got.count(b'"usage"') == (1 if client_asks else 0)
    [cont] = [json.loads(b) for p, _, b in fallback_upstream.requests if p == CHAT]
    assert cont["stream_options"]["include_usage"] is True
    assert cont.get("continue_final_message") is True
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 1
    assert tokens_of(m, "primary") == (0, 0)
    assert tokens_of(m, "fallback") == (PROMPT_TOKENS, 2)


@pytest.mark.parametrize("client_asks", [False, True])
async def test_maintenance_answers_count_no_tokens(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, client_asks: bool
) -> None:
    """The FAQ / notice answer is Brownout's own text, not an engine's: no
    token is counted (its `usage`, when asked, is an estimate)."""
    proxy = await start_proxy(policy(fake_upstream.url, maintenance=True))
    proxy.app[STATE].current.ladder.force("maintenance")  # as an SRE forces it
    extra = {"stream_options": {"include_usage": True}} if client_asks else {}
    async with proxy.session.post(proxy.url + CHAT, json=chat(**extra)) as r:
        assert r.headers["X-Brownout-Backend"] == "maintenance"
        got = await r.read()
    assert (b'"usage"' in got) is client_asks
    assert got.endswith(DONE_EVENT)
    _, answer = await post(proxy, chat(stream=False))
    assert json.loads(answer)["usage"]["prompt_tokens"] == 0  # an estimate, not counted
    m = await metrics(proxy)
    assert total(m, "brownout_maintenance_answers_total") == 2
    assert not [k for k in m if k[0].endswith("_tokens_total")]
    assert [p for p, _, _ in fake_upstream.requests if p == CHAT] == []


async def test_inter_token_latency_and_time_per_output_token(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    gap = 0.04
    fake_upstream.handlers[CHAT] = vllm_stream(WORDS, gap_s=gap)
    proxy = await start_proxy(policy(fake_upstream.url))
    status, _ = await post(proxy, chat())
    assert status == 200
    m = await metrics(proxy)
    n = total(m, "brownout_inter_token_seconds_count", backend="primary")
    itl_sum = total(m, "brownout_inter_token_seconds_sum", backend="primary")
    # The role chunk opens the stream (time to first token, not a gap); then
    # four words ~40 ms apart and the finish chunk: five content events, four
    # gaps of ~40 ms between them. Not [DONE], not the usage chunk.
    assert n == 5, n
    assert 4 * gap * 0.9 <= itl_sum <= 4 * gap + 0.5, itl_sum
    fast = total(m, "brownout_inter_token_seconds_bucket", backend="primary", le="0.025")
    assert n - fast >= 3  # the gaps themselves, not spread thin
    assert total(m, "brownout_time_per_output_token_seconds_count", backend="primary") == 1
    tpot = total(m, "brownout_time_per_output_token_seconds_sum", backend="primary")
    # First to last event (4 gaps) over the 3 tokens after the first.
    assert 4 * gap / 3 * 0.9 <= tpot <= 4 * gap / 3 + 0.2, tpot


async def test_build_info_names_the_policy_in_force(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(policy(fake_upstream.url))
    m = await metrics(proxy)
    [labels] = [dict(k[1]) for k in m if k[0] == "brownout_build_info"]
    async with proxy.session.get(proxy.url + "/brownout/status") as r:
        st = await r.json()
    assert labels["policy_hash"] == st["policy"]["hash"] and len(labels["policy_hash"]) == 12
    assert labels["version"] == st["version"]
    assert labels["python"].count(".") == 2
    assert total(m, "process_resident_memory_bytes") > 0


async def test_build_info_follows_a_reload(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """A replica that took the edit shows its new hash; a rejected edit
    leaves the old one (which is how an SRE tells the replicas apart)."""
    path = tmp_path / "policy.yaml"
    base = f"server:\n  admin_token: s3cret\nbackends:\n  primary:\n    url: {fake_upstream.url}\n"
    path.write_text(base)
    proxy = await start_proxy(load_policy(path))
    admin = {"Authorization": "Bearer s3cret"}

    async def build_hash() -> str:
        m = await metrics(proxy)
        [labels] = [dict(k[1]) for k in m if k[0] == "brownout_build_info"]
        return labels["policy_hash"]

    first = await build_hash()
    path.write_text(base + "    timeouts: {idle_s: 45}\n")
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=admin) as r:
        assert (await r.json())["ok"] is True
    second = await build_hash()
    assert second != first
    path.write_text(base + "    timeouts: {idle_s: -1}\n")
    async with proxy.session.post(proxy.url + "/brownout/reload", headers=admin) as r:
        assert r.status == 422
    assert await build_hash() == second
