"""Request priorities: the ranks (defined once), `key_priorities` entries, the header rule.

A request's priority decides its place in the admission queue, which waiter
is evicted for it and whether the throttle tier sheds it. Nothing the client
says may raise it: `X-Priority` can only lower the priority its API key has
(`default_priority` for a client without an entry), unless the key's entry
names a ceiling the header may reach:

    ladder.throttle.key_priorities:
      - "sk-batch=sheddable"          # always sheddable; the header cannot raise it
      - "sk-app=normal"               # normal; may ask for sheddable
      - "sk-gateway=normal..critical" # normal; the header may ask for up to critical

Standard library only (part of the policy leaf): the checks and the runtime
share the parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

Priority = Literal["critical", "normal", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "normal", "sheddable")
# 0 is served first; a larger rank is less important.
RANK: dict[str, int] = {p: i for i, p in enumerate(PRIORITIES)}
ENTRY_FORMAT = "KEY=PRIORITY or KEY=PRIORITY..MAX (critical, normal, sheddable)"


@dataclass(frozen=True, slots=True)
class Grant:
    """What one client gets: its priority, and the highest the header may ask for."""

    base: Priority
    ceiling: Priority

    def for_header(self, header: str | None) -> Priority:
        """The priority of a request carrying `X-Priority: header`."""
        if header is None or header not in RANK:
            return self.base
        if RANK[header] < RANK[self.ceiling]:
            return self.ceiling
        return cast(Priority, header)


def _priority(word: str) -> Priority:
    if word not in RANK:
        raise ValueError(word)
    return cast(Priority, word)


def parse_key_priority(entry: str) -> tuple[str, Grant]:
    """`KEY=PRIORITY` or `KEY=PRIORITY..MAX` → (key, grant); ValueError otherwise.
    Messages never quote the key (it is a secret)."""
    key, sep, value = entry.rpartition("=")
    base_word, dots, max_word = value.partition("..")
    try:
        if not sep or not key:
            raise ValueError(entry)
        base = _priority(base_word)
        ceiling = _priority(max_word) if dots else base
    except ValueError:
        raise ValueError(f"is not {ENTRY_FORMAT}") from None
    if RANK[ceiling] > RANK[base]:
        raise ValueError(f"has a ceiling ({ceiling}) below its priority ({base})")
    return key, Grant(base, ceiling)


def parse_key_priorities(entries: tuple[str, ...]) -> dict[str, Grant]:
    return dict(parse_key_priority(e) for e in entries)
