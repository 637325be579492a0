"""`brownout replay`: scenarios, the backend model, the comparison and the
command's exit codes (issue 22). A recorded trace's fidelity is measured in
tests/integration/test_replay_fidelity.py and by `bench/chaos.py --replay`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.policy import parse_policy
from proxy.replay.main import run_replay
from proxy.replay.report import agreement
from proxy.replay.scenarios import T0, scenario_records, scenario_trace
from proxy.replay.trace import Attempt, Probe, Request, Trace
from proxy.replay.world import Segment, build_world, infer_segments

BACKENDS = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
  fallback: {url: http://fallback.invalid, kind: transformers}
"""
# Known worse on an engine death: a breaker that never opens, and no
# per-request failover (a request that meets the dead engine is not sent on).
WORSE = (
    BACKENDS
    + """ladder:
  breaker: {fail_max: 1000, failure_rate: 0}
  failover: {on_connect_error: false}
"""
)
NO_RESCUE = BACKENDS + "ladder:\n  failover: {rescue_streams: false}\n"


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_scenarios_are_seeded_and_shaped_as_documented() -> None:
    a, b = scenario_records("engine-death", 1), scenario_records("engine-death", 1)
    assert a == b
    assert a != scenario_records("engine-death", 2)
    tr = scenario_trace("engine-death")
    world = build_world(tr)
    p = world.backends["primary"]
    assert p.segment(T0 - 1).state == "up"
    assert p.segment(T0 + 1).state == "down" and p.segment(T0 + 1).fault == "upstream_error"
    assert p.segment(T0 + 10).fault == "connect"
    assert p.segment(T0 + 91).state == "up"
    assert world.backends["fallback"].segment(T0 + 10).state == "up"
    burst = scenario_trace("overload-burst")
    during = sum(1 for q in burst.requests if T0 <= q.t < T0 + 60)
    before = sum(1 for q in burst.requests if T0 - 60 <= q.t < T0)
    assert 6 < during / before < 15  # ten times the rate, Poisson noise aside


