"""Issue 20: a continuation that restarts the answer is not relayed twice.

A primary dies after 40 of 60 words; the fallback (scripted, on a real
socket) continues by prompt: cleanly, overlapping the seam by k words, from
scratch, or from scratch with different words. The client's text is read
with the official `openai` client and as raw SSE bytes.
On 8c097b4 the restart gave the client 40 words and then all 60 again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy, chunk
from tests.integration.test_pipeline import (
    CHAT,
    DONE,
    SSE,
    events_of,
    fallback_upstream,  # noqa: F401  (fixture)
    metrics,
    policy,
    total,
)
from tests.integration.test_rescue_capabilities import cut_after

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)
SENT = WORDS[:40]
BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "count"}],
    "stream": True,
}
ROLE = {"role": "assistant", "content": ""}
BY_PROMPT = {"backends": {"fallback": {"supports_continuation": False}}}


def tokens(words: list[str], first: bool = True) -> Iterator[str]:
    """Word chunks as a tokenizer cuts them (a space before every word but the answer's first)."""
    for i, w in enumerate(words):
        yield w if first and i == 0 else " " + w


def primary_dies_after(fake: FakeUpstream, words: list[str]) -> None:
    fake.handlers[CHAT] = cut_after(b"".join(chunk(t) for t in tokens(words)))


def fallback_says(fake: FakeUpstream, pieces: list[str], *, role: bool = True) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        if role:
            head = {
                "id": "fb",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "tiny",
                "choices": [{"index": 0, "delta": ROLE, "finish_reason": None}],
            }
            await resp.write(b"data: " + json.dumps(head).encode() + b"\n\n")
        for p in pieces:
            await resp.write(chunk(p))
        await resp.write(chunk("", "stop") + DONE)
        return resp

    fake.handlers[CHAT] = handler


def text_of(raw: bytes) -> str:
    out = []
    for d in events_of(raw):
        if d != b"[DONE]":
            obj = json.loads(d)
            assert "error" in obj or obj["object"] == "chat.completion.chunk"
            if obj.get("choices"):
                out.append(obj["choices"][0].get("delta", {}).get("content") or "")
    return "".join(out)


async def openai_text(proxy: RunningProxy) -> tuple[str, str | None]:
    text, finish = [], None
    async with client(proxy) as oai:
        stream = await oai.chat.completions.create(
            model="tiny", messages=BODY["messages"], stream=True
        )
        async for ev in stream:
            if ev.choices:
                text.append(ev.choices[0].delta.content or "")
                finish = ev.choices[0].finish_reason or finish
    return "".join(text), finish


def client(proxy: RunningProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


async def rescued_raw(proxy: RunningProxy) -> bytes:
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.status == 200
        return await r.read()


def assert_valid_chunks_then_done(raw: bytes) -> None:
    events = events_of(raw)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    finishes = [json.loads(d)["choices"][0]["finish_reason"] for d in events[:-1]]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1


@pytest.mark.parametrize(
    ("name", "pieces", "seam"),
    [
        ("clean", list(tokens(WORDS[40:], first=False)), None),
        ("overlap by 1 word: prose, relayed", list(tokens(WORDS[39:], first=False)), None),
        ("overlap by 3 words", list(tokens(WORDS[37:], first=False)), "overlap_stripped"),
        ("overlap by 12 words", list(tokens(WORDS[28:])), "overlap_stripped"),
        ("restart", list(tokens(WORDS)), "restart_stripped"),
        # Cut at other places than the primary's tokens, its case and spacing differ.
        (
            "restart, other tokens, case and spacing",
            ["\n", "W0 w1", "  W2\n", *(" " + w for w in WORDS[3:57]), " w57 w5", "8 w59"],
            "restart_stripped",
        ),
    ],
)
async def test_the_client_gets_each_word_once(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,  # noqa: F811
    start_proxy: ProxyFactory,
    name: str,
    pieces: list[str],
    seam: str | None,
) -> None:
    primary_dies_after(fake_upstream, SENT)
    fallback_says(fallback_upstream, pieces)
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=BY_PROMPT))
    raw = await rescued_raw(proxy)
    assert b'"error"' not in raw
    assert_valid_chunks_then_done(raw)
    got = text_of(raw)
    if name.startswith("overlap by 1 word"):
        assert got == " ".join(SENT) + " w39 " + " ".join(WORDS[40:])  # "that that" may be prose
    else:
        assert got == ANSWER, name
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 1
    for note in ("restart_stripped", "overlap_stripped", "misaligned"):
        assert total(m, "brownout_stream_rescues_total", outcome=note) == (note == seam)

    # The official client reads the same text, and a complete answer.
    text, finish = await openai_text(proxy)
    assert text == got and finish == "stop"


