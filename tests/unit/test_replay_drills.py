"""The chaos drills' flight recordings (`bench/chaos.py --keep-recordings`,
real vLLM on this 2-core machine, short durations) replayed under the
policy they were recorded with (issue 22, fidelity): the goal is ≥ 95 % of
the time in the recorded tier, the counts within 10 % and a trustworthy
report. Recorded with `bench/chaos.py --short --keep-recordings DIR`
(drills 1 and 6 of an earlier run: pinned by test_replay_pinned.py; the
others of the 2026-12-05 run, `recording-drill-6-run2` that run's drill 6).
bench/results/replay-fidelity.md has the figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.replay.main import run_replay
from proxy.replay.trace import Trace, policy_from_knobs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "recordings"


def fidelity(name: str) -> dict[str, object]:
    path = FIXTURES / name
    trace = Trace.load(path)
    assert trace.recorded_policy is not None
    out = run_replay(policy_from_knobs(trace.recorded_policy), trace_path=str(path))
    fid: dict[str, object] | None = out.report["fidelity"]
    assert fid is not None
    return fid


def test_drill_1_engine_kill_replays_as_it_happened() -> None:
    fid = fidelity("recording-drill-1.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]
    assert fid["trustworthy"], fid["reasons"]


@pytest.mark.xfail(
    strict=False,
    reason="shed 56 replayed against 50 recorded (one request past the 10 %) since the "
    "load-model fixes that bring drill 6's second recording to 55/50; replaying a session's "
    "next request earlier when the replay runs ahead centres both on sheds but breaks "
    "drills 2 and 8 and both drill-6 TTFT p50s: bench/results/replay-fidelity.md, "
    "2026-12-05 drill6b",
)
def test_drill_6_overload_burst_meets_the_fidelity_goal() -> None:
    """A 10x burst on a host whose event loop ran late: the queue-wait signal
    sits on its mark. The replay evaluates its windows when the recorded loop
    ran them, and the throttle reads the waits the proxy measured where the
    replay stands where the recording stood (`proxy.replay.observed`)."""
    fid = fidelity("recording-drill-6.jsonl.gz")
    counts = fid["counts"]
    assert isinstance(counts, dict) and all(c["ok"] for c in counts.values()), counts
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]
    assert fid["trustworthy"], fid["reasons"]


def test_every_fidelity_gated_drill_is_a_drill() -> None:
    """A key of `FIDELITY_GATED` that names no drill gates nothing (drill 6
    was gated as "overload_burst", its key is "overload": its gate could
    never fail)."""
    from tests.chaos.scenarios import DRILLS, FIDELITY_GATED

    assert set(DRILLS) >= FIDELITY_GATED, sorted(FIDELITY_GATED - set(DRILLS))


def assert_goal(fid: dict[str, object]) -> None:
    counts = fid["counts"]
    assert isinstance(counts, dict) and all(c["ok"] for c in counts.values()), counts
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]
    assert fid["trustworthy"], fid["reasons"]


def test_drill_9_bad_canary_meets_the_fidelity_goal() -> None:
    """The proxy's own time before the backend call (here 0.05-0.4 s after
    the rollout's reload) is in the recorded TTFTs: replayed as recorded for
    a request that did not queue, the TTFTs agree (they read 0.127/0.192 s
    against 0.213/0.47 s without it)."""
    assert_goal(fidelity("recording-drill-9.jsonl.gz"))


def test_drill_6_second_run_holds_the_throttle_as_recorded() -> None:
    """The throttle's TTFT baseline held the hour before the trace: with the
    recorded baseline the replay keeps the throttle for the 57 s the proxy
    did (0.616 of the time in the recorded tier without it)."""
    fid = fidelity("recording-drill-6-run2.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]


def test_drill_6_second_run_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-6-run2.jsonl.gz"))


def test_drill_2_stall_meets_the_fidelity_goal() -> None:
    """SIGSTOP of vLLM's worker: `/health` kept passing while the engine
    answered nothing. The hang the requests saw lasts until a request (the
    breaker's trial) was answered again, the idle timeouts are corroborated
    by a recovery probe the hang keeps for `first_byte_s` before the breaker
    opens (0.794 of the time in the recorded tier before)."""
    assert_goal(fidelity("recording-drill-2.jsonl.gz"))


def test_drill_2_stall_is_one_hang_despite_passing_health_probes() -> None:
    from proxy.replay.world import build_world

    trace = Trace.load(FIXTURES / "recording-drill-2.jsonl.gz")
    primary = build_world(trace, idle_s=3.0).backends["primary"]
    assert all(primary.segment(t).state == "hung" for t in (4.0, 10.0, 18.0, 23.0))
    assert primary.segment(24.0).state == "up"


def test_drill_2_stall_second_run_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-2-run2.jsonl.gz"))


def test_drill_3_api_kill_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-3.jsonl.gz"))


def test_drill_4_redis_stop_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-4.jsonl.gz"))


def test_drill_5_fallback_kill_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-5.jsonl.gz"))


def test_drill_7_broken_reload_meets_the_fidelity_goal() -> None:
    assert_goal(fidelity("recording-drill-7.jsonl.gz"))


def test_drill_8_hostile_client_meets_the_fidelity_goal() -> None:
    """The hostile client's failures are suspect: the replay corroborates
    them with the backend's recovery probe, which passes (the backend is
    up), and charges them to their requests: no breaker opens, as in the
    recording (0.883 of the time in the recorded tier before, a throttle the
    proxy never entered)."""
    assert_goal(fidelity("recording-drill-8.jsonl.gz"))


def test_drill_8_second_run_follows_the_recorded_reloads() -> None:
    """Drill 8 reloads a policy with shorter timeouts (`first_byte_s` 10 ->
    4 s) for the hostile client's window: a replay of the recorded policy
    takes a recorded reload that changes only the backends' settings at its
    instant (0.866 of the time in the recorded tier without it, 0.334 with
    corroboration and without it: the hostile long answers held their slots
    for 10 s, the queue waits threw the replay into a throttle the proxy
    never entered)."""
    fid = fidelity("recording-drill-8-run2.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]


def test_drill_8_second_run_meets_the_fidelity_goal() -> None:
    """The hostile client's requests past the primary's window were refused
    there before they were sent (`refused`, context length) and answered by
    the fallback: replayed so, not as a 1020-token answer holding a slot of
    the primary (the others' TTFT p95 0.497 s against 0.363 s recorded)."""
    assert_goal(fidelity("recording-drill-8-run2.jsonl.gz"))


def test_drill_8_stream_begun_then_timed_out_ends_as_recorded() -> None:
    """The hostile client's stream whose first byte never came (the proxy had
    sent its headers and heartbeats, then ended it with an error event, no
    rescue) ends so in the replay too: one client error, as recorded, not a
    failover answered by the fallback (0 replayed; its late TTFT then sat
    among the others and moved drill 8's second run's TTFT p95 onto the
    0.363 -> 0.488 s cliff of its last few values)."""
    for name in ("recording-drill-8.jsonl.gz", "recording-drill-8-run2.jsonl.gz"):
        fid = fidelity(name)
        counts = fid["counts"]
        assert isinstance(counts, dict)
        assert counts["client_errors"]["recorded"] == 1, (name, counts)
        assert counts["client_errors"]["replayed"] == 1, (name, counts)


def test_drill_2_rescued_first_byte_timeouts_still_go_to_the_fallback() -> None:
    """Drill 2's first-byte timeouts after the stream began were rescued on
    the fallback: they are not ended as client errors."""
    fid = fidelity("recording-drill-2.jsonl.gz")
    counts = fid["counts"]
    assert isinstance(counts, dict)
    assert counts["client_errors"]["replayed"] == 0, counts


def test_drill_6_handover_is_not_load() -> None:
    """At limit 1 the answer before ends (its end stamped after its slot was
    released) a moment after the next one began: the next one ran alone
    (n0 was 2, and its replay at n = 1 shed the difference of the curves)."""
    from proxy.replay.world import build_world

    trace = Trace.load(FIXTURES / "recording-drill-6-run2.jsonl.gz")
    primary = build_world(trace).backends["primary"]
    q = next(q for q in trace.requests if q.session.startswith("4e56") and 16 < q.t < 17)
    assert primary._recorded[id(q)][2] == 1


def test_drill_6_decode_rate_leaves_out_answers_in_one_piece() -> None:
    """Half of drill 6-run2's answers alone on the engine came in one piece
    (first event after 80 % of their time): their decode is not observed.
    With them the decode rate at n = 1 read 1e-5 s/token, and an answer
    recorded at n = 2-8 replayed at n = 1 in a few milliseconds."""
    from proxy.replay.world import build_world

    trace = Trace.load(FIXTURES / "recording-drill-6-run2.jsonl.gz")
    primary = build_world(trace).backends["primary"]
    assert 1e-3 < primary.tpot(1) < 2.5e-3, primary.tpot.values
    for q in trace.requests:
        rec = primary._recorded.get(id(q))
        if rec is not None and rec[1] > 0.3:
            assert primary.latency(q, q.t, 1)[1] > 0.2, (q.t, rec)


def test_curve_is_a_weighted_monotone_fit_not_a_running_maximum() -> None:
    from proxy.replay.world import Curve

    c = Curve({1: [1.0] * 5, 2: [5.0, 5.0], 3: [2.0] * 10}, 0.0, 1.0)
    assert c(1) == 1.0
    assert c(2) == c(3) == pytest.approx((2 * 5.0 + 10 * 2.0) / 12)


def test_drill_6_queued_requests_hold_their_slot_until_the_call() -> None:
    """Drill 6's second burst: requests queued at 19.76 s called the engine
    at 21.4-21.6 s while it had 1-3 in flight at limit 8: the proxy's own
    time before the call, from the release that woke them, slot held."""
    from proxy.replay.observed import ObservedWaits

    trace = Trace.load(FIXTURES / "recording-drill-6.jsonl.gz")
    assert trace.recorded_policy is not None
    o = ObservedWaits(trace, policy_from_knobs(trace.recorded_policy))
    late = [
        o.gap[id(q)]
        for q in trace.requests
        if 19.7 < q.t < 19.8 and q.attempts and 21.4 < q.attempts[0].start < 21.7
    ]
    assert late and all(0.8 < g < 1.5 for g in late), late
    # At limit 1 the slot goes from one answer's end to the next call: ~10 ms.
    run2 = Trace.load(FIXTURES / "recording-drill-6-run2.jsonl.gz")
    assert run2.recorded_policy is not None
    o2 = ObservedWaits(run2, policy_from_knobs(run2.recorded_policy))
    gaps = sorted(o2.gap.values())
    assert 0.005 < gaps[len(gaps) // 2] < 0.02


def test_answers_all_in_one_piece_are_the_curves() -> None:
    """Answers that came in one piece are left out of the curves unless every
    answer did: then they are the curves (not the defaults), and their
    times per token count in the median either way (the fit's one loop keeps
    them aside)."""
    from proxy.replay.world import build_world

    trace = Trace.load(FIXTURES / "recording-drill-6-run2.jsonl.gz")
    reqs = [q for q in trace.requests if q.stream and q.attempts]
    # Every primary answer in one piece: its first event at 90 % of its time.
    trace.requests = [
        q._replace(
            attempts=tuple(
                a._replace(ttft=0.9 * (a.end - a.start)) if a.backend == "primary" else a
                for a in q.attempts
            )
        )
        for q in reqs
    ]
    primary = build_world(trace).backends["primary"]
    # A curve per level (without them: one value, the overall median).
    assert len(primary.ttft.values) > 1 and len(primary.tpot.values) > 1
    wholes = sorted(
        a.end - a.start
        for q in reqs
        for a in q.attempts
        if a.backend == "primary" and a.end > a.start
    )
    # The TTFT curve is made of the answers' 90 % marks, not the default.
    assert 0.5 * 0.9 * wholes[0] <= primary.ttft(1) <= 0.9 * wholes[-1]


def test_queued_requests_own_time_travels_with_the_packed_waits() -> None:
    """The other replay process takes the rebuild packed (`pack_waits`): the
    queued requests' own time after their slot came (`gap`) comes with it,
    request for request (without it the candidate's replay of drill 6 would
    call the backend at once, as before the model change)."""
    from proxy.replay.observed import ObservedWaits, pack_waits, unpack_waits

    path = FIXTURES / "recording-drill-6.jsonl.gz"
    trace = Trace.load(path)
    assert trace.recorded_policy is not None
    o = ObservedWaits(trace, policy_from_knobs(trace.recorded_policy))
    assert o.gap
    other = Trace.load(path)
    unpack_waits(pack_waits(trace), other)
    assert other.rebuilt_waits is not None
    _, pre, gap = other.rebuilt_waits
    index = {id(q): i for i, q in enumerate(trace.requests)}
    ids = [id(q) for q in other.requests]
    assert {ids[index[k]]: v for k, v in o.gap.items()} == gap
    assert {ids[index[k]]: v for k, v in o.pre.items()} == pre
