"""Chat sessions: the stored history a request is merged with.

Public API::

    session_key(prefix, session_id, api_key) -> str      # raises SessionIdError
    client_key(prefix, identity) -> str                   # whose sessions count together
    make_store(policy, *, clock=time.time, on_error=None) -> SessionStore
    store.load(key, client=None) -> list[dict[str, str]]  # oldest first
    store.append(key, new_turns, max_turns=None, ttl_s=None, client=None) -> int  # turns kept
    store.delete(key); store.ping(); store.close()
    store.healthy / store.last_error                      # for the status page

Exceptions::

    SessionIdError(ValueError)   invalid X-Session-Id (→ 400)
    SessionStoreUnavailable      the store cannot answer (Redis down, slow, or
                                 misbehaving, or refusing writes: OOM, READONLY,
                                 BUSY, MISCONF); raised within `redis_timeout_s`
    SessionLimitReached          a new session of a client that holds
                                 `max_sessions_per_client` live sessions already

History is a flat list of `{"role", "content"}` messages made of whole turns
(a user message followed by the assistant's answer): a turn is appended in
one atomic operation, so the history never holds a question without its
answer, and concurrent appends to one session are all kept, in commit order.

Redis layout: hash `{prefix}session:{scope}:{id}` with fields `history` (JSON
list of the last `max_turns` turns' messages) and `last_active` (unix
seconds); its TTL (`ttl_s`) is refreshed by every append, and by a load when
Redis takes writes (a load never needs one: it works on a read-only replica
or a Redis out of memory). With `max_sessions_per_client`, the sorted set
`{prefix}client:{hash}` maps each session a client created to the time it
expires; a new session past the cap is refused (`SessionLimitReached`).

Text is stored losslessly: a lone surrogate (the JSON escape `\\ud800`, legal
in a request and in model output, not representable in UTF-8) is written as
its WTF-8 bytes (`surrogatepass`; `proxy.sessions.redis_store.encode_json`) and read
back as the same code point, so a turn is stored exactly as the client and
the model produced it. Valid text is plain UTF-8, byte for byte. The Redis
store lives in `proxy.sessions.redis_store`, loaded only when a policy names one.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.policy import SessionsPolicy

__all__ = [
    "MemorySessionStore",
    "SessionIdError",
    "SessionLimitReached",
    "SessionStore",
    "SessionStoreUnavailable",
    "SessionTurnRejected",
    "SessionsPolicy",
    "Turn",
    "client_key",
    "make_store",
    "session_key",
    "store_identity",
]

Clock = Callable[[], float]


# --------------------------------------------------------------------------- errors


class SessionIdError(ValueError):
    """The client's session id is not 1–128 characters of [A-Za-z0-9._:-]."""


class SessionStoreUnavailable(Exception):
    """The session store did not answer in time, failed, or refused the
    write; the request can go on without it. `reason` names why (a metric
    label: timeout, connection, oom, readonly, busy, misconf, script, ...)."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class SessionLimitReached(Exception):
    """A new session for a client that holds `max_sessions_per_client` live
    sessions already; `retry_after_s`: when its oldest one expires."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        super().__init__(f"this client holds {limit} sessions already (the limit)")
        self.limit = limit
        self.retry_after_s = retry_after_s


class SessionTurnRejected(SessionStoreUnavailable):
    """The store answered, but refused these turns (a script error on their
    contents): retrying the same turns cannot succeed, so a queue of waiting
    saves must not wait behind them forever."""


# --------------------------------------------------------------------------- keys

_SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def session_key(prefix: str, session_id: str, api_key: str | None) -> str:
    """The store key of a client's session: `{prefix}session:{scope}:{session_id}`.

    The scope is a hash of the caller's API key (128 bits of sha256), or
    `anon` without one, so a client can only ever reach sessions created with
    its own key. The scope never contains `:`, so scopes cannot be forged with
    an id that contains one.
    """
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise SessionIdError("session id must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    if api_key is None or api_key == "":
        scope = "anon"
    else:
        # The key's bytes as sent: a header with non-UTF-8 bytes arrives with
        # them escaped as lone surrogates (aiohttp's surrogateescape).
        scope = hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"{prefix}session:{scope}:{session_id}"


def client_key(prefix: str, identity: str) -> str:
    """The key under which one client's sessions are counted:
    `{prefix}client:{hash}`. `identity` is what identifies the client (the
    API key when `server.api_keys` is configured, else the peer address —
    never the session id, which the client chooses)."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"{prefix}client:{digest}"


# --------------------------------------------------------------------------- the interface


@dataclass(frozen=True, slots=True)
class Turn:
    """One exchange: the user's message and the assistant's answer, stored together."""

    user: str
    assistant: str
    # Makes a retried save idempotent: a save that timed out may still have
    # landed, and the same turn must not be stored twice. "" = no check.
    id: str = ""

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": self.user},
            {"role": "assistant", "content": self.assistant},
        ]


class SessionStore(Protocol):
    """Where session histories live; every failure is SessionStoreUnavailable."""

    @property
    def healthy(self) -> bool:
        """False after a failed operation, until one succeeds (cheap: no I/O)."""
        ...

    @property
    def last_error(self) -> str | None:
        """The last failure, for the status page; None when none happened yet."""
        ...

    async def load(self, key: str, client: str | None = None) -> list[dict[str, str]]:
        """The session's messages, oldest first ([] for unknown or expired
        sessions). Never needs a write. With `client` (a `client_key`) and a
        cap, an unknown session of a client at the cap raises SessionLimitReached."""
        ...

    async def append(
        self,
        key: str,
        new_turns: Sequence[Turn],
        max_turns: int | None = None,
        ttl_s: int | None = None,
        client: str | None = None,
    ) -> int:
        """Add turns atomically, keep the last `max_turns`; return the turns
        stored. Creating a session past `client`'s cap raises SessionLimitReached."""
        ...

    async def delete(self, key: str) -> None: ...

    async def ping(self) -> bool:
        """A round trip to the store; updates `healthy`; never raises."""
        ...

    async def close(self) -> None: ...

    def retune(self, policy: SessionsPolicy) -> None:
        """Apply the knobs that need no new connection (ttl_s, max_turns,
        max_sessions, max_sessions_per_client) in place: a reload keeps the
        store and its sessions."""
        ...


def store_identity(policy: SessionsPolicy) -> tuple[Any, ...]:
    """What a store object is built from; a reload that changes any other
    `sessions.*` knob keeps the running store (and, for memory://, its sessions)."""
    if policy.store == "memory://":
        return (policy.store,)
    return (policy.store, policy.redis_timeout_s, policy.redis_max_connections)


OnError = Callable[[str, str], None]  # (op, reason): counted by the caller


def make_store(
    policy: SessionsPolicy, *, clock: Clock = time.time, on_error: OnError | None = None
) -> SessionStore:
    """The store the policy names (no I/O: Redis connects on first use).
    `on_error(op, reason)` is told of every failed or refused operation."""
    if policy.store == "memory://":
        return MemorySessionStore(
            max_sessions=policy.max_sessions,
            ttl_s=policy.ttl_s,
            max_turns=policy.max_turns,
            max_per_client=policy.max_sessions_per_client,
            clock=clock,
        )
    from proxy.sessions.redis_store import RedisSessionStore  # redis is loaded only when used

    return RedisSessionStore.from_url(
        policy.store,
        ttl_s=policy.ttl_s,
        max_turns=policy.max_turns,
        timeout_s=policy.redis_timeout_s,
        max_connections=policy.redis_max_connections,
        max_per_client=policy.max_sessions_per_client,
        clock=clock,
        on_error=on_error,
    )


def append_limits(
    max_turns: int | None, ttl_s: int | None, default_turns: int, default_ttl: int
) -> tuple[int, int]:
    """(messages kept, ttl) of one `append` call, its overrides or the
    store's defaults; both stores refuse the same out-of-range values."""
    keep = 2 * (default_turns if max_turns is None else max_turns)
    ttl = default_ttl if ttl_s is None else ttl_s
    if keep < 2 or ttl < 1:
        raise ValueError("max_turns and ttl_s must be >= 1")
    return keep, ttl


