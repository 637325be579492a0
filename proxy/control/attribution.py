"""Who a failed attempt is charged to: the backend, the request, or load.

A resilience proxy must not let one client decide that a backend is broken.
Every failed attempt gets an attribution, decided here from plain values (no
I/O); only `backend` failures feed breakers and the ladder:

- `load` — the backend is working and busy: a 429, a 503 that says when to
  come back (`Retry-After`), vLLM's "Request queue full". Fails over, never
  opens a breaker.
- `request` — this request's own problem: a 4xx, a non-streaming answer that
  outlived `timeouts.total_s` (a long generation), and every *suspect*
  failure that the backend's own recovery probe does not reproduce.
- `backend` — the engine is broken. *Definitive* without a second opinion: a
  refused connection, vLLM's engine-death error, an out-of-memory error.
  *Suspect* until corroborated: 5xx answers, first-byte/connect/idle
  timeouts, resets, cut streams, in-band errors, invalid output — a client can
  shape every one of these (a poison parameter, a hostile schema, a prompt
  that makes the model emit control characters).

Corroboration (`Ledger.decide`): when a suspect failure would open a closed
breaker, or is the trial of a half-open one (its failure would reopen it: a
client whose poison request is the trial would keep a recovered backend
out), the failure is held and the backend's recovery probe (the 1-token
chat) goes out at once. A probe that fails opens the breaker; one that
succeeds charges the held failures to their requests and the breaker stays
closed. At most one corroboration per breaker per `reset_timeout_s`; inside
that window a suspect failure may open the breaker only when the failures of
the streak come from at least `breaker.min_clients` different client
identities (the API key when `server.api_keys` is set, else the peer
address; session ids are chosen by clients and are not identities). So no
sequence of requests from one client opens the breaker of a backend whose
probe succeeds, and a really broken backend still opens as soon as its
streak reaches `fail_max` (the probe fails too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Attribution = Literal["backend", "request", "load"]
ATTRIBUTIONS: tuple[Attribution, ...] = ("backend", "request", "load")
Decision = Literal["record", "probe", "hold", "absolve"]

# Backend faults that need no second opinion.
DEFINITIVE = frozenset({"connect", "engine_dead", "oom"})
# The request's own: never a backend fault, whatever the probe says.
REQUEST_FAULTS = frozenset({"total_timeout"})

# vLLM's engine death ("EngineCore encountered an issue", EngineDeadError,
# "engine loop is not running"), and out-of-memory errors of vLLM, torch and
# Transformers ("CUDA out of memory", OutOfMemoryError, "CUDA error: out of memory").
_ENGINE_DEAD = re.compile(
    rb"EngineCore encountered an issue|EngineDeadError|engine (?:loop )?is (?:dead|not running)"
    rb"|engine died",
    re.IGNORECASE,
)
_OOM = re.compile(rb"out of memory|OutOfMemoryError|\bOOM\b", re.IGNORECASE)
_QUEUE_FULL = re.compile(rb"queue (?:is )?full", re.IGNORECASE)
# How much of an error body is looked at (error objects are short).
_SCAN = 4096


def definitive(text: bytes) -> bool:
    """An error body that says the engine died or ran out of memory (no
    point in trying the same backend again)."""
    head = text[:_SCAN]
    return bool(head) and (_ENGINE_DEAD.search(head) is not None or _OOM.search(head) is not None)


@dataclass(frozen=True, slots=True)
class Verdict:
    attribution: Attribution
    fault: str  # the fault, refined from the body (engine_dead, oom, queue_full)
    suspect: bool = False  # backend, until a probe corroborates it


def classify(fault: str, status: int, text: bytes = b"", retry_after: bool = False) -> Verdict:
    """The attribution of one failed attempt.

    `fault` is the attempt's breaker fault ("" for load and 4xx answers),
    `status` the HTTP status it had (or would have had), `text` the
    backend's error body or in-band error event, `retry_after` whether the
    backend said when to come back."""
    head = text[:_SCAN]
    if head and _ENGINE_DEAD.search(head):
        return Verdict("backend", "engine_dead")
    if head and _OOM.search(head):
        return Verdict("backend", "oom")
    if not fault:
        if status == 429 or (status == 503 and retry_after):
            return Verdict("load", f"http_{status}")
        return Verdict("request", f"http_{status}")
    if head and _QUEUE_FULL.search(head):
        return Verdict("load", "queue_full")
    if fault in DEFINITIVE:
        return Verdict("backend", fault)
    if fault in REQUEST_FAULTS:
        return Verdict("request", fault)
    return Verdict("backend", fault, suspect=True)


@dataclass(slots=True)
class Held:
    """A suspect failure waiting for the probe's verdict."""

    fault: str
    detail: str
    client: str
    rid: str


