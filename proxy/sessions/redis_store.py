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
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from proxy.policy import SessionsPolicy
from proxy.sessions.redis_scripts import APPEND_LUA, LOAD_LUA
from proxy.sessions.redisbatch import ScriptBatcher
from proxy.sessions.refusals import WRITE_REFUSALS, is_script_error, refusal_reason
from proxy.sessions.store import (
    SessionLimitReached,
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


def _error_text(exc: BaseException) -> str:
    """An error reply's text with its code first (redis-py may strip it)."""
    text = str(exc)
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code and not text.startswith(code):
        text = f"{code} {text}"
    return text


def _failure_reason(exc: BaseException) -> str:
    """The metric label of a failed operation (a decision on the error's kind)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    reason = refusal_reason(_error_text(exc))
    if reason is not None:
        return reason
    if isinstance(exc, (ConnectionError, RedisConnectionError, OSError)):
        return "connection"
    return "error"


class RedisSessionStore:
    """Sessions in Redis through one pooled asyncio client.

    Every operation runs under one deadline (`timeout_s`, connect and pool
    wait included) and fails with SessionStoreUnavailable past it. There are no
    client-side retries: a retried append could store a turn twice, and the
    pool replaces dead connections when they are checked out, so operations
    work again as soon as Redis is back.

    `healthy` is False while Redis does not answer, and also while it answers
    but refuses writes (`proxy.sessions.refusals`: OOM, READONLY, MISCONF,
    ...): reads that still work (a load, a ping) do not make the store up
    again; only a write that lands does (an append, or a load's refresh).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: int = 86400,
        max_turns: int = 20,
        timeout_s: float = 0.25,
        max_per_client: int = 0,
        clock: Clock = time.time,
        on_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._max_turns = max_turns
        self._timeout_s = timeout_s
        self._max_per_client = max_per_client
        self._clock = clock
        self._on_error = on_error
        self._scripts = ScriptBatcher(client, {"load": LOAD_LUA, "append": APPEND_LUA}, timeout_s)
        self._reachable = True
        self._refusing: str | None = None  # why Redis refuses writes, while it does
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
        max_per_client: int = 0,
        clock: Clock = time.time,
        on_error: Callable[[str, str], None] | None = None,
    ) -> RedisSessionStore:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # wait for a free connection
            # No socket_timeout: every call is bounded by `_call` or the
            # batch's watchdog (`proxy.sessions.redisbatch`); a timeout scope
            # around each reply read and a wait_for task around each write
            # would cost more than the command. Explicitly None: redis-py 8
            # defaults it to 5 s. The connect timeout stays: a handshake may
            # absorb a cancellation.
            socket_timeout=None,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
            # Reads back the WTF-8 that `encode_json` writes for lone surrogates.
            encoding_errors=DECODE_ERRORS,
        )
        client = aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
        return cls(
            client,
            ttl_s=ttl_s,
            max_turns=max_turns,
            timeout_s=timeout_s,
            max_per_client=max_per_client,
            clock=clock,
            on_error=on_error,
        )

    @property
    def healthy(self) -> bool:
        return self._reachable and self._refusing is None

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def refusing(self) -> str | None:
        """Why Redis refuses writes (oom, readonly, misconf, noreplicas), while it does."""
        return self._refusing

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
            raise self._failed(op, f"timed out after {self._timeout_s}s", "timeout")
        try:
            result = task.result()
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(op, f"{type(exc).__name__}: {exc}", _failure_reason(exc)) from exc
        self._answered(wrote=op == "delete")
        return result

    async def _script(self, op: str, keys: list[str], args: list[Any]) -> Any:
        """A script call, batched with concurrent ones (`proxy.sessions.redisbatch`).
        Abandoning the plain future at the deadline is immediate."""
        try:
            result = await self._scripts.call(op, keys, args)  # fails at the deadline
        except TimeoutError:
            raise self._failed(op, f"timed out after {self._timeout_s}s", "timeout") from None
        except ResponseError as exc:
            text = _error_text(exc)
            if not is_script_error(text):
                why = f"{type(exc).__name__}: {text}"
                raise self._failed(op, why, _failure_reason(exc)) from exc
            # The store works; these arguments do not (e.g. text the script
            # cannot decode). Not an outage: `healthy` stays as it is.
            log.warning("session store refused %s: %s", op, text)
            self._count(op, "script")
            raise SessionTurnRejected(f"session store refused {op}: {text}", "script") from exc
        except (RedisError, OSError, UnicodeDecodeError) as exc:
            raise self._failed(op, f"{type(exc).__name__}: {exc}", _failure_reason(exc)) from exc
        return result

    def _answered(self, *, wrote: bool) -> None:
        """Redis answered; `wrote`: and took a write, so it no longer refuses them."""
        if wrote:
            self._refusing = None
        was_up = self.healthy
        self._reachable = True
        if self.healthy and not was_up:
            log.warning("session store available again")

    def _count(self, op: str, reason: str) -> None:
        if self._on_error is not None:
            self._on_error(op, reason)

    def _reap(self, task: asyncio.Future[Any]) -> None:
        self._stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller already got SessionStoreUnavailable

    def _failed(self, op: str, why: str, reason: str) -> SessionStoreUnavailable:
        if self.healthy:
            log.warning("session store unavailable: %s %s", op, why)
        if reason in WRITE_REFUSALS:
            # Redis is up but refuses writes: an outage of the store all the same.
            self._refusing = reason
            self._reachable = True
        else:
            self._reachable = False
        self._last_error = f"{op}: {why}"
        self._count(op, reason)
        return SessionStoreUnavailable(f"session store {op} failed: {why}", reason)

    def _cap_args(self, client: str | None, key: str) -> tuple[str, int]:
        """(KEYS[2], cap) of a script call: no cap without a client."""
        if client is None or self._max_per_client <= 0:
            return key, 0
        return client, self._max_per_client

    async def load(self, key: str, client: str | None = None) -> list[dict[str, str]]:
        now = int(self._clock())
        ckey, cap = self._cap_args(client, key)
        reply = await self._script("load", [key, ckey], [self._ttl_s, now, cap])
        raw, refresh_error = reply[0], reply[1]
        if raw is None:
            self._answered(wrote=False)
            if cap and len(reply) >= 4 and int(reply[2]) >= cap:
                first = float(reply[3]) if reply[3] is not None else now + self._ttl_s
                raise SessionLimitReached(cap, max(1, math.ceil(first - now)))
            return []
        if refresh_error:
            # The history is read; only its refresh was refused: the load
            # works, the store is reported down until a write lands.
            reason = refusal_reason(refresh_error) or "error"
            self._failed("refresh", refresh_error, reason)
        else:
            self._answered(wrote=True)
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
        client: str | None = None,
    ) -> int:
        keep, ttl = append_limits(max_turns, ttl_s, self._max_turns, self._ttl_s)
        if not new_turns:  # nothing to store; an empty append must not create a session
            return len(await self.load(key)) // 2
        payload = encode_json([m for t in new_turns for m in t.messages()])
        ids = encode_json([t.id for t in new_turns])
        now = int(self._clock())
        ckey, cap = self._cap_args(client, key)
        n = int(await self._script("append", [key, ckey], [payload, keep, ttl, now, ids, cap]))
        self._answered(wrote=True)
        if n < 0:
            self._count("append", "limit")
            raise SessionLimitReached(cap, ttl)
        return n // 2

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda: self._client.delete(key))

    async def ping(self) -> bool:
        try:
            await self._call("ping", self._client.ping)
        except SessionStoreUnavailable:
            return False
        return True

    def retune(self, policy: SessionsPolicy) -> None:
        self._ttl_s, self._max_turns, self._max_per_client = (
            policy.ttl_s,
            policy.max_turns,
            policy.max_sessions_per_client,
        )

    async def close(self) -> None:
        await self._scripts.close()
        for task in list(self._stragglers):
            task.cancel()
        await asyncio.gather(*self._stragglers, return_exceptions=True)
        await self._client.aclose()
