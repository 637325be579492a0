"""The session save path with bytes nobody expects: history in Redis that is
not UTF-8 (written by something else), API keys with non-UTF-8 bytes, NULs,
huge turns, an expiry Redis refuses, Redis restarted with turns waiting."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis.asyncio as aioredis

from proxy.policy import PolicyError, parse_policy
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.saves import PendingSaves
from proxy.sessions.store import Turn, session_key
from tests.sessions.conftest import SHARED_REDIS_URL, PrivateRedis

pytestmark = pytest.mark.real


def _store(url: str = SHARED_REDIS_URL, **kw: int) -> RedisSessionStore:
    return RedisSessionStore.from_url(url, timeout_s=1.0, **kw)


async def test_history_with_invalid_utf8_loads_and_does_not_fail_other_sessions(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    # Used to: this session's load raised SessionStoreUnavailable, the store
    # was marked down, and every load batched with it failed too.
    poisoned = session_key(key_prefix, "poisoned", None)
    good = session_key(key_prefix, "good", None)
    await shared_redis.hset(
        poisoned,
        mapping={"history": b'[{"role":"user","content":"caf\xe9 \xff ok"}]', "last_active": b"0"},
    )
    store = _store()
    try:
        await store.append(good, [Turn("q", "a")])
        loads = await asyncio.gather(store.load(poisoned), store.load(good), store.load(good))
        assert loads[0] == [{"role": "user", "content": "caf\ufffd \ufffd ok"}]
        assert loads[1] == loads[2] == Turn("q", "a").messages()
        assert store.healthy
        # The session goes on: a new turn lands after what was readable.
        assert await store.append(poisoned, [Turn("q2", "a2")]) == 1
        assert [m["content"] for m in await store.load(poisoned)][-2:] == ["q2", "a2"]
        assert store.healthy
    finally:
        await store.close()


async def test_lone_surrogates_nul_and_a_huge_turn_round_trip(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    key = session_key(key_prefix, "odd", None)
    big = "x" * (4 * 1024 * 1024) + "\ud800"
    turns = [Turn("a\x00b \udfff", "c\x00d"), Turn(big, "\U0001f680")]
    store = _store()
    try:
        assert await store.append(key, turns) == 2
        assert await store.load(key) == [m for t in turns for m in t.messages()]
        assert store.healthy
    finally:
        await store.close()


def test_an_api_key_with_non_utf8_bytes_scopes_a_session() -> None:
    # aiohttp hands header bytes that are not UTF-8 over as lone surrogates
    # (surrogateescape); the scope hash used to raise UnicodeEncodeError (a
    # plain-text 500 for `Authorization: Bearer k\xff` with X-Session-Id).
    key = session_key("p:", "s", "k\udcff")
    scope = hashlib.sha256(b"k\xff").hexdigest()[:32]
    assert key == f"p:session:{scope}:s"
    assert key != session_key("p:", "s", "k\udcfe")


def test_a_session_ttl_redis_would_refuse_is_refused_by_check() -> None:
    # ttl_s: 10000000000000000000 passed `brownout check`; Redis then refused
    # every save ("value is not an integer or out of range").
    with pytest.raises(PolicyError) as info:
        parse_policy(
            "backends:\n  primary:\n    url: http://h:1\n"
            "sessions:\n  ttl_s: 10000000000000000000\n",
            "p.yaml",
            env={},
        )
    assert info.value.lines()[0].startswith("p.yaml:5: sessions.ttl_s: must be <= 315360000")


async def test_the_longest_ttl_check_allows_works_in_redis(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    key = session_key(key_prefix, "long", None)
    store = _store(ttl_s=10 * 365 * 86400)
    try:
        assert await store.append(key, [Turn("q", "a")]) == 1
        assert await shared_redis.ttl(key) > 300_000_000
    finally:
        await store.close()


async def test_turns_waiting_while_redis_restarts_are_written_in_order(
    private_redis: PrivateRedis,
) -> None:
    store = _store(private_redis.url)
    saves = PendingSaves(100)
    key = session_key("t:", "restart", None)
    try:
        assert await saves.save(store, key, Turn("one", "1", id="t1"))
        private_redis.stop()
        assert not await saves.save(store, key, Turn("two", "2", id="t2"))
        assert not await saves.save(store, key, Turn("three", "3\ud800", id="t3"))
        assert len(saves) == 2
        private_redis.start()  # empty: no persistence
        assert await saves.flush(store) == 2
        assert len(saves) == 0
        contents = [m["content"] for m in await store.load(key)]
        assert contents == ["two", "2", "three", "3\ud800"]
        # A flush that finds nothing waiting writes nothing twice.
        assert await saves.flush(store) == 0
        assert len(await store.load(key)) == 4
    finally:
        await store.close()


def test_the_redis_codec_handler_is_lossless_both_ways() -> None:
    from proxy.sessions.redis_store import DECODE_ERRORS

    text = "a\ud800b\udfff é"
    wtf8 = text.encode("utf-8", "surrogatepass")
    # Arguments are encoded with the same handler as replies are decoded.
    assert text.encode("utf-8", DECODE_ERRORS) == wtf8
    assert wtf8.decode("utf-8", DECODE_ERRORS) == text
    assert b"\xff\xed\xa0".decode("utf-8", DECODE_ERRORS) == "\ufffd\ufffd\ufffd"
