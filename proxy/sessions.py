"""Chat sessions: memory and Redis stores (work in progress)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.knobs import knob


@dataclass(frozen=True, slots=True)
class SessionsPolicy:
    store: str = knob("memory://", "`memory://` or `redis://host:port/db`.")
    ttl_s: int = knob(86400, "Session lifetime, refreshed on use.")
    max_turns: int = knob(20, "Turns kept per session.")
    key_prefix: str = knob("brownout:", "Prefix of every Redis key.")
