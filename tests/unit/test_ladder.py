"""The tier state machine under an injectable clock."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxy.control.ladder import (
    RANK,
    TIERS,
    TRANSITIONS,
    Ladder,
    Signals,
    Tier,
    Transition,
    desired_tier,
)
from proxy.policy import RecoveryPolicy

OK = Signals(primary_ok=True, fallback_ok=True)
PRESSURE = Signals(primary_ok=True, fallback_ok=True, pressure=True)
PRIMARY_DOWN = Signals(primary_ok=False, fallback_ok=True)
ALL_DOWN = Signals(primary_ok=False, fallback_ok=False)
SIGNALS_FOR: dict[Tier, Signals] = {
    "normal": OK,
    "throttle": PRESSURE,
    "failover": PRIMARY_DOWN,
    "maintenance": ALL_DOWN,
}

POLICY = RecoveryPolicy(
    window_s=1, min_dwell_s=10, healthy_windows=3, ramp=(0.05, 0.2, 0.5, 1.0), ramp_step_s=10
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(policy: RecoveryPolicy = POLICY) -> tuple[Ladder, Clock, list[Transition]]:
    clock = Clock()
    seen: list[Transition] = []
    return Ladder(policy, clock, seen.append), clock, seen


def hold(ladder: Ladder, clock: Clock, s: Signals, windows: int) -> None:
    for _ in range(windows):
        clock.t += POLICY.window_s
        ladder.evaluate(s)


def test_transition_table_is_complete() -> None:
    # Every escalation is an edge; recovery only one rank down.
    for a in TIERS:
        for b in TIERS:
            if RANK[b] > RANK[a]:
                assert (a, b) in TRANSITIONS
            elif RANK[b] == RANK[a] - 1 or (a, b) == ("maintenance", "throttle"):
                assert TRANSITIONS[(a, b)] == "recovered"
            else:
                assert (a, b) not in TRANSITIONS


@pytest.mark.parametrize(("start", "target"), [(a, b) for a in TIERS for b in TIERS if a != b])
def test_every_edge(start: Tier, target: Tier) -> None:
    ladder, clock, seen = make()
    ladder.evaluate(SIGNALS_FOR[start])
    assert ladder.tier == start
    if RANK[target] > RANK[start]:
        t = ladder.evaluate(SIGNALS_FOR[target])
        assert t is not None and t.to_tier == target  # escalation is immediate
        assert t.reason == TRANSITIONS[(start, target)]
        return
    # Recovery walks down one tier per dwell, never skipping — except that a
    # healthy primary leaves maintenance straight for throttle (its ramp): the
    # failover tier is the fallback's, no stepping stone (issue 14).
    path = [ladder.tier]
    for _ in range(50):
        hold(ladder, clock, SIGNALS_FOR[target], 1)
        if ladder.tier != path[-1]:
            path.append(ladder.tier)
        if ladder.tier == target:
            break
    assert ladder.tier == target
    for a, b in itertools.pairwise(path):
        if (a, b) == ("maintenance", "throttle"):
            continue
        assert RANK[a] - RANK[b] == 1, path
    assert all(t.reason == "recovered" for t in seen[1:] if RANK[t.to_tier] < RANK[t.from_tier])


def test_no_step_down_before_dwell_and_streak() -> None:
    ladder, clock, _ = make()
    ladder.evaluate(PRIMARY_DOWN)
    assert ladder.tier == "failover"
    hold(ladder, clock, OK, 9)  # 9 s < 10 s dwell, though 9 healthy windows
    assert ladder.tier == "failover"
    hold(ladder, clock, OK, 1)
    assert ladder.tier == "throttle"


def test_streak_resets_on_bad_window() -> None:
    pol = RecoveryPolicy(window_s=1, min_dwell_s=0, healthy_windows=3)
    ladder, clock, _ = make(pol)
    ladder.evaluate(PRESSURE)
    assert ladder.tier == "throttle"
    hold(ladder, clock, OK, 2)
    hold(ladder, clock, PRESSURE, 1)
    hold(ladder, clock, OK, 2)
    assert ladder.tier == "throttle"
    hold(ladder, clock, OK, 1)
    assert ladder.tier == "normal"


def test_flapping_input_does_not_flap_the_tier() -> None:
    ladder, clock, seen = make()
    for i in range(100):
        hold(ladder, clock, PRIMARY_DOWN if i % 2 else OK, 1)
    # One escalation, and never a recovery: the streak never reaches 3.
    assert [t.to_tier for t in seen] == ["failover"]


def test_ramp_after_failover_and_shares_are_exact() -> None:
    ladder, clock, _ = make()
    ladder.evaluate(PRIMARY_DOWN)
    hold(ladder, clock, OK, 10)
    assert ladder.tier == "throttle"
    assert ladder.ramp_share() == 0.05
    routes = [ladder.route() for _ in range(200)]
    assert routes.count("primary") == 10  # exactly 5 %
    for share in (0.2, 0.5):
        hold(ladder, clock, OK, 10)
        assert ladder.ramp_share() == share
        routes = [ladder.route() for _ in range(100)]
        assert routes.count("primary") == int(100 * share)
    hold(ladder, clock, OK, 10)
    assert ladder.ramp is None
    assert ladder.tier == "normal"
    assert {ladder.route() for _ in range(10)} == {"primary"}


def test_ramp_rolls_back_on_failure() -> None:
    ladder, clock, _seen = make()
    ladder.evaluate(PRIMARY_DOWN)
    hold(ladder, clock, OK, 10)
    assert ladder.ramp is not None
    t = ladder.report_failure("primary")
    assert t is not None and t.to_tier == "failover" and t.reason == "ramp_rollback"
    assert ladder.ramp is None
    # Failures of the other backend do not roll the primary's ramp back.
    hold(ladder, clock, OK, 10)
    assert ladder.report_failure("fallback") is None


def test_maintenance_recovery_ramps_the_fallback() -> None:
    # Issue 20: the ramp held 95 % back for maintenance, the only other
    # destination; now the fallback answers them all, on probation.
    ladder, clock, _ = make()
    ladder.evaluate(ALL_DOWN)
    assert ladder.route() == "maintenance"
    hold(ladder, clock, PRIMARY_DOWN, 10)
    assert ladder.tier == "failover"
    assert ladder.ramp is not None
    assert (ladder.ramp.target, ladder.ramp.rest, ladder.ramp.takes_all) == (
        "fallback",
        "maintenance",
        True,
    )
    assert ladder.ramp_share() == 1.0
    routes = [ladder.route() for _ in range(100)]
    assert routes == ["fallback"] * 100
    # Still on probation: its failure rolls back to maintenance.
    t = ladder.report_failure("fallback")
    assert t is not None and (t.to_tier, t.reason) == ("maintenance", "ramp_rollback")
    assert ladder.route() == "maintenance"


def test_forced_tier_wins_and_release_returns_to_the_live_tier() -> None:
    ladder, clock, seen = make()
    ladder.force("maintenance")
    assert ladder.tier == "maintenance"
    hold(ladder, clock, OK, 30)
    assert ladder.tier == "maintenance"
    assert seen[-1].reason == "forced"
    ladder.force(None)
    assert ladder.tier == "maintenance"  # until the next evaluation
    hold(ladder, clock, OK, 1)
    assert ladder.tier == "normal"
    assert seen[-1].reason == "released"
    assert ladder.ramp_share() == 0.05  # the primary takes its traffic back gradually


def test_desired_tier() -> None:
    assert desired_tier(OK) == "normal"
    assert desired_tier(PRESSURE) == "throttle"
    assert desired_tier(PRIMARY_DOWN) == "failover"
    assert desired_tier(ALL_DOWN) == "maintenance"
    assert (
        desired_tier(Signals(primary_ok=False, fallback_ok=False, pressure=True)) == "maintenance"
    )


class LadderMachine(RuleBasedStateMachine):
    """Random signals, time and operator actions; invariants must always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.ladder, self.clock, self.seen = make()
        self.routed: list[str] = []

    @rule(tier=st.sampled_from(TIERS), dt=st.floats(min_value=0, max_value=4))
    def evaluate(self, tier: Tier, dt: float) -> None:
        self.clock.t += dt
        before = self.ladder.tier
        entered = self.ladder.entered_at
        self.ladder.evaluate(SIGNALS_FOR[tier])
        after = self.ladder.tier
        released = bool(self.seen) and self.seen[-1].reason == "released"
        if RANK[after] < RANK[before] and not released:
            # No step-down before the dwell, and only one step (or maintenance
            # → throttle: the primary's ramp straight from maintenance).
            assert self.clock.t - entered >= POLICY.min_dwell_s
            assert RANK[before] - RANK[after] == 1 or (before, after) == (
                "maintenance",
                "throttle",
            )
        if self.ladder.forced is not None:
            assert after == self.ladder.forced

    @rule(tier=st.one_of(st.none(), st.sampled_from(TIERS)))
    def force(self, tier: Tier | None) -> None:
        self.ladder.force(tier)
        if tier is not None:
            assert self.ladder.tier == tier

    @rule(backend=st.sampled_from(["primary", "fallback"]))
    def failure(self, backend: str) -> None:
        self.ladder.report_failure(backend)

    @precondition(lambda self: self.ladder.ramp is not None)
    @rule(n=st.integers(min_value=1, max_value=60))
    def route(self, n: int) -> None:
        r = self.ladder.ramp
        assert r is not None
        share = self.ladder.policy.ramp[r.step]
        for _ in range(n):
            self.ladder.route()
        r = self.ladder.ramp
        assert r is not None
        # A ramp step never sends more than its share of the traffic.
        assert r.sent <= r.seen * share + 1e-9

    @invariant()
    def forced_always_wins(self) -> None:
        if self.ladder.forced is not None:
            assert self.ladder.tier == self.ladder.forced

    @invariant()
    def history_edges_are_known(self) -> None:
        for t in self.seen:
            assert t.reason in ("forced", "released", "ramp_rollback") or (
                (t.from_tier, t.to_tier) in TRANSITIONS
            )


LadderMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLadderMachine = LadderMachine.TestCase
