"""Replay fidelity under a busy host (chaos drill 6): the ladder's windows
run when the recorded loop ran them, and the throttle's queue-wait signal is
the one the recorded proxy measured wherever the replay stands where it stood."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from proxy.policy import Policy, parse_policy
from proxy.replay.observed import ObservedWaits
from proxy.replay.sim import Sim
from proxy.replay.trace import Trace
from proxy.replay.world import build_world
from proxy.telemetry.recorder import fingerprint

T0 = 1_700_000_000.0
POLICY = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
ladder:
  recovery: {window_s: 0.2}
  throttle: {max_inflight: 2}
"""


def policy(text: str = POLICY) -> Policy:
    return parse_policy(text, "<test>", env={})


def records(pol: Policy, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    digest, knobs = fingerprint(pol)
    return [{"k": "policy", "t": T0, "hash": digest, "knobs": knobs}] + [
        {**r, "t": T0 + r["t"]} for r in rest
    ]


def req(t: float, call: float, end: float, outcome: str = "complete") -> dict[str, Any]:
    # [backend, kind, status, fault, ttft, end offset, call offset]
    att = [["primary", "answered", 200, None, 0.05, end - t, call - t]]
    return {"k": "req", "t": t, "cl": "c1", "att": att, "be": "primary", "s": 200, "o": outcome}


def test_a_late_recorded_window_is_still_the_next_one() -> None:
    """The recorded loop ran a window a whole second late (a busy host): the
    replay evaluates then, and invents no window the proxy never ran (it did
    when the next recorded one was more than four windows away)."""
    pol = policy()
    ticks = [0.2, 0.4, 1.4, 1.6]
    tr = Trace.from_records(
        records(
            pol, *({"k": "tick", "t": t} for t in ticks), req(0.0, 0.0, 0.1), req(3.0, 3.0, 3.1)
        )
    )
    sim = Sim(pol, tr, build_world(tr))
    seen: list[float] = []
    evaluate = sim.evaluate

    def spy(window: bool = False) -> None:
        if window:
            seen.append(round(sim.now, 6))
        evaluate(window)

    sim.evaluate = spy  # type: ignore[method-assign]
    sim.replay()
    assert [t for t in seen if t <= 1.6] == ticks


def test_queue_waits_are_rebuilt_from_the_recording() -> None:
    pol = policy()
    tr = Trace.from_records(
        records(
            pol,
            req(0.0, 0.3, 1.0),  # admitted at once, called late (trimming, a busy loop)
            req(0.0, 0.3, 1.2),
            req(0.1, 1.0, 1.5),  # both slots taken: it waited 0.9 s for the first
            req(2.0, 2.4, 2.6),  # slots free again: a late call, no wait
        )
    )
    assert tr.calls
    waits = ObservedWaits(tr, pol)
    assert waits.usable
    assert [(round(t, 6), round(s, 6), c) for t, s, c in waits.waits] == [(1.0, 0.9, True)]


def test_recorded_waits_stand_in_only_where_the_replay_stands_where_the_recording_did() -> None:
    pol = policy()
    tr = Trace.from_records(
        records(
            pol,
            {"k": "tier", "t": 5.0, "from": "normal", "to": "throttle", "why": "pressure"},
            {"k": "limit", "t": 5.0, "from": 2, "to": 1},
            req(0.0, 0.0, 0.5),
        )
    )
    waits = ObservedWaits(tr, pol)
    assert waits.agrees(1.0, "normal", 2)
    assert not waits.agrees(1.0, "throttle", 1)
    assert waits.agrees(6.0, "throttle", 1)
    assert not waits.agrees(6.0, "throttle", 2)  # another limit: the replay's own waits
    # Other throttle knobs: the waits the recorded ones were are not this policy's.
    other = policy(POLICY.replace("max_inflight: 2", "max_inflight: 4"))
    assert not ObservedWaits(tr, other).usable


def test_an_older_recording_without_call_instants_models_its_waits() -> None:
    pol = policy()
    old = {"k": "req", "t": 0.0, "att": [["primary", "answered", 200, None, 0.05, 0.5]]}
    tr = Trace.from_records(records(pol, old))
    assert not tr.calls
    assert not ObservedWaits(tr, pol).usable


def test_a_wait_counts_as_the_proxy_counted_it_when_it_queued() -> None:
    """Fair share with three clients: when c3's request queued, c1 and c2
    held 3 slots each and c3 held 2 of the 8 — under its share (⌈8 ÷ 3⌉ =
    3), nobody over it: the proxy took its 2.5 s wait as engine pressure
    and throttled at its next window. The replay decided it at the backend
    call, when c3's new slot was already counted against its share, and
    dropped the wait (no throttle)."""
    pol = policy(POLICY.replace("max_inflight: 2", "max_inflight: 8"))

    def held(client: str, end: float) -> dict[str, Any]:
        return {**req(0.1, 0.1, end), "cl": client}

    ticks = [{"k": "tick", "t": round(0.2 * i, 1)} for i in range(1, 26)]
    tr = Trace.from_records(
        records(
            pol,
            *ticks,
            held("c1", 3.49),  # its slot goes to c3's waiter...
            held("c1", 4.0),
            held("c1", 4.0),
            *(held("c2", 4.0) for _ in range(3)),
            *(held("c3", 4.0) for _ in range(2)),
            {**req(1.0, 3.5, 4.5), "cl": "c3"},  # ...which calls the backend at 3.5
            {"k": "tier", "t": 3.6, "from": "normal", "to": "throttle", "why": "pressure"},
            {"k": "limit", "t": 3.6, "from": 8, "to": 6},
        )
    )
    waits = ObservedWaits(tr, pol)
    assert [(round(t, 6), round(s, 6), c) for t, s, c in waits.waits] == [(3.5, 2.5, True)]
    run = Sim(pol, tr, build_world(tr)).replay()
    assert [(round(t, 2), a, b) for t, a, b, _ in run.transitions] == [(3.6, "normal", "throttle")]


def test_a_wait_behind_a_client_over_its_share_does_not_count() -> None:
    pol = policy(POLICY.replace("max_inflight: 2", "max_inflight: 8"))

    def held(client: str) -> dict[str, Any]:
        return {**req(0.1, 0.1, 4.0), "cl": client}

    tr = Trace.from_records(
        records(
            pol,
            *(held("c1") for _ in range(6)),  # over its share (⌈8 ÷ 2⌉ = 4)
            *(held("c2") for _ in range(2)),
            {**req(1.0, 4.0, 4.5), "cl": "c2"},
        )
    )
    assert [c for _, _, c in ObservedWaits(tr, pol).waits] == [False]


def test_the_waits_are_rebuilt_once_per_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild is a function of the trace: a second replay of it (the
    candidate's) takes the first one's, the same waits and times."""
    pol = policy()
    tr = Trace.from_records(
        records(pol, req(0.0, 0.3, 1.0), req(0.0, 0.3, 1.2), req(0.1, 1.0, 1.5))
    )
    first = ObservedWaits(tr, pol)
    assert tr.rebuilt_waits is not None
    calls: list[object] = []

    def rebuild(self: ObservedWaits, t: Trace) -> list[tuple[float, float, bool]]:
        calls.append(t)
        return []

    monkeypatch.setattr(ObservedWaits, "_rebuild", rebuild)
    again = ObservedWaits(tr, None)
    assert calls == [] and again.pre is first.pre and again.pre
    assert again.gap is first.gap  # (a queued request's own time after its slot came)
    assert ObservedWaits(tr, pol).waits == first.waits != []
    assert dataclasses.replace(tr).rebuilt_waits is None  # (another trace: its own)
