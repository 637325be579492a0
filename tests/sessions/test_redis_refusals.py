"""Redis refusing work is an outage of the session store, not a bad turn.

A private `redis-server` is put into each refusal state for real:

- OOM: filled, then `maxmemory 1mb` under `maxmemory-policy noeviction`;
- READONLY: `REPLICAOF` a master that does not exist (`replica-read-only yes`);
- BUSY: a Lua busy loop past `busy-reply-threshold`;
- MISCONF: `save` points, `stop-writes-on-bgsave-error yes`, `dir` unwritable, a failed BGSAVE.

Inside our scripts Redis reports the refused write with `@user_script` in
the text; the old code took that for a bad turn (dropped after 3 tries, the
store still "up", and a load failed because it refreshed the TTL).

What a user notices, through the proxy: the answer arrives; the status and
`brownout_session_store_up` say the store is down; the refusal is counted
(`brownout_session_store_errors_total{reason}`); the turn waits and is in
Redis once it takes writes again; loads work during a write refusal (the
conversation keeps its context, the waiting turn included).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web

from proxy.sessions.redis_store import RedisSessionStore
from proxy.sessions.refusals import is_script_error, refusal_reason
from proxy.sessions.store import (
    SessionStoreUnavailable,
    SessionTurnRejected,
    Turn,
    session_key,
)
from tests.harness.procs import free_port
from tests.integration import conftest as integration
from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_sessions_flow import (
    SYSTEM,
    ChatFake,
    answer_for,
    ask,
    assistant,
    completion,
    get_status,
    metric,
    new_sid,
    policy,
    redis_sessions,
    stored,
    user,
)
from tests.sessions.conftest import PrivateRedis

pytestmark = pytest.mark.real

# The integration fixtures (a scriptable fake upstream, the real proxy).
fake_upstream = integration.fake_upstream
start_proxy = integration.start_proxy

KINDS = ["oom", "readonly", "busy", "misconf"]
WRITE_REFUSALS = ["oom", "readonly", "misconf"]  # reads still work
CODE = {"oom": "OOM", "readonly": "READONLY", "busy": "BUSY", "misconf": "MISCONF"}

BUSY_LUA = """
local t = redis.call('TIME')
while true do
  if tonumber(redis.call('TIME')[1]) - tonumber(t[1]) > 20 then break end
