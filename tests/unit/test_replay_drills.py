"""The chaos drills' flight recordings (`bench/chaos.py --keep-recordings`,
real vLLM on this 2-core machine, short durations) replayed under the
policy they were recorded with (issue 22, fidelity). Regenerate them with
`bench/chaos.py --drills 1,6 --short --keep-recordings tests/fixtures/recordings`."""

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
    fid = out.report["fidelity"]
    assert fid is not None
    return fid


def test_drill_1_engine_kill_replays_as_it_happened() -> None:
    fid = fidelity("recording-drill-1.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95, fid  # type: ignore[operator]
    assert fid["trustworthy"], fid["reasons"]


def test_drill_6_overload_burst_keeps_its_counts() -> None:
    """The burst's sheds, errors and TTFT percentiles are reproduced; its tier
    timeline is close (about 0.90: see the next test)."""
    fid = fidelity("recording-drill-6.jsonl.gz")
    counts = fid["counts"]
    assert isinstance(counts, dict) and all(c["ok"] for c in counts.values()), counts
    assert fid["tier_agreement"] >= 0.85, fid  # type: ignore[operator]


@pytest.mark.xfail(
    strict=True,
    reason="below the goal: the queue-wait signal of a 10x burst sits on its threshold, and "
    "the recorded proxy's loop ran late on a CPU shared with vLLM; the throttle's second "
    "entry and exit come 1-2 s late in the replay (tier agreement about 0.90)",
)
def test_drill_6_overload_burst_meets_the_fidelity_goal() -> None:
    fid = fidelity("recording-drill-6.jsonl.gz")
    assert fid["tier_agreement"] >= 0.95
