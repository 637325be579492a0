"""The degradation ladder: signals in, tier out.

    normal ──► throttle ──► failover ──► maintenance
       ◄──────────◄────────────◄─────────────◄   (one step at a time)

Escalation is immediate: the worst tier the signals call for is entered at
once (`TRANSITIONS` lists the reason of every edge). Recovery is one tier at a
time, and only after the current tier has been held for `min_dwell_s` and the
signals have asked for a better tier in `healthy_windows` consecutive
evaluations — so a flapping input cannot flap the tier.

Leaving failover (or maintenance) starts a traffic ramp: the recovered
backend gets `ramp[0]` of the requests (5 % by default), then each next share
after `ramp_step_s` without errors; `ramp_max_failures` failures of the
recovered backend during the ramp roll the ladder back to the tier it left.
Routing by share is deterministic (an accumulator, not a random draw), so a
step never sends more than its share.

A forced tier (`POST /brownout/tier`) always wins until released.

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
    """A recovered backend taking back its traffic, share by share."""

    target: Literal["primary", "fallback"]
    step: int
    step_started: float
    failures: int = 0
    acc: float = 0.0
    sent: int = 0  # requests sent to the target during this step
    seen: int = 0  # requests routed during this step


def desired_tier(s: Signals) -> Tier:
    if not s.primary_ok:
        return "failover" if s.fallback_ok else "maintenance"
    return "throttle" if s.pressure else "normal"


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
        if RANK[want] > RANK[self.tier]:
            self.ramp = None
            return self._move(want, TRANSITIONS[(self.tier, want)], s.detail)
        t: Transition | None = None
        if RANK[want] < RANK[self.tier]:
            self.healthy_streak += 1
            p = self.policy
            if now - self.entered_at >= p.min_dwell_s and self.healthy_streak >= p.healthy_windows:
                old = self.tier
                step_to = TIERS[max(RANK[want], RANK[old] - 1)]
                t = self._move(step_to, "recovered", s.detail or f"{old} no longer needed")
                if old == "failover":
                    self.ramp = Ramp("primary", 0, now)
                elif old == "maintenance":
                    self.ramp = Ramp("fallback", 0, now)
        else:
            self.healthy_streak = 0
        self._advance_ramp(now)
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
            # Step down from a forced tier like from any other: dwell and streak.
            self.entered_at = self.clock()
            self.healthy_streak = 0
            return None
        self.forced = tier
        self.ramp = None
        if self.tier != tier:
            return self._move(tier, "forced", "forced by an operator")
        return None

    # -- routing -----------------------------------------------------------------

    def ramp_share(self) -> float | None:
        r = self.ramp
        return None if r is None else self.policy.ramp[r.step]

    def route(self) -> Destination:
        """Where the next request goes."""
        tier = self.tier
        if tier == "maintenance":
            return "maintenance"
        r = self.ramp
        if tier == "failover":
            if r is not None and r.target == "fallback" and self.forced is None:
                return "fallback" if self._ramp_take(r) else "maintenance"
            return "fallback"
        if r is not None and r.target == "primary" and self.forced is None:
            return "primary" if self._ramp_take(r) else "fallback"
        return "primary"

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
        back: Tier = "failover" if r.target == "primary" else "maintenance"
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
                "share": self.policy.ramp[r.step],
                "step": r.step,
                "failures": r.failures,
            },
        }