end
return 1
"""


@dataclass
class Refusal:
    """Puts a private Redis into one refusal state, and takes it out again."""

    kind: str
    server: PrivateRedis
    _busy: threading.Thread | None = None
    _busy_error: list[BaseException] = field(default_factory=list)

    def _raw(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, decode_responses=True, socket_timeout=5)

    def _refused(self) -> str | None:
        """The error a plain write gets now (None: it is accepted)."""
        try:
            with self._raw() as r:
                r.set("refusal-probe", "x")
        except redis.RedisError as exc:  # redis-py strips a known code off the text
            code = getattr(exc, "status_code", None)
            return f"{code} {exc}" if code else str(exc)
        return None

    def enter(self) -> None:
        r = self._raw()
        try:
            if self.kind == "oom":
                r.config_set("maxmemory-policy", "noeviction")
                for i in range(24):  # ~2.4 MB
                    r.set(f"filler:{i}", "x" * 100_000)
                r.config_set("maxmemory", "1mb")
            elif self.kind == "readonly":
                r.config_set("replica-read-only", "yes")
                r.replicaof("127.0.0.1", free_port())  # nobody there: stays a stale replica
            elif self.kind == "busy":
                r.config_set("busy-reply-threshold", "50")
                self._busy = threading.Thread(target=self._run_busy, daemon=True)
                self._busy.start()
            elif self.kind == "misconf":
                r.config_set("save", "3600 1")
                r.config_set("stop-writes-on-bgsave-error", "yes")
                r.config_set("dir", "/proc")  # nobody can create a file there, root neither
                r.bgsave()
                _until(lambda: _bgsave_status(r) == "err", "a failed BGSAVE")
        finally:
            r.close()
        _until(lambda: (self._refused() or "").startswith(CODE[self.kind]), f"{self.kind}")

    def _run_busy(self) -> None:
        try:
            with self._raw() as r:
                r.eval(BUSY_LUA, 0)
        except redis.RedisError as exc:  # killed: expected
            self._busy_error.append(exc)

    def leave(self) -> None:
        r = self._raw()
        try:
            if self.kind == "oom":
                r.config_set("maxmemory", "0")
            elif self.kind == "readonly":
                r.replicaof("NO", "ONE")
            elif self.kind == "busy":
                r.script_kill()
                assert self._busy is not None
                self._busy.join(10)
            elif self.kind == "misconf":
                r.config_set("dir", str(self.server.workdir))  # the disk is back
                r.bgsave()
                _until(lambda: _bgsave_status(r) == "ok", "a BGSAVE that works")
        finally:
            r.close()
        _until(lambda: self._refused() is None, f"the end of {self.kind}")


def _bgsave_status(r: redis.Redis) -> str:
    info: dict[str, Any] = r.info("persistence")
    if info["rdb_bgsave_in_progress"]:
        return "running"
    return str(info["rdb_last_bgsave_status"])


def _until(check: Any, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def refusal(request: pytest.FixtureRequest, private_redis: PrivateRedis) -> Refusal:
    return Refusal(request.param, private_redis)


@contextlib.asynccontextmanager
async def raw_client(server: PrivateRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


# =========================================================================== the classifier


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "OOM command not allowed when used memory > 'maxmemory'. "
            "script: af67, on @user_script:1.",
            "oom",
        ),
        (
            "READONLY You can't write against a read only replica. script: x, on @user_script:3.",
            "readonly",
        ),
        (
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN "
            "NOSAVE.",
            "busy",
        ),
        (
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
            "persist to disk. script: bd6f, on @user_script:1.",
            "misconf",
        ),
        ("LOADING Redis is loading the dataset in memory", "loading"),
        ("NOREPLICAS Not enough good replicas to write.", "noreplicas"),
        (
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "masterdown",
        ),
    ],
)
def test_refusals_are_outages_even_inside_a_script(text: str, reason: str) -> None:
    assert refusal_reason(text) == reason
    assert not is_script_error(text)


@pytest.mark.parametrize(
    "text",
    [
        "ERR user_script:12: Expected value but found invalid token at character 1 "
        "script: 1f2e, on @user_script:12.",
        "ERR Error running script (call to f_abc): @user_script:3: bad argument",
        "OOMPH is not a code user_script",  # a word that starts like one is not one
    ],
)
def test_a_script_error_is_the_turns_fault(text: str) -> None:
    assert refusal_reason(text) is None
    assert is_script_error(text)


# =========================================================================== the store


@pytest.mark.parametrize("refusal", KINDS, indirect=True)
async def test_store_refusal_is_an_outage_and_a_load_needs_no_write(refusal: Refusal) -> None:
    errors: list[tuple[str, str]] = []
    store = RedisSessionStore.from_url(
        refusal.server.url, timeout_s=2.0, on_error=lambda op, why: errors.append((op, why))
    )
    key = session_key("t:", "s", None)
    try:
        await store.append(key, [Turn("q1", "a1", "t1")])
        await asyncio.to_thread(refusal.enter)
        with pytest.raises(SessionStoreUnavailable) as caught:
            await store.append(key, [Turn("q2", "a2", "t2")])
        assert not isinstance(caught.value, SessionTurnRejected), "an outage, not a bad turn"
        assert caught.value.reason == refusal.kind
        assert store.healthy is False
        assert store.last_error is not None and CODE[refusal.kind] in store.last_error
        assert ("append", refusal.kind) in errors

        if refusal.kind in WRITE_REFUSALS:
            # The load reads; its refresh is refused, which keeps the store down.
            assert await store.load(key) == [
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
            ]
            assert store.healthy is False
            assert ("refresh", refusal.kind) in errors
            assert await store.load(session_key("t:", "new", None)) == []
            # Redis answers a PING (MISCONF refuses that too, on purpose) ...
            assert await store.ping() is (refusal.kind != "misconf")
            assert store.healthy is False  # ... which does not make writes work
        else:
            with pytest.raises(SessionStoreUnavailable):
                await store.load(key)  # BUSY refuses reads too

        await asyncio.to_thread(refusal.leave)
        assert await store.append(key, [Turn("q2", "a2", "t2")]) == 2
        assert store.healthy is True
        assert [m["content"] for m in await store.load(key)] == ["q1", "a1", "q2", "a2"]
    finally:
        await store.close()


async def test_a_load_refreshes_again_once_writes_work(private_redis: PrivateRedis) -> None:
    """The refresh is best effort, not dropped: with writes back, a load
    refreshes the TTL and last_active, and reports the store up again."""
    refusal = Refusal("readonly", private_redis)
    store = RedisSessionStore.from_url(private_redis.url, ttl_s=1000, timeout_s=2.0)
    key = session_key("t:", "s", None)
    try:
        await store.append(key, [Turn("q", "a")])
        async with raw_client(private_redis) as raw:
            await raw.expire(key, 50)
            await asyncio.to_thread(refusal.enter)
            await store.load(key)
            assert await raw.ttl(key) <= 50 and store.healthy is False
            await asyncio.to_thread(refusal.leave)
            await store.load(key)
            assert await raw.ttl(key) > 900
            assert store.healthy is True
    finally:
        await store.close()


# =========================================================================== through the proxy


@pytest.mark.parametrize("refusal", KINDS, indirect=True)
async def test_a_refusing_redis_is_an_outage_the_turn_waits_and_lands(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    refusal: Refusal,
) -> None:
    prefix = "brownout-refusal:"
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(prefix, refusal.server.url, redis_timeout_s=1.0),
        )
    )
    sid = new_sid()
    key = f"{prefix}session:anon:{sid}"
    assert (await ask(proxy, "before", sid=sid)).status == 200

    # Redis starts refusing between this request's load and its save.
    async def refuses_then_answers(request: web.Request) -> web.StreamResponse:
        await asyncio.to_thread(refusal.enter)
        return web.json_response(completion("kept for later"))

    chat.script.append(refuses_then_answers)
    r = await ask(proxy, "while it refuses", sid=sid, stream=False)
    assert r.status == 200 and r.text == "kept for later" and r.session == "used"
    assert (
        await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "queued"}) == 1
    )
    assert await metric(proxy, "brownout_session_saves_waiting") == 1
    assert await metric(proxy, "brownout_session_store_up") == 0
    errors = {"op": "append", "reason": refusal.kind}
    assert await metric(proxy, "brownout_session_store_errors_total", errors) >= 1
    st = (await get_status(proxy))["sessions"]
    assert st["healthy"] is False and st["saves_waiting"] == 1
    assert CODE[refusal.kind] in st["last_error"]
    assert await metric(proxy, "brownout_session_ops_total", {"result": "rejected"}) == 0

    before = [user("before"), assistant(answer_for("before"))]
    waiting = [user("while it refuses"), assistant("kept for later")]
    r = await ask(proxy, "during", sid=sid)
    assert r.status == 200 and r.text == answer_for("during")
    if refusal.kind in WRITE_REFUSALS:
        # The load works: the history, and the turn that waits, reach the model.
        assert r.session == "used"
        assert chat.messages() == [SYSTEM, *before, *waiting, user("during")]
        assert await metric(proxy, "brownout_session_saves_waiting") == 2  # in order, behind it
        assert await metric(proxy, "brownout_session_store_up") == 0
    else:
        # BUSY refuses reads too: served without history, at once.
        assert r.session == "unavailable"
        assert chat.messages() == [SYSTEM, user("during")]

    await asyncio.to_thread(refusal.leave)
    deadline = time.monotonic() + 10
    while await metric(proxy, "brownout_session_saves_waiting") != 0:
        assert time.monotonic() < deadline, "the waiting turns were never written"
        await asyncio.sleep(0.05)
    assert await metric(proxy, "brownout_session_store_up") == 1
    assert (await get_status(proxy))["sessions"]["healthy"] is True
    expected = [*before, *waiting]
    if refusal.kind in WRITE_REFUSALS:
        expected += [user("during"), assistant(answer_for("during"))]
    async with raw_client(refusal.server) as raw:
        assert await stored(raw, key) == expected  # once each, in order
    assert await metric(proxy, "brownout_session_ops_total", {"result": "rejected"}) == 0
