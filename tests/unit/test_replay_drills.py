"""The chaos drills' flight recordings (`bench/chaos.py --keep-recordings`,
real vLLM on this 2-core machine, short durations) replayed under the
policy they were recorded with (issue 22, fidelity). Regenerate them with
`bench/chaos.py --drills 1,6 --short --keep-recordings tests/fixtures/recordings`."""

from __future__ import annotations

from pathlib import Path

from proxy.replay.main import run_replay
from proxy.replay.trace import Trace, policy_from_knobs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "recordings"


def fidelity(name: str) -> dict[str, object]:
    path = FIXTURES / name
    trace = Trace.load(path)
    assert trace.recorded_policy is not None
    out = run_replay(policy_from_knobs(trace.recorded_policy), trace_path=str(path))
    fid = out.report["fidelity"]
    assert fid is not None
    return fid


def test_drill_1_engine_kill_replays_as_it_happened() -> None:
    fid = fidelity("recording-drill-1.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]
    assert fid["trustworthy"], fid["reasons"]


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

    assert FIDELITY_GATED <= set(DRILLS), sorted(FIDELITY_GATED - set(DRILLS))
