"""RedisSessionStore against real Redis: the shared server, and private ones for faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.policy import SessionsPolicy
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.store import (
    SessionStoreUnavailable,
    SessionTurnRejected,
    Turn,
    make_store,
    session_key,
)
from tests.harness.procs import free_port
from tests.sessions.conftest import SHARED_REDIS_URL, PrivateRedis

pytestmark = pytest.mark.real

NOW = 1_700_000_000


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _store(
    url: str = SHARED_REDIS_URL,
    *,
    ttl_s: int = 86400,
    max_turns: int = 20,
    timeout_s: float = 1.0,
    max_connections: int = 32,
    clock: Clock | None = None,
) -> RedisSessionStore:
    return RedisSessionStore.from_url(
        url,
        ttl_s=ttl_s,
        max_turns=max_turns,
        timeout_s=timeout_s,
        max_connections=max_connections,
        clock=clock or time.time,
    )


async def test_save_load_ttl_and_last_active(shared_redis: aioredis.Redis, key_prefix: str) -> None:
    clock = Clock()
    store = _store(ttl_s=1000, max_turns=5, clock=clock)
    key = session_key(key_prefix, "chat-1", None)
    try:
        assert await store.load(key) == []
        assert await shared_redis.exists(key) == 0, "a load must not create a session"

        assert await store.append(key, [Turn("Hello?", "Hi!")]) == 1
        assert await store.load(key) == [
            {"role": "user", "content": "Hello?"},
            {"role": "assistant", "content": "Hi!"},
        ]
        assert await shared_redis.type(key) == "hash"
        assert await shared_redis.hget(key, "last_active") == str(NOW)
        assert 990 <= await shared_redis.ttl(key) <= 1000

        # A load refreshes both the TTL and last_active.
        await shared_redis.expire(key, 5)
        clock.now += 60
        await store.load(key)
        assert 990 <= await shared_redis.ttl(key) <= 1000
        assert await shared_redis.hget(key, "last_active") == str(NOW + 60)

        # So does an append, with its own ttl_s.
        clock.now += 60
        await store.append(key, [Turn("Again", "Sure")], ttl_s=500)
        assert 490 <= await shared_redis.ttl(key) <= 500
        assert await shared_redis.hget(key, "last_active") == str(NOW + 120)
        assert len(await store.load(key)) == 4
        assert store.healthy
        assert store.last_error is None
    finally:
        await store.close()


async def test_unicode_and_json_specials_round_trip(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store()
    key = session_key(key_prefix, "u", None)
    text = 'Grüße / "quotes" \\ back\nslash 🚀 {"json": [1]}'
    try:
        await store.append(key, [Turn(text, text[::-1])])
        assert [m["content"] for m in await store.load(key)] == [text, text[::-1]]
    finally:
        await store.close()


async def test_turn_cap_keeps_the_newest_whole_turns(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store(max_turns=3)
    key = session_key(key_prefix, "cap", None)
    try:
        for i in range(5):
            n = await store.append(key, [Turn(f"q{i}", f"a{i}")])
            assert n == min(i + 1, 3)
        history = await store.load(key)
        assert [m["content"] for m in history] == ["q2", "a2", "q3", "a3", "q4", "a4"]
        # Several turns in one append, and a per-call cap.
        assert await store.append(key, [Turn("q5", "a5"), Turn("q6", "a6")], max_turns=2) == 2
        assert [m["content"] for m in await store.load(key)] == ["q5", "a5", "q6", "a6"]
    finally:
        await store.close()


async def test_twenty_parallel_appends_keep_all_turns_in_commit_order(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    # Two stores = two proxy replicas with their own pools, on one session.
    stores = [_store(max_turns=50, max_connections=8, timeout_s=2.0) for _ in range(2)]
    key = session_key(key_prefix, "race", "client-key")
    try:
        positions = await asyncio.gather(
            *(stores[i % 2].append(key, [Turn(f"q{i}", f"a{i}")]) for i in range(20))
        )
        history = await stores[0].load(key)
        assert len(history) == 40
        assert sorted(positions) == list(range(1, 21))
        for i, n in enumerate(positions):
            # Each append's answer is the history length at its commit: its turn sits there.
            assert history[2 * (n - 1)] == {"role": "user", "content": f"q{i}"}
            assert history[2 * n - 1] == {"role": "assistant", "content": f"a{i}"}
    finally:
        for s in stores:
            await s.close()


async def test_parallel_appends_over_the_cap_keep_whole_turns(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store(max_turns=5, max_connections=8, timeout_s=2.0)
    key = session_key(key_prefix, "race-cap", None)
    try:
        await asyncio.gather(*(store.append(key, [Turn(f"q{i}", f"a{i}")]) for i in range(20)))
        history = await store.load(key)
        assert len(history) == 10
        for user, answer in zip(history[::2], history[1::2], strict=True):
            assert user["role"] == "user"
            assert answer == {"role": "assistant", "content": "a" + user["content"][1:]}
        assert len({m["content"] for m in history}) == 10
    finally:
        await store.close()


async def test_key_scoping_no_cross_read(shared_redis: aioredis.Redis, key_prefix: str) -> None:
    store = _store()
    alice = session_key(key_prefix, "same-id", "sk-alice")
    bob = session_key(key_prefix, "same-id", "sk-bob")
    anon = session_key(key_prefix, "same-id", None)
    assert len({alice, bob, anon}) == 3
    try:
        await store.append(alice, [Turn("alice's secret", "noted")])
        assert await store.load(bob) == []
        assert await store.load(anon) == []
        assert len(await store.load(alice)) == 2
    finally:
        await store.close()


async def test_unreadable_history_is_replaced_not_fatal(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store()
    key = session_key(key_prefix, "corrupt", None)
    try:
        await shared_redis.hset(key, mapping={"history": "{not json", "last_active": "0"})
        assert await store.load(key) == []
        assert await store.append(key, [Turn("q", "a")]) == 1
        assert len(await store.load(key)) == 2
        assert store.healthy
    finally:
        await store.close()


async def test_empty_append_does_not_create_a_session(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store()
    key = session_key(key_prefix, "empty", None)
    try:
        assert await store.append(key, []) == 0
        assert await shared_redis.exists(key) == 0
    finally:
        await store.close()


async def test_make_store_redis_uses_policy(shared_redis: aioredis.Redis, key_prefix: str) -> None:
    policy = SessionsPolicy(store=SHARED_REDIS_URL, ttl_s=700, max_turns=1, key_prefix=key_prefix)
    store = make_store(policy)
    assert isinstance(store, RedisSessionStore)
    key = session_key(policy.key_prefix, "p", None)
    try:
        await store.append(key, [Turn("q1", "a1"), Turn("q2", "a2")])
        assert [m["content"] for m in await store.load(key)] == ["q2", "a2"]
        assert 690 <= await shared_redis.ttl(key) <= 700
        assert await store.ping()
    finally:
        await store.close()


def test_pooled_connections_have_no_socket_timeout() -> None:
    """Every call is bounded by the store's own deadline (`_call`, the batch's
    watchdog); redis-py 8 defaults socket_timeout to 5 s, which wraps each
    reply read in a timeout scope and each write in a wait_for task."""
    store = RedisSessionStore.from_url(SHARED_REDIS_URL, timeout_s=0.25)
    kwargs = store._client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] is None
    assert kwargs["socket_connect_timeout"] == 0.25
    conn = store._client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    assert conn.socket_timeout is None


# --------------------------------------------------------------------------- faults

TIMEOUT_S = 0.25
# Deadline plus scheduling slack on a busy 2-core machine.
PROMPT_S = TIMEOUT_S + 0.25


def _status(store: RedisSessionStore) -> tuple[bool, str | None]:
    return store.healthy, store.last_error


async def _timed_failure(op: Awaitable[object]) -> float:
    started = time.monotonic()
    with pytest.raises(SessionStoreUnavailable):
        await op
    return time.monotonic() - started


async def test_redis_down_fails_fast_then_recovers_without_restart(
    private_redis: PrivateRedis,
) -> None:
    store = _store(private_redis.url, timeout_s=TIMEOUT_S)
    key = session_key("t:", "outage", None)
    try:
        await store.append(key, [Turn("before", "outage")])
        assert store.healthy

        private_redis.stop()
        assert await _timed_failure(store.load(key)) < PROMPT_S
        healthy, last_error = _status(store)
        assert not healthy
        assert last_error is not None
        assert "load" in last_error
        assert await _timed_failure(store.append(key, [Turn("q", "a")])) < PROMPT_S
        assert not await store.ping()

        private_redis.start()  # same port, empty (no persistence)
        assert await store.load(key) == []
        assert store.healthy
        assert await store.append(key, [Turn("after", "outage")]) == 1
        assert [m["content"] for m in await store.load(key)] == ["after", "outage"]
    finally:
        await store.close()


async def test_hung_redis_times_out_then_recovers(private_redis: PrivateRedis) -> None:
    store = _store(private_redis.url, timeout_s=TIMEOUT_S, max_connections=4)
    key = session_key("t:", "hung", None)
    try:
        await store.append(key, [Turn("q0", "a0")])
        private_redis.pause()
        # More concurrent calls than pooled connections: pool waits are bounded too.
        started = time.monotonic()
        results = await asyncio.gather(
            *(store.load(key) for _ in range(8)),
            store.append(key, [Turn("q1", "a1")]),
            return_exceptions=True,
        )
        assert time.monotonic() - started < PROMPT_S
        assert all(isinstance(r, SessionStoreUnavailable) for r in results), results
        assert store.last_error is not None
        assert "timed out" in store.last_error

        private_redis.resume()
        history = await store.load(key)
        # The timed-out append may or may not have been applied, never half of it.
        assert [m["content"] for m in history][:2] == ["q0", "a0"]
        assert len(history) in (2, 4)
        assert store.healthy
    finally:
        await store.close()


async def test_redis_never_reachable() -> None:
    store = _store(f"redis://127.0.0.1:{free_port()}/0", timeout_s=TIMEOUT_S)
    try:
        assert await _timed_failure(store.load("k")) < PROMPT_S
        assert not store.healthy
    finally:
        await store.close()


async def test_a_retried_append_is_stored_once(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    # A save that timed out may still have landed; retrying it must not duplicate it.
    store = RedisSessionStore(shared_redis, ttl_s=60, max_turns=10, timeout_s=1.0)
    key = session_key(key_prefix, "retry", None)
    turn = Turn("q", "a", id="t-1")
    await store.append(key, [turn])
    await store.append(key, [turn])
    await store.append(key, [Turn("q2", "a2", id="t-2")])
    history = await store.load(key)
    assert [m["content"] for m in history] == ["q", "a", "q2", "a2"]


async def test_concurrent_calls_share_pipelines(
    shared_redis: aioredis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads and appends from concurrent requests go out together: far fewer
    pipelines than calls, and every caller still gets its own answer."""
    store = _store(max_connections=4)
    sent: list[int] = []
    real = store._scripts._pipeline

    async def counting(calls: list) -> list:  # type: ignore[type-arg]
        sent.append(len(calls))
        return await real(calls)

    monkeypatch.setattr(store._scripts, "_pipeline", counting)
    keys = [session_key(key_prefix, f"batch{i}", None) for i in range(30)]
    try:
        await asyncio.gather(
            *(store.append(k, [Turn(f"q{i}", f"a{i}")]) for i, k in enumerate(keys))
        )
        histories = await asyncio.gather(*(store.load(k) for k in keys))
        for i, h in enumerate(histories):
            assert [m["content"] for m in h] == [f"q{i}", f"a{i}"]
        assert sum(sent) == 60
        assert len(sent) <= 4, sent  # 30 appends, then 30 loads: a batch or two each
    finally:
        await store.close()