def test_a_worse_candidate_is_reported_worse_on_engine_death(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cand = write(tmp_path, "worse.yaml", WORSE)
    rc = main(
        [
            "replay",
            "--scenario",
            "engine-death",
            "--policy",
            cand,
            "--json",
            "--fail-on",
            "client_errors,maintenance_answers,shed,ttft_p95",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert report["failed"] == ["maintenance_answers"]
    base, worse = report["baseline"], report["candidate"]
    assert worse["maintenance_answers"] > base["maintenance_answers"] == 0
    for key in (
        "tier_seconds",
        "transitions",
        "client_errors",
        "maintenance_answers",
        "shed",
        "failovers",
        "rescues",
        "ttft_p50_s",
        "ttft_p95_s",
    ):
        assert key in base and key in worse
    assert set(base["tier_seconds"]) == {"normal", "throttle", "failover", "maintenance"}
    assert set(base["shed"]) == {"critical", "normal", "sheddable"}
    assert report["fidelity"] is None  # a scenario has no recorded policy
    # --fail-on names what gates: shed alone does not fail this candidate.
    rc = main(["replay", "--scenario", "engine-death", "--policy", cand, "--fail-on", "shed"])
    assert rc == 0


def test_turning_stream_rescue_off_costs_client_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cand = write(tmp_path, "norescue.yaml", NO_RESCUE)
    rc = main(
        ["replay", "--scenario", "engine-death", "--policy", cand, "--fail-on", "client_errors"]
    )
    out = capsys.readouterr()
    assert rc == 1
    assert "candidate worse on: client_errors" in out.out
    assert "the candidate is worse on client_errors" in out.err


def test_a_better_candidate_is_reported_better(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The defaults against the worse policy as the baseline."""
    base = write(tmp_path, "worse.yaml", WORSE)
    cand = write(tmp_path, "defaults.yaml", BACKENDS)
    rc = main(
        [
            "replay",
            "--scenario",
            "engine-death",
            "--policy",
            cand,
            "--baseline",
            base,
            "--json",
            "--fail-on",
            "client_errors,maintenance_answers,shed,ttft_p95",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert "maintenance_answers" in report["better_on"] and report["worse_on"] == []


def test_admitting_more_than_the_engine_holds_is_slower() -> None:
    """The load model: a limit above the engine's slots queues in the engine."""
    tight = parse_policy(BACKENDS + "ladder:\n  throttle: {max_inflight: 16}\n", env={})
    loose = parse_policy(
        BACKENDS + "ladder:\n  throttle: {max_inflight: 200, queue_size: 0, enabled: false}\n",
        env={},
    )
    out = run_replay(loose, scenario="overload-burst", baseline=tight)
    b, c = out.report["baseline"], out.report["candidate"]
    assert c["ttft_p95_s"] > 2 * b["ttft_p95_s"]
    assert sum(c["shed"].values()) == 0 < sum(b["shed"].values())


def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cand = write(tmp_path, "c.yaml", BACKENDS)
    assert (
        main(["replay", "--scenario", "engine-death", "--policy", cand, "--fail-on", "latency"])
        == 2
    )
    assert "--fail-on: unknown latency" in capsys.readouterr().err
    bad = write(tmp_path, "bad.yaml", BACKENDS + "ladder:\n  breaker: {fail_max: -1}\n")
    assert main(["replay", "--scenario", "engine-death", "--policy", bad]) == 2
    assert "bad.yaml:5: ladder.breaker.fail_max" in capsys.readouterr().err
    assert main(["replay", "--trace", str(tmp_path / "nothing"), "--policy", cand]) == 2


# --------------------------------------------------------------------------- the world


def att(b: str, kind: str, start: float, end: float, fault: str = "", status: int = 200) -> Attempt:
    return Attempt(b, kind, status, fault, 0.05 if kind == "answered" else None, start, end)


def test_conditions_are_inferred_from_attempts_and_probes() -> None:
    attempts = [
        att("primary", "answered", 0.0, 1.0),
        att("primary", "answered", 2.0, 3.0),
        att("primary", "failed", 2.5, 2.51, "http_500", 500),  # alone among answers
        att("primary", "answered", 3.0, 4.0),
        att("primary", "ended", 4.0, 5.0, "upstream_disconnect"),  # the engine died at 5
        att("primary", "failed", 6.0, 6.001, "connect", 502),
    ]
    probes = [
        Probe(5.6, "primary", False, True, "connection failed: refused"),
        Probe(9.0, "primary", False, True, "connection failed: refused"),
        Probe(10.0, "primary", True, False, None),
    ]
    segs = infer_segments(attempts, probes)
    states = [(round(s.start, 2), s.state, s.fault) for s in segs]
    assert (0.0, "erroring", "http_500") in states  # the lone 500: a share of its bin
    assert (5.0, "down", "upstream_error") in states  # at the very instant of the cut
    assert (5.3, "down", "connect") in states  # half-way from the cut to the refusal
    assert (9.5, "up", "") in states  # half-way between the last refusal and the first ok


def _trace(requests: list[Request], probes: list[Probe]) -> Trace:
    tr = Trace(start=0.0, end=20.0, requests=requests, probes=probes)
    return tr


def req(t: float, *attempts: Attempt, stream: bool = True) -> Request:
    return Request(
        t,
        "normal",
        stream,
        "chat",
        "",
        10,
        20,
        attempts,
        "primary",
        200,
        "complete",
        0.05,
        0.3,
        False,
        0,
    )


def test_a_stream_in_flight_when_its_backend_dies_is_cut_there() -> None:
    reqs = [req(float(t), att("primary", "answered", float(t), t + 0.3)) for t in range(5)]
    reqs.append(
        req(
            5.0,
            att("primary", "ended", 5.0, 5.2, "upstream_disconnect"),
            att("fallback", "answered", 5.2, 5.6),
        )
    )
    world = build_world(_trace(reqs, [Probe(5.1, "primary", False, True, "connection failed")]))
    p = world.backends["primary"]
    assert p.kills == [pytest.approx(5.2)]
    import random

    out = p.call(reqs[0], 5.0, 1, 10.0, 5.0, random.Random(0))  # sent just before the death
    assert out.kind == "cut" and out.end == pytest.approx(5.2)
    out = p.call(reqs[0], 6.0, 1, 10.0, 5.0, random.Random(0))
    assert out.kind == "fail" and out.fault == "connect"


def test_a_hang_fails_a_request_only_past_its_deadline() -> None:
    import random

    from proxy.replay.world import BackendWorld

    w = BackendWorld(
        "primary", segments=[Segment(0.0, "up"), Segment(10.0, "hung"), Segment(13.0, "up")]
    )
    q = req(0.0, stream=True)
    # Sent during a 3 s hang: waits it out within a 5 s first-byte deadline...
    out = w.call(q, 11.0, 1, 5.0, 30.0, random.Random(0))
    assert out.kind == "ok" and out.first is not None and out.first > 13.0
    # ... and times out at its deadline when it is shorter.
    out = w.call(q, 10.5, 1, 1.0, 30.0, random.Random(0))
    assert (out.kind, out.fault, out.end) == ("fail", "first_byte_timeout", 11.5)


def test_agreement_is_the_share_of_time_in_the_same_tier() -> None:
    rec = [(0.0, "normal"), (10.0, "failover"), (20.0, "normal")]
    rep = [(0.0, "normal"), (11.0, "failover"), (20.0, "normal")]
    assert agreement(rec, rep, 40.0) == pytest.approx(39 / 40)
    assert agreement(rec, rec, 40.0) == 1.0


def test_the_html_report_holds_both_timelines(tmp_path: Path) -> None:
    cand = write(tmp_path, "c.yaml", NO_RESCUE)
    page = tmp_path / "r.html"
    assert (
        main(["replay", "--scenario", "fallback-down", "--policy", cand, "--html", str(page)]) == 0
    )
    text = page.read_text()
    for ident in ("timeline-baseline", "timeline-candidate", "plot-load", "plot-latency"):
        assert f'id="{ident}"' in text
    assert "<script" not in text and "http://" not in text.split("<body>", 1)[1]
    assert 'data-tier="maintenance"' in text


def test_the_cli_knows_the_replays_names() -> None:
    from proxy import cli
    from proxy.replay import names

    assert cli.REPLAY_SCENARIOS == names.SCENARIOS
    assert cli.REPLAY_FAIL_ON == names.FAIL_ON


def test_a_long_trace_replays_its_candidate_in_a_forked_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past PARALLEL_MIN requests the two replays run side by side; the
    figures are the same as one after the other."""
    from proxy.replay import main as replay_main

    cand = parse_policy(NO_RESCUE, env={})
    one_by_one = run_replay(cand, scenario="engine-death").report
    monkeypatch.setattr(replay_main, "PARALLEL_MIN", 10)
    side_by_side = run_replay(cand, scenario="engine-death").report
    for key in ("baseline", "candidate"):
        assert side_by_side[key] == one_by_one[key]


def test_a_long_trace_file_forks_its_candidate_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace file past PARALLEL_MIN requests by its size (40 bytes a
    request) has its candidate's process forked before it is read: the
    fork after the reading (`_both`) is not taken, and the figures are the
    one-process replay's."""
    from proxy.replay import main as replay_main

    path = Path(__file__).parents[1] / "fixtures" / "recordings" / "recording-drill-1.jsonl.gz"
    assert replay_main._estimate(str(path)) == path.stat().st_size / 40
    cand = parse_policy(NO_RESCUE, env={})
    one_by_one = run_replay(cand, trace_path=str(path)).report
    monkeypatch.setattr(replay_main, "PARALLEL_MIN", 10)

    def not_this_way(*args: object, **kw: object) -> None:
        raise AssertionError("forked after the reading")

    monkeypatch.setattr(replay_main, "_both", not_this_way)
    early = run_replay(cand, trace_path=str(path)).report
    for key in ("baseline", "candidate", "recorded", "fidelity", "model"):
        assert early[key] == one_by_one[key]


def test_a_long_trace_fits_its_model_and_rebuilds_its_waits_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two processes of a long trace file: the backend model fitted in
    the candidate's, the recorded waits rebuilt in the parent's, each sent
    to the other (not made twice); the figures are the one-process
    replay's."""
    import os

    from proxy.replay import main as replay_main
    from proxy.replay import world as world_mod
    from proxy.replay.observed import ObservedWaits

    path = Path(__file__).parents[1] / "fixtures" / "recordings" / "recording-drill-6.jsonl.gz"
    cand = parse_policy(NO_RESCUE, env={})
    one_by_one = run_replay(cand, trace_path=str(path)).report
    log = tmp_path / "made"  # (each process appends: what it made, its pid)
    fit, rebuild = world_mod.build_world, ObservedWaits._rebuild

    def fit_spy(*args: object, **kw: object) -> object:
        with log.open("a") as f:
            f.write(f"fit {os.getpid()}\n")
        return fit(*args, **kw)  # type: ignore[arg-type]

    def rebuild_spy(self: ObservedWaits, trace: Trace) -> object:
        with log.open("a") as f:
            f.write(f"waits {os.getpid()}\n")
        return rebuild(self, trace)

    monkeypatch.setattr(replay_main, "build_world", fit_spy)
    monkeypatch.setattr(ObservedWaits, "_rebuild", rebuild_spy)
    monkeypatch.setattr(replay_main, "PARALLEL_MIN", 10)
    early = run_replay(cand, trace_path=str(path)).report
    made = sorted(log.read_text().split("\n")[:-1])
    assert [m.split()[0] for m in made] == ["fit", "waits"]
    assert made[0].split()[1] != str(os.getpid()) and made[1].split()[1] == str(os.getpid())
    for key in ("baseline", "candidate", "recorded", "fidelity", "model", "notes"):
        assert early[key] == one_by_one[key]
    # What went over the pipe is the world made here.
    tr = Trace.load(path)
    world = build_world(tr)
    back = world_mod.unpack_world(world_mod.pack_world(world, tr), tr)
    import re

    def shown(w: object) -> str:  # (the curves' reprs: their addresses)
        return re.sub(r" at 0x[0-9a-f]+", "", repr(w))

    assert shown(back) == shown(world) and back.notes == world.notes
    for name, bw in world.backends.items():
        got = back.backends[name]
        assert got._recorded == bw._recorded and got._res_ttft == bw._res_ttft
        assert got._n_starts == bw._n_starts and got._starts == bw._starts
        assert got.ttft.values == bw.ttft.values and got.tpot.slope == bw.tpot.slope
