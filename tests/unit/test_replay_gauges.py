"""vLLM's gauges in a replay are the ones the recorded proxy read (issue 22,
fidelity). An engine's count lags the proxy's — a request sent but not yet
taken in, an answer relayed but still counted — and near the throttle's
marks one request decides a window: a replay that rebuilt the gauges from
its own count read `running` 8 where the proxy had read 7, throttled a
window early, and a 10-second queue-wait window carried the difference to a
tier agreement of 0.73 (tests/integration/test_replay_fidelity.py's burst,
2 of 5 runs on 2026-12-02)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.policy import Policy, parse_policy
from proxy.replay.main import run_replay
from proxy.replay.sim import replay
from proxy.replay.trace import Trace, policy_from_knobs
from proxy.replay.world import build_world
from proxy.telemetry.recorder import fingerprint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "recordings"
T0 = 1_700_000_000.0
POLICY = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
ladder:
  recovery: {window_s: 0.2}
  throttle: {max_inflight: 2, scrape_interval_s: 0.5}
"""


def policy() -> Policy:
    return parse_policy(POLICY, "<test>", env={})


def records(pol: Policy, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    digest, knobs = fingerprint(pol)
    return [{"k": "policy", "t": T0, "hash": digest, "knobs": knobs}] + [
        {**r, "t": T0 + r["t"]} for r in rest
    ]


def req(t: float, end: float, call: float | None = None) -> dict[str, Any]:
    # [backend, kind, status, fault, ttft, end offset, call offset]
    at = 0.0 if call is None else call - t
    att = [["primary", "answered", 200, None, 0.05, end - t, at]]
    return {"k": "req", "t": t, "cl": "c1", "att": att, "be": "primary", "s": 200, "o": "complete"}


def engine(t: float, running: float, waiting: float = 0.0) -> dict[str, Any]:
    return {"k": "engine", "t": t, "w": waiting, "r": running, "kv": running / 2, "rej": 0.0}


# The second request's arrival, backend call and the scrape that read one running.
ENGINE_LAGS = (1.0, 1.0, 1.002)  # called first; the engine read its count before it arrived
CALLED_AFTER = (1.0, 1.0003, 1.0001)  # the proxy called just after the scrape's record


def lagging_scrape_trace(pol: Policy, second: tuple[float, float, float]) -> Trace:
    """Two slots (`max_inflight: 2`, the KV cache full at two running). The
    second request is sent about when a scrape reads one running; the
    scrape at 1.55 reads two, and the recorded proxy throttled at its
    window after that (1.6), not before."""
    arrival, call, scrape = second
    ticks = [{"k": "tick", "t": round(0.2 * i, 1)} for i in range(1, 11)]
    scrapes = [
        engine(0.05, 0),
        engine(0.55, 1),
        engine(scrape, 1),  # the proxy has (about) two in flight; the engine counts one
        engine(1.55, 2),
        engine(2.05, 2),
    ]
    return Trace.from_records(
        records(
            pol,
            *ticks,
            *scrapes,
            req(0.3, 2.1),
            req(arrival, 2.1, call),
            {"k": "tier", "t": 1.6, "from": "normal", "to": "throttle", "why": "pressure"},
            {"k": "limit", "t": 1.6, "from": 2, "to": 1},
        )
    )


@pytest.mark.parametrize("second", [ENGINE_LAGS, CALLED_AFTER], ids=["engine-lags", "called-after"])
def test_a_replay_reads_the_gauges_the_recorded_proxy_read(
    second: tuple[float, float, float],
) -> None:
    pol = policy()
    tr = lagging_scrape_trace(pol, second)
    p = build_world(tr).backends["primary"]
    assert p.capacity == 2
    before, scrape, after = (e.t for e in tr.engine[1:4])  # as the replay scrapes
    # A count the recorded proxy had at the scrape: the recorded reading.
    assert p.gauges(scrape, 2) == (0.0, 1.0, 0.5)
    assert p.gauges(scrape, 1) == (0.0, 1.0, 0.5)
    assert p.gauges(after, 2) == (0.0, 2.0, 1.0)
    # More than the recording: running fills up to the capacity, then waiting.
    assert p.gauges(scrape, 4) == (1.0, 2.0, 1.0)
    # Fewer: waiting empties first, then running.
    assert p.gauges(before, 0) == (0.0, 0.0, 0.0)
    assert p.gauges(after, 0) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("second", [ENGINE_LAGS, CALLED_AFTER], ids=["engine-lags", "called-after"])
def test_a_lagging_scrape_does_not_throttle_a_window_early(
    second: tuple[float, float, float],
) -> None:
    pol = policy()
    tr = lagging_scrape_trace(pol, second)
    run = replay(pol, tr, build_world(tr))
    assert [(round(t, 2), a, b) for t, a, b, _ in run.transitions] == [(1.6, "normal", "throttle")]


def test_a_live_overload_burst_replays_as_it_happened() -> None:
    """The recording of a failing run of the live burst test (a real proxy in
    front of streaming fakes: 6 clients, 20 more for 8 s) replays under its
    own policy with the recorded tier timeline and counts."""
    path = FIXTURES / "recording-live-burst.jsonl.gz"
    trace = Trace.load(path)
    assert trace.recorded_policy is not None
    out = run_replay(policy_from_knobs(trace.recorded_policy), trace_path=str(path))
    fid = out.report["fidelity"]
    assert fid is not None
    assert fid["trustworthy"], fid["reasons"]
    assert fid["tier_agreement"] >= 0.95, fid
    rec = [(x["t"], x["to"]) for x in out.report["recorded"]["timeline"]]
    assert [(x["t"], x["to"]) for x in out.report["baseline"]["timeline"]] == rec
