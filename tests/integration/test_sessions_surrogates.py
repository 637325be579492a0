"""Lone surrogates in a session turn (issue 13, defect 5), against real Redis.

`"\\ud800"` is a legal JSON escape that decodes to a code point UTF-8 cannot
hold. In a client's message it is refused at ingress (400, nothing stored:
backends' tokenizers cannot encode it either); in the model's output it must
reach the client whole, the turn must be stored and read back as it was, and
the pending-save queue must not stick on it: later turns, on this session and
on others, are still saved.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_sessions_flow import (
    DONE,
    SHARED_REDIS_URL,
    SYSTEM,
    ChatFake,
    PrivateRedis,
    ask,
    assistant,
    completion,
    get_status,
    metric,
    new_sid,
    policy,
    redis_sessions,
    user,
    wait_for,
)
from tests.integration.test_sessions_flow import key_prefix as key_prefix
from tests.integration.test_sessions_flow import private_redis as private_redis
from tests.integration.test_sessions_flow import shared_redis as shared_redis

pytestmark = pytest.mark.real

LONE = "half a pair: \ud800 and \udfff"
QUESTION = "what is half a pair?"


def answer_with_surrogate(question: str) -> str:
    return f"echo \udc00 of «{question}»"


async def history(url: str, key: str) -> list[dict[str, Any]] | None:
    """The stored history as Python text: WTF-8 bytes read back losslessly."""
    client = aioredis.Redis.from_url(url)  # bytes: no decoding on the way
    try:
        raw = await client.hget(key, "history")
    finally:
        await client.aclose()
    if raw is None:
        return None
    return cast(list[dict[str, Any]], json.loads(raw.decode("utf-8", "surrogatepass")))


def key_of(prefix: str, sid: str) -> str:
    return f"{prefix}session:anon:{sid}"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_lone_surrogates_are_answered_stored_and_read_back(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
    stream: bool,
) -> None:
    chat = ChatFake(fake_upstream, answer=answer_with_surrogate)
    proxy = await start_proxy(policy(fake_upstream.url, sessions=redis_sessions(key_prefix)))
    sid = new_sid()
    refused = await ask(proxy, LONE, sid=sid, stream=stream)
    assert refused.status == 400, refused.raw
    assert json.loads(refused.raw)["error"]["code"] == "invalid_json"
    assert await history(SHARED_REDIS_URL, key_of(key_prefix, sid)) is None

    r = await ask(proxy, QUESTION, sid=sid, stream=stream)
    # The whole answer reached the client (a cut stream fails the read).
    assert r.status == 200, r.raw
    assert r.session == "used"
    assert r.text == answer_with_surrogate(QUESTION)
    if stream:
        assert r.events()[-1] == DONE[len("data: ") : -2]
    turn = [user(QUESTION), assistant(answer_with_surrogate(QUESTION))]
    assert await history(SHARED_REDIS_URL, key_of(key_prefix, sid)) == turn
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "ok"}) == 1

    # Read back as it was written: the next turn carries the same code points.
    r = await ask(proxy, "and then?", sid=sid, stream=stream)
    assert r.status == 200
    assert chat.messages() == [SYSTEM, *turn, user("and then?")]
    assert await history(SHARED_REDIS_URL, key_of(key_prefix, sid)) == [
        *turn,
        user("and then?"),
        assistant(answer_with_surrogate("and then?")),
    ]
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "ok"}) == 2


async def test_a_surrogate_turn_queued_in_an_outage_does_not_block_later_saves(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    private_redis: PrivateRedis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix, private_redis.url, redis_timeout_s=0.3),
        )
    )
    sid, other = new_sid(), new_sid()
    assert (await ask(proxy, "before", sid=sid)).session == "used"

    # Redis dies between the load and the save of a turn with a lone surrogate.
    async def redis_dies_then_answers(request: web.Request) -> web.StreamResponse:
        await asyncio.to_thread(private_redis.stop)
        return web.json_response(completion("broken \ud83d pair"))

    chat.script.append(redis_dies_then_answers)
    r = await ask(proxy, QUESTION, sid=sid, stream=False)
    assert r.status == 200 and r.text == "broken \ud83d pair"
    assert await metric(proxy, "brownout_session_saves_waiting") == 1

    # Back: the waiting turn is written, then later turns on both sessions are.
    await asyncio.to_thread(private_redis.start)

    async def drained() -> bool:
        return await metric(proxy, "brownout_session_saves_waiting") == 0

    await wait_for(drained, "the waiting turn to be written", within=10)
    queued_turn = [user(QUESTION), assistant("broken \ud83d pair")]
    assert await history(private_redis.url, key_of(key_prefix, sid)) == queued_turn
    for s, q in ((sid, "after"), (other, "elsewhere")):
        r = await ask(proxy, q, sid=s)
        assert r.status == 200 and r.session == "used"
        assert r.text == chat.answered[q]
    assert await history(private_redis.url, key_of(key_prefix, sid)) == [
        *queued_turn,
        user("after"),
        assistant(chat.answered["after"]),
    ]
    assert await history(private_redis.url, key_of(key_prefix, other)) == [
        user("elsewhere"),
        assistant(chat.answered["elsewhere"]),
    ]
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "late"}) == 1
    assert (await get_status(proxy))["sessions"]["saves_waiting"] == 0
    rejected = {"op": "save", "result": "rejected"}
    assert await metric(proxy, "brownout_session_ops_total", rejected) == 0