async def test_a_restart_with_other_words_ends_with_an_error_not_a_second_answer(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,  # noqa: F811
    start_proxy: ProxyFactory,
) -> None:
    primary_dies_after(fake_upstream, SENT)
    other = [*WORDS[:12], *(f"x{i}" for i in range(50))]
    fallback_says(fallback_upstream, list(tokens(other)))
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=BY_PROMPT))
    raw = await rescued_raw(proxy)
    assert text_of(raw) == " ".join(SENT)  # nothing of the second answer
    *_, err, done = events_of(raw)
    assert done == b"[DONE]"
    error = json.loads(err)["error"]
    assert error["code"] == "rescue_misaligned" and error["type"] == "server_error"
    assert "restarted" in error["message"]
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="misaligned") == 1
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 0
    # The fallback answered: nothing is charged to it.
    assert total(m, "brownout_upstream_errors_total", backend="fallback") == 0
    assert proxy.app[STATE].current.upstreams["fallback"].breaker.state == "closed"

    seen = []
    async with client(proxy) as oai:
        stream = await oai.chat.completions.create(
            model="tiny", messages=BODY["messages"], stream=True
        )
        with pytest.raises(openai.APIError, match="restarted"):
            async for ev in stream:
                if ev.choices:
                    seen.append(ev.choices[0].delta.content or "")
    assert "".join(seen) == " ".join(SENT)


async def test_a_prefill_continuation_is_trusted_but_a_whole_restart_is_stripped(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,  # noqa: F811
    start_proxy: ProxyFactory,
) -> None:
    primary_dies_after(fake_upstream, SENT)
    fallback_says(fallback_upstream, list(tokens(WORDS)))
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    raw = await rescued_raw(proxy)
    [sent] = [json.loads(b) for p, _, b in fallback_upstream.requests if p == CHAT]
    assert sent["continue_final_message"] is True
    assert text_of(raw) == ANSWER
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="restart_stripped") == 1

    # An overlap is not looked for on the trusted path: prefill continues the text itself.
    fallback_says(fallback_upstream, list(tokens(WORDS[37:], first=False)))
    raw = await rescued_raw(proxy)
    assert text_of(raw) == " ".join(SENT) + " " + " ".join(WORDS[37:])


async def test_a_restart_that_stalls_while_held_back_keeps_the_client_and_times_out(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,  # noqa: F811
    start_proxy: ProxyFactory,
) -> None:
    """While the seam is undecided the client gets heartbeats; a fallback that
    falls silent past idle_s ends the stream with the timeout error and is
    charged for it."""
    primary_dies_after(fake_upstream, SENT)
    released = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(b"".join(chunk(t) for t in tokens(WORDS[:5])))
        await released.wait()
        return resp

    fallback_upstream.handlers[CHAT] = stalls
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        extra={**BY_PROMPT, "server": {"heartbeat_s": 0.2}},
    )
    proxy = await start_proxy(pol)
    try:
        raw = await rescued_raw(proxy)
    finally:
        released.set()
    assert b": ping\n\n" in raw.split(b": brownout-rescue", 1)[1]
    assert text_of(raw) == " ".join(SENT)  # the held restart never reached the client
    *_, err, done = events_of(raw)
    assert json.loads(err)["error"]["code"] == "upstream_timeout" and done == b"[DONE]"
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="failed") == 1
