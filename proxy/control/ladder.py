"""The degradation ladder: signals in, tier out.

    normal ──► throttle ──► failover ──► maintenance
       ◄──────────◄────────────◄─────────────◄   (one step at a time)

Escalation is immediate: the worst tier the signals call for is entered at
once (`TRANSITIONS` lists the reason of every edge). Recovery is one step at a
time, and only after the current tier has been held for `min_dwell_s` and the
signals have asked for a better tier in `healthy_windows` consecutive
evaluations — so a flapping input cannot flap the tier.

Stepping down goes towards whichever backend is healthy, the primary first:

- from failover or maintenance with the primary healthy → throttle, with a
  ramp towards the primary (a healthy primary is never held behind a dead
  fallback: maintenance → throttle skips the failover tier when that is
  where the healthy backend is);
- from maintenance with only the fallback healthy → failover, with a ramp
  towards the fallback.

A ramp gives its target `ramp[0]` of the requests (5 % by default), then each
next share after `ramp_step_s`; the rest go to the other backend while it is
healthy (`Ramp.rest`: the fallback, else maintenance — re-read at every
evaluation). A ramp holds requests back from its target only for a backend
that can answer them: once the rest would be maintenance (the fallback down,
or a ramp towards the fallback itself), the target takes every request
(`Ramp.takes_all`, for the rest of the ramp, even if the fallback comes back:
a healthy backend is not made to give traffic away mid-ramp). A user prefers
an answer from a backend that just passed its probes, even a slow one, to a
maintenance notice; the ramp's throttle tier (lower admission limit,
sheddable requests shed) is what protects it meanwhile. `ramp_max_failures`
failures *of the ramp's target* roll the ladder back to the tier the rest
belongs to; a failure of the other backend never touches the ramp. Routing
by share is deterministic (an accumulator, not a random draw), so a step
never sends more than its share. So `route()` answers `maintenance` only in
the maintenance tier.

A forced tier (`POST /brownout/tier`) always wins until released. Releasing
it moves at the next evaluation straight to the tier the live signals call
for (reason `released`), through a ramp when the forced tier had shifted
traffic away from the backend that takes it back.

Recovery bound (the primary healthy, no pressure, nothing forced, from time
t0; evaluations every window_s): one step takes at most
S = max(min_dwell_s + window_s, healthy_windows × window_s), the ramp at most
R = n × (ramp_step_s + window_s) with n the shares below 1. The tier is normal
and the ramp over by t0 + 2·S + max(S, R) + window_s — the worst path is a
fallback ramp that its own failure rolls back to maintenance (one extra step)
before the primary's ramp. `recovery_bound(policy)` computes it; the
property test in tests/unit/test_ladder_recovery.py checks it. No request
is routed to maintenance after t0 + 2·S + window_s (`maintenance_bound`:
the step out of maintenance, after at most one rollback of a fallback ramp
back into it; the primary's ramp never sends a request to maintenance).

The machine is pure: time comes from an injectable clock, side effects (metrics,
logs, status history) from the `on_transition` callback.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from proxy.policy import RecoveryPolicy

Tier = Literal["normal", "throttle", "failover", "maintenance"]
Destination = Literal["primary", "fallback", "maintenance"]

TIERS: tuple[Tier, ...] = ("normal", "throttle", "failover", "maintenance")
RANK: dict[Tier, int] = {t: i for i, t in enumerate(TIERS)}

# The transition table: (from, to) → reason code (a metric label). Every edge
# the machine can take is here; anything else is a bug.
TRANSITIONS: dict[tuple[Tier, Tier], str] = {}
for _a in TIERS:
    for _b in TIERS:
        if RANK[_b] > RANK[_a]:
            TRANSITIONS[(_a, _b)] = {
                "throttle": "pressure",
                "failover": "primary_down",
                "maintenance": "fallback_down",
            }[_b]
        elif RANK[_b] == RANK[_a] - 1:
            TRANSITIONS[(_a, _b)] = "recovered"
del _a, _b
# A healthy primary leaves maintenance through its own ramp, skipping the
# fallback's tier (which would ramp towards a dead fallback).
TRANSITIONS[("maintenance", "throttle")] = "recovered"
# Extra reasons that reuse the edges above or jump by force.
REASONS = frozenset(
    {
        "pressure",
        "primary_down",
        "fallback_down",
        "recovered",
        "forced",
        "released",
        "ramp_rollback",
    }
)


@dataclass(frozen=True, slots=True)
class Signals:
    """What the ladder is told at each evaluation."""

    primary_ok: bool
    fallback_ok: bool
    pressure: bool = False
    detail: str = ""  # human reason for the log/status


@dataclass(frozen=True, slots=True)
class Transition:
    at: float
    from_tier: Tier
    to_tier: Tier
    reason: str
    detail: str


@dataclass(slots=True)
class Ramp:
    """A recovered backend taking back its traffic, share by share; what
    the ramp does not send to it goes to `rest` — unless `takes_all`: the
    rest had nowhere to go but maintenance, so the target takes everything."""

    target: Literal["primary", "fallback"]
    step: int
    step_started: float
    rest: Destination = "fallback"
    takes_all: bool = False
    failures: int = 0
    acc: float = 0.0
    sent: int = 0  # requests sent to the target during this step
    seen: int = 0  # requests routed during this step

    def __post_init__(self) -> None:
        self.set_rest(self.rest)

    def set_rest(self, rest: Destination) -> None:
        """Where held-back requests would go now; maintenance is nowhere to
        hold them back for, so from then on the target takes them all."""
        self.rest = rest
        self.takes_all = self.takes_all or rest == "maintenance"


def desired_tier(s: Signals) -> Tier:
    if not s.primary_ok:
        return "failover" if s.fallback_ok else "maintenance"
    return "throttle" if s.pressure else "normal"


def _rest(s: Signals) -> Destination:
    return "fallback" if s.fallback_ok else "maintenance"


def recovery_bound(p: RecoveryPolicy) -> float:
    """Seconds of a healthy primary (no pressure, nothing forced) after which
    the tier is normal and no ramp is left, whatever the fallback does."""
    w = p.window_s
    step = max(p.min_dwell_s + w, p.healthy_windows * w)
    shares_below_one = next((i for i, share in enumerate(p.ramp) if share >= 1.0), len(p.ramp))
    ramp = shares_below_one * (p.ramp_step_s + w)
    return 2 * step + max(step, ramp) + w


def maintenance_bound(p: RecoveryPolicy) -> float:
    """Seconds of a healthy primary (no pressure, nothing forced) after which
    no request is routed to maintenance, whatever the fallback does."""
    w = p.window_s
    return 2 * max(p.min_dwell_s + w, p.healthy_windows * w) + w


@dataclass
class Ladder:
    policy: RecoveryPolicy
    clock: Callable[[], float]
    on_transition: Callable[[Transition], None] | None = None
    tier: Tier = "normal"
    forced: Tier | None = None
    entered_at: float = 0.0
    healthy_streak: int = 0
    ramp: Ramp | None = None
    history: collections.deque[Transition] = field(
        default_factory=lambda: collections.deque(maxlen=100)
    )
    last_detail: str = ""
    _released: bool = field(default=False, init=False, repr=False)  # a force just ended

    def __post_init__(self) -> None:
        self.entered_at = self.clock()

    # -- transitions -------------------------------------------------------------

    def _move(self, to: Tier, reason: str, detail: str) -> Transition:
        now = self.clock()
        t = Transition(now, self.tier, to, reason, detail)
        self.tier = to
        self.entered_at = now
        self.healthy_streak = 0
        self.last_detail = detail
        self.history.append(t)
        if self.on_transition is not None:
            self.on_transition(t)
        return t

    def evaluate(self, s: Signals) -> Transition | None:
        """One evaluation window: maybe move one edge."""
        now = self.clock()
        if self.forced is not None:
            if self.tier != self.forced:
                self.ramp = None
                return self._move(self.forced, "forced", "forced by an operator")
            return None
        want = desired_tier(s)
        if self._released:
            self._released = False
            return self._release(want, s, now)
        if RANK[want] > RANK[self.tier]:
            self.ramp = None
            return self._move(want, TRANSITIONS[(self.tier, want)], s.detail)
        t: Transition | None = None
        if RANK[want] < RANK[self.tier]:
            self.healthy_streak += 1
            p = self.policy
            if now - self.entered_at >= p.min_dwell_s and self.healthy_streak >= p.healthy_windows:
                t = self._step_down(want, s, now)
        else:
            self.healthy_streak = 0
        if self.ramp is not None and self.ramp.target == "primary":
            self.ramp.set_rest(_rest(s))
        self._advance_ramp(now)
        return t

    def _step_down(self, want: Tier, s: Signals, now: float) -> Transition:
        """One step towards `want`, towards whichever backend is healthy."""
        old = self.tier
        detail = s.detail or f"{old} no longer needed"
        if old in ("failover", "maintenance") and s.primary_ok:
            # The primary takes its traffic back through its own ramp, even
            # from maintenance: a dead fallback is no stepping stone.
            t = self._move("throttle", "recovered", detail)
            self.ramp = Ramp("primary", 0, now, _rest(s))
        elif old == "maintenance":
            t = self._move("failover", "recovered", detail)
            self.ramp = Ramp("fallback", 0, now, "maintenance")
        else:
            t = self._move(TIERS[max(RANK[want], RANK[old] - 1)], "recovered", detail)
        return t

    def _release(self, want: Tier, s: Signals, now: float) -> Transition | None:
        """A force was just released: straight to what the signals call for,
        through a ramp when the forced tier had shifted the traffic away."""
        old = self.tier
        self.ramp = None
        if want == old:
            return None
        t = self._move(want, "released", s.detail or "released by an operator")
        if RANK[want] < RANK[old]:
            if want in ("normal", "throttle") and old in ("failover", "maintenance"):
                self.ramp = Ramp("primary", 0, now, _rest(s))
            elif want == "failover" and old == "maintenance":
                self.ramp = Ramp("fallback", 0, now, "maintenance")
        return t

    def _advance_ramp(self, now: float) -> None:
        r = self.ramp
        if r is None or now - r.step_started < self.policy.ramp_step_s:
            return
        r.step += 1
        r.step_started = now
        r.acc = 0.0
        r.sent = r.seen = 0
        if r.step >= len(self.policy.ramp) or self.policy.ramp[r.step] >= 1.0:
            self.ramp = None

    def force(self, tier: Tier | None) -> Transition | None:
        """Force a tier (None releases the force; the next evaluation decides)."""
        if tier is None:
            if self.forced is None:
                return None
            self.forced = None
            # The next evaluation moves to the tier its signals call for.
            self._released = True
            return None
        self.forced = tier
        self._released = False
        self.ramp = None
        if self.tier != tier:
            return self._move(tier, "forced", "forced by an operator")
        return None

    # -- routing -----------------------------------------------------------------

    def ramp_share(self) -> float | None:
        """The share of requests the ramp's target gets now (1 when it takes all)."""
        r = self.ramp
        if r is None:
            return None
        return 1.0 if r.takes_all else self.policy.ramp[r.step]

    def route(self) -> Destination:
        """Where the next request goes."""
        tier = self.tier
        if tier == "maintenance":
            return "maintenance"
        r = self.ramp
        if r is not None and self.forced is None:
            return r.target if r.takes_all or self._ramp_take(r) else r.rest
        return "fallback" if tier == "failover" else "primary"

    def _ramp_take(self, r: Ramp) -> bool:
        share = self.policy.ramp[r.step]
        r.seen += 1
        r.acc += share
        if r.acc >= 1.0:
            r.acc -= 1.0
            r.sent += 1
            return True
        return False

    def report_failure(self, backend: str) -> Transition | None:
        """A failure of `backend`; rolls a ramp towards it back when too many."""
        r = self.ramp
        if r is None or r.target != backend:
            return None
        r.failures += 1
        if r.failures < self.policy.ramp_max_failures:
            return None
        self.ramp = None
        back: Tier = "failover" if r.rest == "fallback" else "maintenance"
        return self._move(back, "ramp_rollback", f"{backend} failed during the recovery ramp")

    def snapshot(self) -> dict[str, object]:
        r = self.ramp
        return {
            "tier": self.tier,
            "forced": self.forced,
            "since": self.entered_at,
            "reason": self.last_detail,
            "healthy_streak": self.healthy_streak,
            "ramp": None
            if r is None
            else {
                "target": r.target,
                "rest": r.rest,
                "takes_all": r.takes_all,
                "share": self.ramp_share(),
                "step": r.step,
                "failures": r.failures,
            },
        }
