"""Sessions in Redis (`sessions.store: redis://...`): see `proxy.sessions.store`
for the interface and the key layout.

Text is stored losslessly: a lone surrogate is written as its WTF-8 bytes
(`encode_json`) and decoded back with `surrogatepass`.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from proxy.policy import SessionsPolicy
from proxy.sessions.redisbatch import ScriptBatcher
from proxy.sessions.store import (
    SessionStoreUnavailable,
    SessionTurnRejected,
    Turn,
    append_limits,
)

__all__ = ["RedisSessionStore", "encode_json"]

log = logging.getLogger("proxy.sessions.store")

Clock = Callable[[], float]


def _wtf8_or_replace(exc: UnicodeError) -> tuple[str | bytes, int]:
    """Decoding error handler for what Redis holds: a WTF-8 surrogate (what
    `encode_json` writes) is read back as that code point, like
    `surrogatepass`; any other invalid byte (written by something else)
    becomes U+FFFD. Without the fallback one such byte failed the reply of
    every script batched with it, and marked the store down."""
    if isinstance(exc, UnicodeEncodeError):  # redis-py encodes str arguments with it too
        return exc.object[exc.start : exc.end].encode("utf-8", "surrogatepass"), exc.end
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    b, i = exc.object, exc.start
    if i + 2 < len(b) and b[i] == 0xED and 0xA0 <= b[i + 1] <= 0xBF and 0x80 <= b[i + 2] <= 0xBF:
        return chr(0xD000 | ((b[i + 1] & 0x3F) << 6) | (b[i + 2] & 0x3F)), i + 3
    return "\ufffd", i + 1


# A codec error handler is looked up by name; registering the same function
# again is harmless.
DECODE_ERRORS = "brownout.wtf8"
codecs.register_error(DECODE_ERRORS, _wtf8_or_replace)


def encode_json(obj: Any) -> bytes:
    """JSON bytes of any decoded JSON value: orjson's (fast, strict UTF-8),
    or WTF-8 when the text holds a lone surrogate (orjson refuses it, and
    Redis' cjson refuses its `\\udXXX` escape; raw bytes it keeps as they are)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------- redis://

# KEYS[1] session hash; ARGV: ttl_s, now. Refreshes the TTL only of an existing
# session (a load must not create one).
_LOAD_LUA = """
local raw = redis.call('HGET', KEYS[1], 'history')
if raw then
  redis.call('HSET', KEYS[1], 'last_active', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return raw
"""

# KEYS[1] session hash; ARGV: JSON list of new messages, messages to keep
# (2 × max_turns), ttl_s, now. One atomic round trip: concurrent appends all
# land, in commit order. Unreadable stored history is replaced, not fatal.
_APPEND_LUA = """
local history = {}
local raw = redis.call('HGET', KEYS[1], 'history')
if raw then
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' then history = decoded end
end
-- Ids of the last turns stored: a turn whose save is retried lands once.
local ids = {}
local rawids = redis.call('HGET', KEYS[1], 'turn_ids')
if rawids then
  local ok, decoded = pcall(cjson.decode, rawids)
  if ok and type(decoded) == 'table' then ids = decoded end
end
local seen = {}
for _, v in ipairs(ids) do seen[v] = true end
local msgs = cjson.decode(ARGV[1])
for i, tid in ipairs(cjson.decode(ARGV[5])) do
  if tid == '' or not seen[tid] then
    history[#history + 1] = msgs[2 * i - 1]
    history[#history + 1] = msgs[2 * i]
    if tid ~= '' then ids[#ids + 1] = tid; seen[tid] = true end
  end
end
local keep = tonumber(ARGV[2])
local n = #history
if n > keep then
  local kept = {}
  for i = n - keep + 1, n do kept[#kept + 1] = history[i] end
  history = kept
end
if #ids > 64 then
  local recent = {}
  for i = #ids - 63, #ids do recent[#recent + 1] = ids[i] end
  ids = recent
end
local fields = {'history', cjson.encode(history), 'last_active', ARGV[4]}
if #ids > 0 then
  fields[#fields + 1] = 'turn_ids'
  fields[#fields + 1] = cjson.encode(ids)
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return #history
"""


def _is_script_error(exc: ResponseError) -> bool:
    """A Lua runtime error (bad arguments), as opposed to the server refusing
    work (OOM, READONLY, BUSY, ...), which is an outage like any other."""
    text = str(exc)
    return "user_script" in text or "Error running script" in text


class RedisSessionStore:
    """Sessions in Redis through one pooled asyncio client.

    Every operation runs under one deadline (`timeout_s`, connect and pool
    wait included) and fails with SessionStoreUnavailable past it. There are no
    client-side retries: a retried append could store a turn twice, and the
    pool replaces dead connections when they are checked out, so operations
    work again as soon as Redis is back.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: int = 86400,
        max_turns: int = 20,
        timeout_s: float = 0.25,
        clock: Clock = time.time,
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._max_turns = max_turns
        self._timeout_s = timeout_s
        self._clock = clock
        self._scripts = ScriptBatcher(client, {"load": _LOAD_LUA, "append": _APPEND_LUA}, timeout_s)
        self._healthy = True
        self._last_error: str | None = None
        self._stragglers: set[asyncio.Future[Any]] = set()  # timed-out operations

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl_s: int = 86400,
        max_turns: int = 20,
        timeout_s: float = 0.25,
        max_connections: int = 32,
        clock: Clock = time.time,
    ) -> RedisSessionStore:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # wait for a free connection
            # No socket_timeout: every call is bounded by `_call` (a wait_for
            # around each socket read would cost more than the command). The
            # connect timeout stays: a handshake may absorb a cancellation.
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
            # Reads back the WTF-8 that `encode_json` writes for lone surrogates.
            encoding_errors=DECODE_ERRORS,
        )
        client = aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
        return cls(client, ttl_s=ttl_s, max_turns=max_turns, timeout_s=timeout_s, clock=clock)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def last_error(self) -> str | None:
        return self._last_error

    async def _call(self, op: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        # The operation runs as its own task and the caller waits at most
        # timeout_s for it. A plain asyncio.timeout() is not enough: redis-py's
        # connect handshake can absorb the cancellation (seen on Python 3.11
        # with a hung server: 2 × timeout_s). A late task is cancelled and
        # finishes in the background, bounded by the socket timeouts.
        task = asyncio.ensure_future(fn())
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            self._stragglers.add(task)
            task.add_done_callback(self._reap)
            raise self._failed(op, f"timed out after {self._timeout_s}s")
        try:
            result = task.result()
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(op, f"{type(exc).__name__}: {exc}") from exc
        if not self._healthy:
            log.warning("session store available again")
            self._healthy = True
        return result

    async def _script(self, op: str, keys: list[str], args: list[Any]) -> Any:
        """A script call, batched with concurrent ones (`proxy.sessions.redisbatch`).
        Abandoning the plain future at the deadline is immediate."""
        try:
            result = await self._scripts.call(op, keys, args)  # fails at the deadline
        except TimeoutError:
            raise self._failed(op, f"timed out after {self._timeout_s}s") from None
        except ResponseError as exc:
            if not _is_script_error(exc):
                raise self._failed(op, f"{type(exc).__name__}: {exc}") from exc
            # The store works; these arguments do not (e.g. text the script
            # cannot decode). Not an outage: `healthy` stays as it is.
            log.warning("session store refused %s: %s", op, exc)
            raise SessionTurnRejected(f"session store refused {op}: {exc}") from exc
        except (RedisError, OSError, UnicodeDecodeError) as exc:
            raise self._failed(op, f"{type(exc).__name__}: {exc}") from exc
        if not self._healthy:
            log.warning("session store available again")
            self._healthy = True
        return result

    def _reap(self, task: asyncio.Future[Any]) -> None:
        self._stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller already got SessionStoreUnavailable

    def _failed(self, op: str, why: str) -> SessionStoreUnavailable:
        if self._healthy:
            log.warning("session store unavailable: %s %s", op, why)
        self._healthy = False
        self._last_error = f"{op}: {why}"
        return SessionStoreUnavailable(f"session store {op} failed: {why}")

    async def load(self, key: str) -> list[dict[str, str]]:
        now = int(self._clock())
        raw = await self._script("load", [key], [self._ttl_s, now])
        if raw is None:
            return []
        try:
            history = json.loads(raw)
        except ValueError:
            log.warning("session history is not JSON; ignoring it")
            return []
        if not isinstance(history, list):  # cjson writes an empty list as {}
            return []
        return [
            {"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
            for m in history
            if isinstance(m, dict)
        ]

    async def append(
        self,
        key: str,
        new_turns: Sequence[Turn],
        max_turns: int | None = None,
        ttl_s: int | None = None,
    ) -> int:
        keep, ttl = append_limits(max_turns, ttl_s, self._max_turns, self._ttl_s)
        if not new_turns:  # nothing to store; an empty append must not create a session
            return len(await self.load(key)) // 2
        payload = encode_json([m for t in new_turns for m in t.messages()])
        ids = encode_json([t.id for t in new_turns])
        now = int(self._clock())
        n = await self._script("append", [key], [payload, keep, ttl, now, ids])
        return int(n) // 2

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda: self._client.delete(key))

    async def ping(self) -> bool:
        try:
            await self._call("ping", self._client.ping)
        except SessionStoreUnavailable:
            return False
        return True

    def retune(self, policy: SessionsPolicy) -> None:
        self._ttl_s, self._max_turns = policy.ttl_s, policy.max_turns

    async def close(self) -> None:
        await self._scripts.close()
        for task in list(self._stragglers):
            task.cancel()
        await asyncio.gather(*self._stragglers, return_exceptions=True)
        await self._client.aclose()