async def test_a_finished_batch_cancels_its_calls_deadlines(
    shared_redis: aioredis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call's deadline timer goes when its batch ends (answered, or
    failed): none is left to fire `timeout_s` later."""
    store = _store(timeout_s=30.0)
    seen: list = []  # type: ignore[type-arg]
    real = store._scripts._pipeline

    async def keeping(calls: list) -> list:  # type: ignore[type-arg]
        seen.extend(calls)
        return await real(calls)

    monkeypatch.setattr(store._scripts, "_pipeline", keeping)
    key = session_key(key_prefix, "timers", None)
    try:
        await asyncio.gather(store.append(key, [Turn("q", "a")]), store.load(key))
        for _ in range(3):  # the batch task's done callback runs a loop iteration later
            await asyncio.sleep(0)
        assert len(seen) == 2
        assert all(c.timer.cancelled() for c in seen)

        async def failing(calls: list) -> list:  # type: ignore[type-arg]
            seen[:] = calls
            raise ConnectionError("down")

        monkeypatch.setattr(store._scripts, "_pipeline", failing)
        with pytest.raises(SessionStoreUnavailable):
            await store.load(key)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(seen) == 1 and seen[0].timer.cancelled()
    finally:
        await store.close()


async def test_batches_reuse_their_connections(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pool checkout for batches one after the other; a kept connection
    the server closed reconnects; the store's close hands them back."""
    store = _store(private_redis.url, timeout_s=2.0)
    pool = store._client.connection_pool
    checkouts = 0
    real = pool.get_connection

    async def counting() -> object:
        nonlocal checkouts
        checkouts += 1
        return await real()  # type: ignore[no-untyped-call]

    monkeypatch.setattr(pool, "get_connection", counting)
    key = session_key("t:", "reuse", None)
    try:
        assert await store.append(key, [Turn("q0", "a0")]) == 1  # and its SCRIPT LOAD
        first = checkouts
        for i in range(1, 4):
            assert await store.append(key, [Turn(f"q{i}", f"a{i}")]) == i + 1
        assert checkouts == first
        private_redis.stop()
        private_redis.start()  # same port, empty: the kept connection is closed
        assert await store.load(key) == []
        assert await store.append(key, [Turn("q", "a")]) == 1
        assert [m["content"] for m in await store.load(key)] == ["q", "a"]
    finally:
        await store.close()
    assert not pool._in_use_connections


