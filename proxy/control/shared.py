"""Ladder state shared by the sidecar replicas in front of one engine, via Redis.

What is shared, and how:
- a breaker that opens on one replica is opened on the others (written as
  `{prefix}breaker:{backend}` = `{"at": unix time, "by": replica, "reason"}`
  with a TTL of the reset timeout), so one replica's evidence protects all;
  each replica then recovers on its own probes; a per-model breaker (a
  multi-model `openai` backend) the same way, as
  `{prefix}breaker:{backend}:model:{model}`;
- a forced tier (`POST /brownout/tier`) is written to `{prefix}forced` and
  followed by every replica; releasing it deletes the key;
- the gray release's state (id, state, step) is written to `{prefix}rollout`
  at every change on any replica and followed by the others (the last
  change wins): every replica is on the same step, and one replica's
  rollback rolls all of them back.

Replicas poll every `interval_s` (one pipelined round trip), so a change is
seen within that interval — simpler than pub/sub and self-healing after a
Redis restart. When Redis is unreachable every replica keeps serving on its
local state and says so in `/brownout/status` and `brownout_shared_state_up`.
Only the asyncio Redis client is used; nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from proxy.policy import SharedPolicy

log = structlog.get_logger("brownout.shared")

# A breaker: (backend, None), or (backend, model) for a per-model one.
BreakerId = tuple[str, str | None]


class SharedState:
    def __init__(self, policy: SharedPolicy) -> None:
        self.policy = policy
        self.replica = uuid.uuid4().hex[:12]
        self.client: aioredis.Redis = aioredis.from_url(
            policy.redis,
            socket_timeout=policy.timeout_s,
            socket_connect_timeout=policy.timeout_s,
        )
        self.healthy: bool | None = None
        self.last_error: str | None = None
        self._p = policy.key_prefix
        # Remote facts already applied here (so they are applied once).
        self._seen_breakers: dict[str, float] = {}
        self._seen_forced: str | None = None
        self._seen_rollout = 0.0

    async def _run(self, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self.policy.timeout_s * 2):
                result = await coro
        except (RedisError, OSError, TimeoutError) as exc:
            if self.healthy is not False:
                log.warning("shared_state_unavailable", error=f"{type(exc).__name__}: {exc}")
            self.healthy = False
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return None
        if self.healthy is False:
            log.info("shared_state_back")
        self.healthy = True
        self.last_error = None
        return result

    def _breaker_key(self, backend: str, model: str | None) -> str:
        if model is None:
            return f"{self._p}breaker:{backend}"
        return f"{self._p}breaker:{backend}:model:{model}"

    async def publish_breaker_open(
        self, backend: str, reason: str, ttl_s: float, model: str | None = None
    ) -> None:
        now = time.time()
        key = self._breaker_key(backend, model)
        self._seen_breakers[key] = now
        value = json.dumps({"at": now, "by": self.replica, "reason": reason})
        await self._run(self.client.set(key, value, px=max(1, int(ttl_s * 1000))))

    async def publish_forced(self, tier: str | None) -> None:
        self._seen_forced = tier
        key = f"{self._p}forced"
        if tier is None:
            await self._run(self.client.delete(key))
        else:
            await self._run(self.client.set(key, json.dumps({"tier": tier, "by": self.replica})))

    async def read(
        self, breakers: list[BreakerId]
    ) -> tuple[dict[BreakerId, dict[str, Any]], str | None, bool]:
        """(breakers opened elsewhere, forced tier, whether the read worked);
        a breaker is (backend, None) or, per model, (backend, model)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(f"{self._p}forced")
        keys = [self._breaker_key(b, m) for b, m in breakers]
        for key in keys:
            pipe.get(key)
        values = await self._run(pipe.execute())
        if values is None:
            return {}, None, False
        forced_raw, *breaker_raw = values
        forced: str | None = None
        if forced_raw:
            try:
                forced = json.loads(forced_raw)["tier"]
            except (ValueError, KeyError, TypeError):
                forced = None
        opened: dict[BreakerId, dict[str, Any]] = {}
        for b, key, raw in zip(breakers, keys, breaker_raw, strict=True):
            if not raw:
                continue
            try:
                info = json.loads(raw)
                at = float(info.get("at", 0))
            except (ValueError, TypeError, AttributeError):
                continue
            if info.get("by") != self.replica and at > self._seen_breakers.get(key, 0):
                opened[b] = info
                self._seen_breakers[key] = at
        return opened, forced, True

    async def publish_rollout(self, state: dict[str, Any]) -> None:
        now = time.time()
        self._seen_rollout = now
        value = json.dumps({"at": now, "by": self.replica, "rollout": state})
        await self._run(self.client.set(f"{self._p}rollout", value))

    async def read_rollout(self) -> dict[str, Any] | None:
        """Another replica's newer rollout state, once; None when there is none."""
        raw = await self._run(self.client.get(f"{self._p}rollout"))
        if not raw:
            return None
        try:
            info = json.loads(raw)
            at = float(info["at"])
            state = info["rollout"]
        except (ValueError, KeyError, TypeError):
            return None
        if (
            info.get("by") == self.replica
            or at <= self._seen_rollout
            or not isinstance(state, dict)
        ):
            return None
        self._seen_rollout = at
        return state

    def forced_changed(self, forced: str | None) -> bool:
        if forced == self._seen_forced:
            return False
        self._seen_forced = forced
        return True

    async def close(self) -> None:
        await self.client.aclose()

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "replica": self.replica,
            "healthy": self.healthy,
            "last_error": self.last_error,
        }
