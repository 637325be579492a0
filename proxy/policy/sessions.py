"""`sessions:` — the chat history store and how history is trimmed."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.knobs import knob


@dataclass(frozen=True, slots=True)
class TrimPolicy:
    margin_tokens: int = knob(
        64,
        "Tokens kept free besides the answer's max_tokens, for differences between our "
        "count and the backend's (budget = max_model_len - max_tokens - margin).",
        ge=0,
        unit="tokens",
    )
    default_max_tokens: int = knob(
        512,
        "Answer tokens reserved when a request sets no max_tokens.",
        ge=1,
        unit="tokens",
    )
    high_water: float = knob(
        0.9,
        "Nothing is dropped while the prompt fits in high_water × budget; above it, the "
        "oldest turns go in one block (keeps vLLM's prefix cache warm between requests).",
        gt=0,
        le=1,
        unit="ratio",
    )
    low_water: float = knob(
        0.7,
        "A block drop removes the oldest turns until the prompt fits in low_water × budget "
        "(< high_water).",
        gt=0,
        lt=1,
        unit="ratio",
    )
    trim_stateless: bool = knob(
        True,
        "Also trim requests without a session (the client sent its whole conversation); "
        "false = only session-merged prompts are trimmed, longer ones fail at the backend.",
    )


@dataclass(frozen=True, slots=True)
class SessionsPolicy:
    store: str = knob("memory://", "`memory://` or `redis://host:port/db`.", secret="userinfo")
    ttl_s: int = knob(
        86400,
        "Session lifetime, refreshed on use (at most 10 years: Redis refuses larger expiries).",
        ge=1,
        le=10 * 365 * 86400,
    )
    max_turns: int = knob(20, "Turns kept per session.", ge=1)
    key_prefix: str = knob("brownout:", "Prefix of every Redis key.")
    redis_timeout_s: float = knob(
        0.25,
        "Deadline of one Redis operation (connect included); past it the request goes "
        "on without history instead of waiting.",
        gt=0,
        le=60,
    )
    redis_max_connections: int = knob(
        32,
        "Redis connection pool size; a request waits at most redis_timeout_s for one.",
        ge=1,
    )
    max_sessions: int = knob(
        10000, "memory:// only: sessions kept; the least recently used are evicted.", ge=1
    )
    max_sessions_per_client: int = knob(
        10000,
        "Live sessions one client may hold (its API key when server.api_keys is set, else "
        "its peer address; 0 = no cap). A new session past it is refused with 429 "
        "`session_limit` and Retry-After; its existing sessions go on working.",
        ge=0,
        le=10_000_000,
    )
    pending_saves: int = knob(
        10000,
        "Finished turns kept in memory while the store is down, saved in order when it "
        "returns (past this, the oldest is dropped and counted).",
        ge=0,
    )
    trimming: TrimPolicy = knob(TrimPolicy, "Fitting history into the context window.")