async def test_scripts_flushed_from_redis_are_loaded_again(private_redis: PrivateRedis) -> None:
    """After a Redis restart (or SCRIPT FLUSH) the first calls get NOSCRIPT;
    they are retried after SCRIPT LOAD instead of failing. (A private server:
    flushing the shared one would disturb its other users.)"""
    store = _store(private_redis.url)
    admin = aioredis.from_url(private_redis.url)
    key = session_key("t:", "noscript", None)
    try:
        await store.append(key, [Turn("q0", "a0")])
        await admin.script_flush()
        results = await asyncio.gather(store.load(key), store.append(key, [Turn("q1", "a1")]))
        assert [m["content"] for m in results[0]] == ["q0", "a0"]
        assert results[1] == 2
        assert store.healthy
    finally:
        await admin.aclose()
        await store.close()


async def test_lone_surrogates_round_trip_losslessly(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store()
    key = session_key(key_prefix, "surrogates", None)
    odd = Turn("lone \ud800 high, lone \udfff low", "reversed pair \udc00\ud83d, é 🚀")
    try:
        assert await store.append(key, [odd, Turn("plain", "text")]) == 2
        assert await store.load(key) == [*odd.messages(), *Turn("plain", "text").messages()]
        # Valid text is plain UTF-8 in Redis; only the lone surrogates are WTF-8.
        raw_client = aioredis.Redis.from_url(SHARED_REDIS_URL)
        raw = await raw_client.hget(key, "history")
        await raw_client.aclose()
        assert "é 🚀".encode() in raw
        assert "\ud800".encode("utf-8", "surrogatepass") in raw
    finally:
        await store.close()


async def test_a_turn_the_script_refuses_is_rejected_not_an_outage(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    store = _store()
    key = session_key(key_prefix, "taken", None)
    await shared_redis.set(key, "not a session hash")  # the script's HGET fails on it
    try:
        with pytest.raises(SessionTurnRejected):
            await store.append(key, [Turn("q", "a")])
        assert store.healthy  # the store answered: other turns still save
        other = session_key(key_prefix, "free", None)
        assert await store.append(other, [Turn("q", "a")]) == 1
    finally:
        await store.close()


class _Wire:
    """Counts what goes over the wire: each `send_packed_command` is one
    write of one or more commands (a pipeline is one), answered by one read
    of their replies: a round trip."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes: list[list[str]] = []
        real = aioredis.connection.Connection.send_packed_command
        wire = self

        async def counting(self: Any, command: Any, check_health: bool = True) -> None:
            parts = [command] if isinstance(command, (bytes, str)) else list(command)
            blob = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts)
            # The command names of a RESP array: the line after each `*N` / `$len` header.
            names = [
                lines[i + 2].decode().upper()
                for lines in [blob.split(b"\r\n")]
                for i, line in enumerate(lines[:-2])
                if line.startswith(b"*")
            ]
            wire.writes.append(names)
            await real(self, parts, check_health)

        monkeypatch.setattr(aioredis.connection.Connection, "send_packed_command", counting)

    def take(self) -> list[list[str]]:
        out, self.writes = self.writes, []
        return out


@pytest.mark.parametrize("cap", [0, 5], ids=["no-cap", "client-cap"])
async def test_one_round_trip_per_load_and_per_save(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    """Issue 24: a session load is one round trip and a save is one, whatever
    the session holds (new, existing, over the turn cap) — one EVALSHA each,
    nothing else on the wire once the connection and the scripts are there."""
    store = RedisSessionStore.from_url(
        private_redis.url, ttl_s=600, max_turns=2, timeout_s=2.0, max_per_client=cap
    )
    wire = _Wire(monkeypatch)
    client = "client-a" if cap else None
    try:
        # Warm-up: the connection's handshake, the scripts' first NOSCRIPT.
        warm = session_key("rt:", "warm", None)
        await store.load(warm, client)
        await store.append(warm, [Turn("q", "a")], client=client)
        wire.take()
        key = session_key("rt:", "conv", None)
        assert await store.load(key, client) == []  # a new session
        assert wire.take() == [["EVALSHA"]]
        for i in range(4):  # creates it, adds to it, then trims it (max_turns 2)
            await store.append(key, [Turn(f"q{i}", f"a{i}", id=f"t{i}")], client=client)
            assert wire.take() == [["EVALSHA"]], f"save {i}"
            history = await store.load(key, client)
            assert wire.take() == [["EVALSHA"]], f"load {i}"
            assert len(history) == min(2 * (i + 1), 4)
    finally:
        await store.close()
