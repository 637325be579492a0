"""What a Redis error means for the session store: an outage, or a bad turn.

Redis answers some commands with an error while it is up: it refuses writes
when it is out of memory under `noeviction` (`OOM`), when it is a read-only
replica (`READONLY`), while a script runs past `busy-reply-threshold`
(`BUSY`, reads too), when it cannot persist to disk with
`stop-writes-on-bgsave-error` (`MISCONF`), while it loads its data set
(`LOADING`), or when it lacks replicas / its master (`NOREPLICAS`,
`MASTERDOWN`). Each is an outage of the store: the turn waits, the store is
reported down. A write refused inside a script carries the same code,
followed by `script: <sha>, on @user_script:<line>.`; only an error of the
script itself (bad arguments, a Lua runtime error) is the turn's fault.

Decisions only: no I/O.
"""

from __future__ import annotations

__all__ = ["REFUSALS", "WRITE_REFUSALS", "is_script_error", "refusal_reason"]

# Error code (the reply's first word) -> reason label (metrics, status).
REFUSALS: dict[str, str] = {
    "OOM": "oom",
    "READONLY": "readonly",
    "BUSY": "busy",
    "MISCONF": "misconf",
    "LOADING": "loading",
    "NOREPLICAS": "noreplicas",
    "MASTERDOWN": "masterdown",
}

# Refusals of writes only: reads still work, so only a write that lands shows
# they are over. (BUSY, LOADING and MASTERDOWN refuse reads too: any answer
# ends them.)
WRITE_REFUSALS = frozenset({"oom", "readonly", "misconf", "noreplicas"})


def refusal_reason(text: str) -> str | None:
    """The reason Redis refused work, from an error reply's text (with its
    code first, as Redis sends it and redis-py keeps it in `str(exc)`), or
    None when the error is not a refusal of the server."""
    code = text.lstrip().split(" ", 1)[0].upper()
    return REFUSALS.get(code)


def is_script_error(text: str) -> bool:
    """A Lua runtime error of our own scripts (the turn's arguments), as
    opposed to the server refusing work, which is an outage like any other."""
    if refusal_reason(text) is not None:
        return False
    return "user_script" in text or "Error running script" in text