def _turn_messages(turns: Sequence[Turn]) -> list[dict[str, str]]:
    return [m for t in turns for m in t.messages()]


# --------------------------------------------------------------------------- memory://


@dataclass(slots=True)
class _Entry:
    history: list[dict[str, str]]
    last_active: float
    expires_at: float
    client: str | None = None


@dataclass(slots=True)
class MemorySessionStore:
    """In-process store: bounded LRU with TTL. For one replica and tests.

    Operations never await, so each one is atomic on the event loop. With
    `max_per_client`, a client (`client_key`) holds at most that many live
    sessions; a new one past it raises SessionLimitReached.
    """

    max_sessions: int = 10000
    ttl_s: int = 86400
    max_turns: int = 20
    max_per_client: int = 0
    clock: Clock = time.time
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict, repr=False)
    _per_client: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def healthy(self) -> bool:
        return True

    @property
    def last_error(self) -> str | None:
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None or entry.client is None:
            return
        left = self._per_client.get(entry.client, 0) - 1
        if left > 0:
            self._per_client[entry.client] = left
        else:
            self._per_client.pop(entry.client, None)

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            self._drop(key)
            return None
        return entry

    def _check_cap(self, client: str | None, now: float) -> None:
        """Raises SessionLimitReached when `client` may not create a session."""
        cap = self.max_per_client
        if client is None or cap <= 0 or self._per_client.get(client, 0) < cap:
            return
        # At the cap by the count: its expired sessions do not count (a scan,
        # only for a client at its cap).
        expiries = [
            e.expires_at
            for e in self._entries.values()
            if e.client == client and e.expires_at > now
        ]
        if len(expiries) < cap:
            return
        raise SessionLimitReached(cap, max(1, math.ceil(min(expiries) - now)))

    async def load(self, key: str, client: str | None = None) -> list[dict[str, str]]:
        now = self.clock()
        entry = self._live(key, now)
        if entry is None:
            self._check_cap(client, now)
            return []
        entry.last_active = now
        entry.expires_at = now + self.ttl_s
        self._entries.move_to_end(key)
        return [dict(m) for m in entry.history]  # callers must not edit the stored copy

    async def append(
        self,
        key: str,
        new_turns: Sequence[Turn],
        max_turns: int | None = None,
        ttl_s: int | None = None,
        client: str | None = None,
    ) -> int:
        keep, ttl = append_limits(max_turns, ttl_s, self.max_turns, self.ttl_s)
        if not new_turns:
            return len(await self.load(key)) // 2
        now = self.clock()
        entry = self._live(key, now)
        if entry is None:
            self._check_cap(client, now)
            entry = _Entry([], now, now, client)
            self._entries[key] = entry
            if client is not None:
                self._per_client[client] = self._per_client.get(client, 0) + 1
        entry.history = (entry.history + _turn_messages(new_turns))[-keep:]
        entry.last_active = now
        entry.expires_at = now + ttl
        self._entries.move_to_end(key)
        self._evict(now)
        return len(entry.history) // 2

    def _evict(self, now: float) -> None:
        # Expired sessions gather at the LRU end; drop those, then enforce the bound.
        while self._entries:
            oldest_key, oldest = next(iter(self._entries.items()))
            if oldest.expires_at > now and len(self._entries) <= self.max_sessions:
                break
            self._drop(oldest_key)

    async def delete(self, key: str) -> None:
        self._drop(key)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._entries.clear()
        self._per_client.clear()

    def retune(self, policy: SessionsPolicy) -> None:
        # Lifetimes already granted stay; the new ttl applies from the next use.
        self.ttl_s, self.max_turns, self.max_sessions, self.max_per_client = (
            policy.ttl_s,
            policy.max_turns,
            policy.max_sessions,
            policy.max_sessions_per_client,
        )
        self._evict(self.clock())
