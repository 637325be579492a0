"""One client cannot fill a shared Redis: `sessions.max_sessions_per_client`.

A client (its API key when `server.api_keys` is configured, else its peer
address; never the session id, which it chooses) holds at most that many
live sessions. A new one past the cap is refused before any backend work:
429 `session_limit` with `Retry-After` (when its oldest session expires).
Its existing sessions, other clients and requests without a session go on.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from proxy.policy import SessionsPolicy
from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.store import (
    MemorySessionStore,
    SessionLimitReached,
    SessionStore,
    Turn,
    client_key,
    make_store,
    session_key,
)
from tests.integration import conftest as integration
from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_sessions_flow import (
    ChatFake,
    answer_for,
    ask,
    metric,
    policy,
    redis_sessions,
)
from tests.sessions.conftest import SHARED_REDIS_URL

fake_upstream = integration.fake_upstream
start_proxy = integration.start_proxy

NOW = 1_700_000_000
TTL = 1000


class Clock:
    def __init__(self) -> None:
        self.now: float = NOW

    def __call__(self) -> float:
        return self.now


def _memory(clock: Clock) -> SessionStore:
    return MemorySessionStore(ttl_s=TTL, max_per_client=2, clock=clock)


def _redis(clock: Clock) -> SessionStore:
    return RedisSessionStore.from_url(
        SHARED_REDIS_URL, ttl_s=TTL, timeout_s=2.0, max_per_client=2, clock=clock
    )


async def test_memory_a_client_holds_at_most_its_cap_of_live_sessions(key_prefix: str) -> None:
    clock = Clock()
    await _cap_scenario(_memory(clock), clock, key_prefix)


@pytest.mark.real
async def test_redis_a_client_holds_at_most_its_cap_of_live_sessions(
    shared_redis: aioredis.Redis, key_prefix: str
) -> None:
    clock = Clock()
    await _cap_scenario(_redis(clock), clock, key_prefix)
    # What Redis holds: the client's set, session key -> its expiry (the store's clock).
    a = client_key(key_prefix, "addr:10.0.0.1")
    members = dict(await shared_redis.zrange(a, 0, -1, withscores=True))
    assert members[session_key(key_prefix, "a3", None)] == NOW + 2 * TTL + 1
    assert 0 < await shared_redis.ttl(a) <= TTL


async def _cap_scenario(store: SessionStore, clock: Clock, key_prefix: str) -> None:
    a, b = client_key(key_prefix, "addr:10.0.0.1"), client_key(key_prefix, "addr:10.0.0.2")

    def key(sid: str) -> str:
        return session_key(key_prefix, sid, None)

    try:
        for sid in ("a1", "a2"):
            assert await store.load(key(sid), a) == []
            assert await store.append(key(sid), [Turn("q", "r")], client=a) == 1
        # A third one is refused at its load (before any backend work) ...
        with pytest.raises(SessionLimitReached) as caught:
            await store.load(key("a3"), a)
        assert caught.value.limit == 2
        assert 1 <= caught.value.retry_after_s <= TTL
        # ... and at its save too (two loads raced past the check).
        with pytest.raises(SessionLimitReached):
            await store.append(key("a3"), [Turn("q", "r")], client=a)
        assert await store.load(key("a3")) == []  # nothing was written
        # Its own sessions go on; other clients are not affected.
        assert len(await store.load(key("a1"), a)) == 2
        assert await store.append(key("a1"), [Turn("q2", "r2")], client=a) == 2
        assert await store.append(key("b1"), [Turn("q", "r")], client=b) == 1
        # Once its sessions expire (the injected clock), it may open new ones.
        clock.now += TTL + 1
        assert await store.load(key("a3"), a) == []
        assert await store.append(key("a3"), [Turn("q", "r")], client=a) == 1
    finally:
        await store.close()


async def test_hostile_identities_are_hashed_into_keys() -> None:
    for identity in ("key:k\udcff", "key:\x00\r\n", "addr:" + "x" * 100_000, "key:🚀"):
        k = client_key("p:", identity)
        assert k.startswith("p:client:") and len(k) == len("p:client:") + 32
        assert k.isascii() and k.isprintable()
    assert client_key("p:", "key:a") != client_key("p:", "addr:a")


async def test_no_cap_when_zero() -> None:
    store = make_store(SessionsPolicy(max_sessions_per_client=0))
    c = client_key("p:", "addr:x")
    for i in range(50):
        await store.append(f"p:session:anon:s{i}", [Turn("q", "a")], client=c)
    assert await store.load("p:session:anon:new", c) == []


def _check(tmp_path: Path, value: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "backends:\n  primary:\n    url: http://127.0.0.1:1\n"
        f"sessions:\n  max_sessions_per_client: {value}\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("value", ["-1", "1.5", "20000000", "lots"])
def test_brownout_check_refuses_a_bad_cap(tmp_path: Path, value: str) -> None:
    out = _check(tmp_path, value)
    assert out.returncode != 0
    assert "policy.yaml:5:" in out.stdout + out.stderr
    assert "max_sessions_per_client" in out.stdout + out.stderr


def test_brownout_check_accepts_a_cap(tmp_path: Path) -> None:
    assert _check(tmp_path, "0").returncode == 0
    assert _check(tmp_path, "500").returncode == 0


# =========================================================================== through the proxy


@pytest.mark.real
async def test_past_the_cap_a_new_session_gets_429_and_the_others_go_on(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    k1, k2 = f"sk-one-{uuid.uuid4().hex}", f"sk-two-{uuid.uuid4().hex}"
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix, max_sessions_per_client=2),
            extra={"server": {"api_keys": [k1, k2]}},
        )
    )

    def auth(k: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {k}"}

    for sid in ("s1", "s2"):
        r = await ask(proxy, f"hello {sid}", sid=sid, headers=auth(k1))
        assert r.status == 200 and r.session == "used"
    n = len(chat.bodies)
    for stream in (True, False):
        r = await ask(proxy, "one more", sid="s3", headers=auth(k1), stream=stream)
        assert r.status == 429
        err = r.error()
        assert err["code"] == "session_limit" and err["param"] == "X-Session-Id"
        assert err["type"] == "invalid_request_error"
        assert 1 <= int(r.headers["Retry-After"]) <= 86400
        assert r.headers["X-Brownout-Session"] == "limit"
    assert len(chat.bodies) == n, "refused before any backend work"
    assert await shared_redis.exists(session_key(key_prefix, "s3", k1)) == 0
    limit = {"op": "load", "result": "limit"}
    assert await metric(proxy, "brownout_session_ops_total", limit) == 2
    assert await metric(proxy, "brownout_bad_requests_total", {"reason": "session_limit"}) == 2

    # Its existing sessions go on; without a session it is served; the other key is not capped.
    r = await ask(proxy, "again", sid="s1", headers=auth(k1))
    assert r.status == 200 and r.text == answer_for("again")
    assert (await ask(proxy, "stateless", sid=None, headers=auth(k1))).status == 200
    assert (await ask(proxy, "mine", sid="s3", headers=auth(k2))).status == 200
    sessions = [k async for k in shared_redis.scan_iter(match=f"{key_prefix}session:*")]
    assert len(sessions) == 3


@pytest.mark.real
async def test_without_api_keys_the_peer_address_is_the_identity(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    """Any bearer is accepted without `server.api_keys`, so a fresh one per
    request (or a fresh session id) does not get around the cap."""
    ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(fake_upstream.url, sessions=redis_sessions(key_prefix, max_sessions_per_client=3))
    )
    statuses = []
    for i in range(5):
        bearer = {"Authorization": f"Bearer sk-made-up-{i}"}
        statuses.append((await ask(proxy, "hi", sid=f"s{i}", headers=bearer)).status)
    assert statuses == [200, 200, 200, 429, 429]