@dataclass(slots=True)
class Ledger:
    """One breaker's corroboration state (decisions only; the runtime runs
    the probe, reports back and counts what each call hands it).

    The suspect failures of the breaker's current streak are kept until the
    streak is judged, so that they are counted once, under the attribution
    the judgement gives them: a success ends the streak (they were the
    backend's, transient), a probe that passes makes them the requests', one
    that fails the backend's."""

    window_s: float  # at most one corroboration per window (reset_timeout_s)
    min_clients: int = 2
    probing: bool = False
    last_probe_at: float | None = None
    last_probe_ok: bool | None = None
    held: list[Held] = field(default_factory=list)  # waiting for the probe out now
    # How many of `held` were there when the probe out now started: a failure
    # held after that is not judged by a probe that failed before it came.
    started_with: int = 0
    streak: list[Held] = field(default_factory=list)  # counted by the breaker, unjudged
    absolved: int = 0  # failures charged to their requests after a good probe
    corroborated: int = 0  # probes that confirmed a backend failure
    probes: int = 0

    def suspect(self, h: Held) -> None:
        """A suspect failure was counted by the breaker (below its threshold)."""
        self.streak.append(h)

    def streak_over(self) -> list[Held]:
        """A success ended the breaker's failure streak: its failures were the
        backend's (transient), to be counted so."""
        out, self.streak = self.streak, []
        return out

    def decide(self, now: float, client: str, would_open: bool) -> Decision:
        """What to do with a suspect failure: `record` it (the breaker counts
        it, and may open), `probe` (hold it and corroborate now), `hold` (a
        probe is out: its verdict covers this failure too) or `absolve` (a
        recent probe succeeded and the streak is one client's: the request's)."""
        if self.probing:
            return "hold"
        if not would_open:
            return "record"
        if self.last_probe_at is None or now - self.last_probe_at >= self.window_s:
            return "probe"
        clients = {h.client for h in self.streak} | {client}
        if self.last_probe_ok is False or len(clients) >= self.min_clients:
            return "record"
        return "absolve"

    def start_probe(self, now: float) -> None:
        self.probing = True
        self.last_probe_at = now
        self.probes += 1
        self.started_with = len(self.held)

    def probe_done(self, ok: bool, *, all_held: bool = False) -> list[Held]:
        """The probe's verdict: the failures it judges (held and the streak's),
        the requests' when `ok`, else the backend's. A failed probe judges
        only the failures held when it started: one held after that may have
        come after the backend recovered (a client's poison request while the
        probe was out) and stays held for the next probe (`all_held`: judge
        them all, e.g. shutting down)."""
        self.probing = False
        self.last_probe_ok = ok
        if ok or all_held:
            judged = self.streak + self.held
            self.held = []
        else:
            judged = self.streak + self.held[: self.started_with]
            self.held = self.held[self.started_with :]
        self.streak = []
        if ok:
            self.absolved += len(judged)
        else:
            self.corroborated += 1
        return judged

    def absolve(self, h: Held) -> list[Held]:
        """A recent probe passed and the streak is one client's: it and `h`
        are the requests' (the breaker forgets the streak too)."""
        judged = [*self.streak, h]
        self.streak = []
        self.absolved += len(judged)
        return judged

    def snapshot(self) -> dict[str, object]:
        return {
            "probing": self.probing,
            "last_probe_ok": self.last_probe_ok,
            "held": len(self.held),
            "streak": len(self.streak),
            "streak_clients": len({h.client for h in self.streak}),
            "probes": self.probes,
            "absolved": self.absolved,
            "corroborated": self.corroborated,
        }
