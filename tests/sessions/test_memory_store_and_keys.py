"""MemorySessionStore (LRU + TTL on an injected clock), session keys, the policy knobs."""

from __future__ import annotations

import asyncio

import pytest

from proxy.policy import PolicyError, SessionsPolicy, TrimPolicy, parse_policy
from proxy.sessions.store import MemorySessionStore, SessionIdError, Turn, make_store, session_key


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def contents(history: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in history]


async def test_memory_save_load_and_turn_cap() -> None:
    store = MemorySessionStore(max_turns=2)
    assert await store.load("k") == []
    for i in range(3):
        assert await store.append("k", [Turn(f"q{i}", f"a{i}")]) == min(i + 1, 2)
    history = await store.load("k")
    assert history == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    history[0]["content"] = "edited by the caller"
    assert contents(await store.load("k"))[0] == "q1", "callers get a copy"
    assert await store.append("k", [], max_turns=5) == 2
    assert await store.append("new", []) == 0
    assert len(store) == 1, "an empty append creates nothing"


async def test_memory_ttl_expires_and_use_refreshes_it() -> None:
    clock = Clock()
    store = MemorySessionStore(ttl_s=100, clock=clock)
    await store.append("k", [Turn("q", "a")])
    clock.now += 99
    assert len(await store.load("k")) == 2  # refreshes: expires at +199 now
    clock.now += 99
    assert len(await store.load("k")) == 2
    clock.now += 100
    assert await store.load("k") == []
    assert len(store) == 0
    # A per-call ttl_s on append.
    await store.append("k", [Turn("q", "a")], ttl_s=10)
    clock.now += 11
    assert await store.load("k") == []


async def test_memory_lru_bound_evicts_least_recently_used() -> None:
    store = MemorySessionStore(max_sessions=3)
    for key in ("a", "b", "c"):
        await store.append(key, [Turn(key, key)])
    await store.load("a")  # a is now the most recent; b the least
    await store.append("d", [Turn("d", "d")])
    assert len(store) == 3
    assert await store.load("b") == []
    for key in ("a", "c", "d"):
        assert contents(await store.load(key)) == [key, key]


async def test_memory_expired_sessions_are_swept_on_insert() -> None:
    clock = Clock()
    store = MemorySessionStore(ttl_s=10, clock=clock)
    for key in ("a", "b"):
        await store.append(key, [Turn(key, key)])
    clock.now += 11
    await store.append("c", [Turn("c", "c")])
    assert len(store) == 1


async def test_memory_parallel_appends_keep_all_turns() -> None:
    store = MemorySessionStore(max_turns=50)
    await asyncio.gather(*(store.append("k", [Turn(f"q{i}", f"a{i}")]) for i in range(20)))
    history = await store.load("k")
    assert contents(history) == [x for i in range(20) for x in (f"q{i}", f"a{i}")]


async def test_memory_store_is_always_healthy_and_closes() -> None:
    store = make_store(SessionsPolicy(store="memory://", max_sessions=5, max_turns=1))
    assert isinstance(store, MemorySessionStore)
    assert store.max_sessions == 5
    assert store.healthy
    assert store.last_error is None
    assert await store.ping()
    await store.append("k", [Turn("q1", "a1"), Turn("q2", "a2")])
    assert contents(await store.load("k")) == ["q2", "a2"]
    await store.delete("k")
    assert await store.load("k") == []
    await store.close()


async def test_memory_scoped_keys_do_not_cross() -> None:
    store = MemorySessionStore()
    await store.append(session_key("p:", "s1", "key-a"), [Turn("secret", "ok")])
    assert await store.load(session_key("p:", "s1", "key-b")) == []
    assert await store.load(session_key("p:", "s1", None)) == []


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "session_id",
    ["a", "A-z_0.9:x", "x" * 128, "550e8400-e29b-41d4-a716-446655440000", "user:42:chat:7"],
)
def test_valid_session_ids(session_id: str) -> None:
    assert session_key("p:", session_id, None) == f"p:session:anon:{session_id}"


@pytest.mark.parametrize(
    "session_id",
    ["", "x" * 129, "has space", "slash/no", "star*", "new\nline", "é", "{braces}", "a\x00"],
)
def test_invalid_session_ids_raise(session_id: str) -> None:
    with pytest.raises(SessionIdError):
        session_key("p:", session_id, "k")
    assert issubclass(SessionIdError, ValueError)


def test_api_key_scopes_the_session() -> None:
    a = session_key("p:", "chat", "sk-a")
    b = session_key("p:", "chat", "sk-b")
    assert a != b
    assert a == session_key("p:", "chat", "sk-a"), "stable across requests"
    assert "sk-a" not in a, "the key itself never appears"
    scope = a.split(":")[2]
    assert len(scope) == 32
    assert int(scope, 16) >= 0
    assert session_key("p:", "chat", "") == session_key("p:", "chat", None)


def test_an_id_with_colons_cannot_reach_another_scope() -> None:
    keyed = session_key("p:", "chat", "sk-a")
    scope = keyed.split(":")[2]
    # The anonymous namespace is `anon:`; an id that spells a scope stays inside it.
    forged = session_key("p:", f"{scope}:chat", None)
    assert forged != keyed
    assert forged.startswith("p:session:anon:")


# --------------------------------------------------------------------------- policy


def test_policy_defaults_and_yaml() -> None:
    p = SessionsPolicy()
    assert (p.redis_timeout_s, p.max_sessions, p.redis_max_connections) == (0.25, 10000, 32)
    assert p.trimming == TrimPolicy()
    text = (
        "backends:\n  primary:\n    url: http://x:1\n"
        "sessions:\n  store: redis://127.0.0.1:6379/0\n  redis_timeout_s: 0.1\n"
        "  trimming:\n    high_water: 0.8\n    low_water: 0.5\n    trim_stateless: false\n"
    )
    s = parse_policy(text).sessions
    assert s.redis_timeout_s == 0.1
    assert s.trimming == TrimPolicy(high_water=0.8, low_water=0.5, trim_stateless=False)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "  trimming:\n    high_water: 0.5\n    low_water: 0.8\n",
            "low_water: must be < high_water",
        ),
        ("  trimming:\n    high_water: 1.5\n", "high_water: must be <= 1"),
        ("  trimming:\n    margin_tokens: -1\n", "margin_tokens"),
        ("  redis_timeout_s: 0\n", "redis_timeout_s"),
        ("  max_sessions: 0\n", "max_sessions"),
    ],
)
def test_policy_rejects_bad_values_with_a_line(section: str, message: str) -> None:
    text = "backends:\n  primary:\n    url: http://x:1\nsessions:\n" + section
    with pytest.raises(PolicyError) as err:
        parse_policy(text, "p.yaml")
    assert any(line.startswith("p.yaml:") and message in line for line in err.value.lines())
