"""`brownout replay`'s results, pinned: the synthetic scenarios, the drill
recordings and a short trace of `bench/replay_speed.py` replayed under a
few policies give exactly the recorded reports, and every replayed
request's figures (TTFTs, tier timelines, per-second series) hash to the
recorded digests. Speed work on the replay (issue 22) must not move a
single number.

A deliberate change of the replay's semantics (the backend model, the
fidelity measure) changes them: regenerate with

    BROWNOUT_PIN_UPDATE=1 .venv/bin/python -m pytest tests/unit/test_replay_pinned.py

and say why in the commit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from proxy.policy import Policy, parse_policy
from proxy.replay.main import Outcome, run_replay
from proxy.replay.sim import Run
from proxy.replay.trace import Trace, policy_from_knobs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
PINNED = FIXTURES / "replay-pinned.json"

BACKENDS = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
  fallback: {url: http://fallback.invalid, kind: transformers}
"""
CANDIDATES = {
    "default": BACKENDS,
    "worse": BACKENDS
    + "ladder:\n  breaker: {fail_max: 1000, failure_rate: 0}\n"
    + "  failover: {on_connect_error: false}\n",
    "no-rescue": BACKENDS + "ladder:\n  failover: {rescue_streams: false}\n",
    "tight": BACKENDS + "ladder:\n  throttle: {max_inflight: 8, queue_size: 4}\n"
    "  breaker: {fail_max: 3}\n",
}
SCENARIOS = ("engine-death", "overload-burst", "slow-prefill", "flapping", "fallback-down")
RECORDINGS = ("recording-drill-1.jsonl.gz", "recording-drill-6.jsonl.gz")


def _run_digest(run: Run) -> str:
    """Everything one replay produced, exactly (floats by their repr)."""
    state = {
        "duration": run.duration,
        "tiers": run.tiers,
        "transitions": run.transitions,
        "requests": run.requests,
        "answered": run.answered,
        "client_errors": run.client_errors,
        "maintenance_answers": run.maintenance_answers,
        "shed": run.shed,
        "failovers": run.failovers,
        "rescues": run.rescues,
        "intrinsic": run.intrinsic,
        "client_gone": run.client_gone,
        "ttfts": [repr(x) for x in run.ttfts],
        "ttft_t": [repr(x) for x in run.ttft_t],
        "series": {k: [repr(x) for x in v] for k, v in sorted(run.series.items())},
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _pinned(out: Outcome) -> dict[str, Any]:
    report = {
        k: v
        for k, v in out.report.items()
        if k not in ("replay_cpu_s", "replay_wall_s")  # timings
    }
    report["trace"] = {k: v for k, v in report["trace"].items() if k != "source"}
    # Through JSON, as `--json` prints it.
    return {
        "report": json.loads(json.dumps(report)),
        "baseline_run": _run_digest(out.baseline),
        "candidate_run": _run_digest(out.candidate),
    }


def _bench_trace(tmp: Path) -> Path:
    spec = importlib.util.spec_from_file_location("replay_speed", ROOT / "bench/replay_speed.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp / "bench.jsonl.gz"
    mod.write_trace(path, 0.05, 50.0)  # 3 minutes at 50 requests/s, an engine death
    return path


def _cases(tmp: Path) -> dict[str, Outcome]:
    pol = {name: parse_policy(text, env={}) for name, text in CANDIDATES.items()}
    out: dict[str, Outcome] = {}
    for sc in SCENARIOS:
        for seed in (0, 1):
            for name in ("default", "worse", "tight"):
                out[f"scenario {sc} seed {seed} {name}"] = run_replay(
                    pol[name], scenario=sc, seed=seed
                )
        out[f"scenario {sc} no-rescue vs worse"] = run_replay(
            pol["no-rescue"], scenario=sc, baseline=pol["worse"]
        )
    for rec in RECORDINGS:
        path = FIXTURES / "recordings" / rec
        knobs = Trace.load(path).recorded_policy
        assert knobs is not None
        recorded: Policy = policy_from_knobs(knobs)
        out[f"{rec} recorded"] = run_replay(recorded, trace_path=str(path))
        for name in ("worse", "tight"):
            out[f"{rec} {name}"] = run_replay(pol[name], trace_path=str(path), seed=3)
    bench = _bench_trace(tmp)
    for name in ("default", "tight"):
        out[f"bench {name}"] = run_replay(pol[name], trace_path=str(bench))
    return out


def test_replay_results_are_pinned(tmp_path: Path) -> None:
    got = {name: _pinned(o) for name, o in _cases(tmp_path).items()}
    if os.environ.get("BROWNOUT_PIN_UPDATE"):
        PINNED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {PINNED}")
    want = json.loads(PINNED.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name]["report"] == want[name]["report"], name
        assert got[name]["baseline_run"] == want[name]["baseline_run"], name
        assert got[name]["candidate_run"] == want[name]["candidate_run"], name


def test_side_by_side_replays_give_the_pinned_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The candidate's replay in a forked process (past PARALLEL_MIN requests:
    its own backend model, its run sent back as bytes) gives every figure
    the one-process replay gives."""
    from proxy.replay import main as replay_main

    monkeypatch.setattr(replay_main, "PARALLEL_MIN", 10)
    want = json.loads(PINNED.read_text())
    bench = str(_bench_trace(tmp_path))
    for name in ("default", "tight"):
        got = _pinned(run_replay(parse_policy(CANDIDATES[name], env={}), trace_path=bench))
        assert got == want[f"bench {name}"], name
    rec = FIXTURES / "recordings" / RECORDINGS[1]
    got = _pinned(
        run_replay(parse_policy(CANDIDATES["worse"], env={}), trace_path=str(rec), seed=3)
    )
    assert got == want[f"{RECORDINGS[1]} worse"]
