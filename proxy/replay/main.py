"""`brownout replay`: load, run baseline and candidate, report.

    brownout replay --trace PATH | --scenario NAME  --policy CANDIDATE.yaml
        [--baseline OTHER.yaml] [--json] [--html report.html]
        [--fail-on client_errors,maintenance_answers,shed,ttft_p95] [--seed N]

Exit codes: 0 done (the candidate is not worse on the `--fail-on` figures),
1 worse on at least one of them, 2 bad options, an unreadable trace or an
invalid policy.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import sys
import time
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.policy import Policy, PolicyError, load_policy
from proxy.replay import report as rep
from proxy.replay.names import FAIL_ON, SCENARIOS
from proxy.replay.observed import ObservedWaits, pack_waits, unpack_waits
from proxy.replay.scenarios import scenario_policy, scenario_trace
from proxy.replay.sim import Run, replay
from proxy.replay.trace import Peer, Trace, policy_from_knobs, with_backends
from proxy.replay.world import World, build_world, pack_world, unpack_world
from proxy.telemetry.recorder import fingerprint
from proxy.telemetry.recording import segments


class ReplayError(Exception):
    """Bad input: printed, exit 2."""


@dataclass
class Outcome:
    report: dict[str, Any]
    baseline: Run
    candidate: Run
    trace: Trace
    world: World
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (a forked replay)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def load_candidate(path: str) -> Policy:
    try:
        return load_policy(path, env={})
    except PolicyError as exc:
        raise ReplayError("\n".join(exc.lines())) from exc
    except OSError as exc:
        raise ReplayError(f"{path}: {exc.strerror or exc}") from exc


def run_replay(
    candidate: Policy,
    *,
    trace_path: str | None = None,
    scenario: str | None = None,
    baseline: Policy | None = None,
    fail_on: tuple[str, ...] = (),
    seed: int = 0,
    freeze: bool = False,
) -> Outcome:
    """Both replays and the report (`freeze`: see `Trace.load`)."""
    started, wall = _cpu(), time.monotonic()
    early = None
    if trace_path is not None and _estimate(trace_path) >= PARALLEL_MIN and _FORK:
        # A long trace: the candidate's process is forked before the trace
        # is read and reads it on its own (see `_early_job`).
        early = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("fork"))
    try:
        return _run(
            candidate, trace_path, scenario, baseline, fail_on, seed, freeze, early, started, wall
        )
    finally:
        if early is not None:
            early.shutdown(cancel_futures=True)


def _run(
    candidate: Policy,
    trace_path: str | None,
    scenario: str | None,
    baseline: Policy | None,
    fail_on: tuple[str, ...],
    seed: int,
    freeze: bool,
    early: ProcessPoolExecutor | None,
    started: float,
    wall: float,
) -> Outcome:
    future = None
    peer: Peer | None = None
    fit: Peer | None = None
    if early is not None:
        assert trace_path is not None
        # (to the candidate's process, from it: the reading's, the fit's)
        down, up, down2, up2 = os.pipe(), os.pipe(), os.pipe(), os.pipe()
        peer, fit = Peer(0, up[0], down[1]), Peer(0, up2[0], down2[1])
        theirs = (down[0], up[1], down2[0], up2[1])
        try:
            ours = peer.fds + fit.fds
            future = early.submit(
                _early_job, candidate, trace_path, baseline, seed, freeze, theirs, ours
            )
        except BaseException:
            peer.close()
            fit.close()
            raise
        finally:
            for fd in theirs:  # (the forked process's ends: its own now)
                os.close(fd)
    notes: list[str] = []
    try:
        try:
            if scenario is not None:
                trace = scenario_trace(scenario, seed)
                recorded: Policy | None = None
            else:
                assert trace_path is not None
                trace = _load(trace_path, freeze, peer)
        finally:
            if peer is not None:
                peer.close()
        baseline, candidate, recorded, is_recorded = _policies(
            trace, trace_path, candidate, baseline
        )
        pb = baseline.backends.primary
        world: World | None = None
        figures: dict[str, Any] | None = None
        if fit is not None:
            # Each a function of the trace, made once: the recorded waits'
            # rebuild and the recording's own figures here, the backend
            # model in the candidate's process (the longer: this side waits
            # for it); the rebuild and the model exchanged.
            ObservedWaits(trace, None)
            figures = rep.observed(trace) if not trace.synthetic else None
            got = fit.exchange(pack_waits(trace))
            if got is not None:
                world = unpack_world(got, trace, freeze=freeze)
    finally:
        if fit is not None:
            fit.close()
    if trace_path is not None and recorded is None:
        notes.append("the trace carries no policy record: no fidelity can be measured")
    if len(trace.policies) > 1:
        notes.append(
            f"the policy was reloaded {len(trace.policies) - 1} time(s) during the "
            "trace: a replay of the recorded policy takes those that change only the "
            "backends' settings; a ladder's change is not replayed"
        )
    if future is not None:
        if world is None:  # (the other process failed: made here)
            world = build_world(trace, idle_s=pb.timeouts.idle_s, freeze=freeze)
        base_run = replay(baseline, trace, world, seed)
        side = _unpack(future.result())
        side.recorded = figures
        assert early is not None
        early.shutdown()  # (its process reaped: its CPU time counted)
    else:
        world, base_run, side = _both(
            baseline, candidate, trace, pb.timeouts.idle_s, seed, recorded=not trace.synthetic
        )
    notes += world.notes
    cand_run = side.run
    b, c = rep.summary(base_run), side.summary
    keys = FAIL_ON
    report: dict[str, Any] = {
        "trace": {
            "source": trace.source or f"scenario {scenario}",
            "synthetic": trace.synthetic,
            "start": round(trace.start, 3),
            "duration_s": round(trace.end, 2),
            "requests": len(trace.requests),
            "policy_hash": trace.policy_hash,
            "dropped_records": trace.gaps,
        },
        "fidelity": rep.fidelity(trace, base_run, side.recorded, b) if is_recorded else None,
        "baseline": b,
        "candidate": c,
        "recorded": side.recorded,
        "worse_on": rep.worse_on(b, c, keys),
        "better_on": rep.better_on(b, c, keys),
        "fail_on": list(fail_on),
        "failed": rep.worse_on(b, c, fail_on),
        "model": {
            name: {
                "capacity": round(bw.capacity, 2),
                "answers_fitted": bw.observed,
                "ttft_s_at_1": round(bw.ttft(1), 4),
                "queue_slope_s": round(bw.ttft.slope, 4),
                "segments": len(bw.segments) - 1,
            }
            for name, bw in world.backends.items()
        },
        "notes": notes,
    }
    out = Outcome(report, base_run, cand_run, trace, world, notes=notes)
    out.seconds = _cpu() - started
    report["replay_cpu_s"] = round(out.seconds, 3)
    report["replay_wall_s"] = round(time.monotonic() - wall, 3)
    return out


def _load(trace_path: str, freeze: bool, peer: Peer | None = None) -> Trace:
    try:
        return Trace.load(Path(trace_path), freeze=freeze, peer=peer)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{trace_path}: cannot read the trace: {exc}") from exc


def _policies(
    trace: Trace, trace_path: str | None, candidate: Policy, baseline: Policy | None
) -> tuple[Policy, Policy, Policy | None, bool]:
    """The baseline and the candidate as replayed (the recorded backends
    where a policy has none), the recorded policy, whether the baseline is
    the recorded one."""
    recorded: Policy | None = None
    if trace_path is not None:
        knobs = trace.recorded_policy
        recorded = policy_from_knobs(knobs, f"{trace_path} (recorded policy)") if knobs else None
    is_recorded = False
    if baseline is None:
        if recorded is not None:
            baseline, is_recorded = recorded, True
        else:
            baseline = scenario_policy()
    elif recorded is not None and trace.policy_hash == fingerprint(baseline)[0]:
        is_recorded = True
    like = recorded or baseline
    return with_backends(baseline, like), with_backends(candidate, like), recorded, is_recorded


# Past this many requests the two replays run side by side: the candidate's
# in a forked process, which inherits the parsed trace without copying it,
# fits its own backend model (the same: it is a function of the trace) and
# sends back its run (its long series as bytes) and its figures.
PARALLEL_MIN = 200_000
_FORK = "fork" in mp.get_all_start_methods()
# A request takes about this many bytes of a gzipped recording or more
# (the bench's synthetic one: 44; uncompressed, ~300): a trace of
# PARALLEL_MIN times this many bytes is taken as long before it is read
# (a wrong guess costs a process, never a result).
BYTES_PER_REQUEST = 40


def _estimate(trace_path: str) -> float:
    """The requests a trace holds at most, guessed from its size."""
    path = Path(trace_path)
    try:
        files = segments(path) if path.is_dir() else [path]
        return sum(f.stat().st_size for f in files) / BYTES_PER_REQUEST
    except OSError:
        return 0.0


_JOB: tuple[Policy, Trace, float, int, bool] | None = None


@dataclass
class _Side:
    """The candidate's replay, its figures and the recording's own."""

    run: Run
    summary: dict[str, Any]
    recorded: dict[str, Any] | None


def _candidate(policy: Policy, trace: Trace, world: World, seed: int, recorded: bool) -> _Side:
    run = replay(policy, trace, world, seed)
    return _Side(run, rep.summary(run), rep.observed(trace) if recorded else None)


_Packed = tuple[_Side, bytes, bytes, dict[str, bytes]]


def _candidate_job() -> _Packed:
    assert _JOB is not None
    policy, trace, idle_s, seed, recorded = _JOB
    return _pack(_candidate(policy, trace, build_world(trace, idle_s=idle_s), seed, recorded))


def _early_job(
    candidate: Policy,
    trace_path: str,
    baseline: Policy | None,
    seed: int,
    freeze: bool,
    fds: tuple[int, int, int, int],
    parents: tuple[int, int, int, int],
) -> _Packed:
    """The candidate's side in a process forked before the trace is read:
    it reads the trace together with the parent (each half of it, `Peer`:
    `fds` its pipes' ends, the reading's then the fit's; `parents` the
    parent's, closed here), fits the backend model, sends it to the parent
    for the rebuild of the recorded waits (`ObservedWaits`: each made once,
    each a function of the trace) and replays on its own core. The
    recording's own figures are the parent's. None of the parent's pages
    copied on write."""
    for fd in parents:
        os.close(fd)
    rfd, wfd, rfd2, wfd2 = fds
    fit = Peer(1, rfd2, wfd2)
    try:
        trace = _load(trace_path, freeze, Peer(1, rfd, wfd))
        baseline, candidate, _, _ = _policies(trace, trace_path, candidate, baseline)
        idle_s = baseline.backends.primary.timeouts.idle_s
        world = build_world(trace, idle_s=idle_s, freeze=freeze)
        got = fit.exchange(pack_world(world, trace))
        if got is not None:
            unpack_waits(got, trace)
    finally:
        fit.close()
    # Left to the process's end (which frees nothing): freed on return,
    # millions of objects would cost their time before the answer is sent.
    _KEPT.append((trace, world))
    return _pack(_candidate(candidate, trace, world, seed, False))


_KEPT: list[tuple[Trace, World]] = []  # (in the forked process only)


def _pack(side: _Side) -> _Packed:
    run = side.run
    ttfts, ttft_t, series = run.ttfts, run.ttft_t, run.series
    run.ttfts, run.ttft_t, run.series = [], [], {}
    return (
        side,
        array("d", ttfts).tobytes(),
        array("d", ttft_t).tobytes(),
        {k: array("d", v).tobytes() for k, v in series.items()},
    )


def _floats(data: bytes) -> list[float]:
    a = array("d")
    a.frombytes(data)
    return a.tolist()


def _unpack(packed: _Packed) -> _Side:
    side, ttfts, ttft_t, series = packed
    run = side.run
    run.ttfts, run.ttft_t = _floats(ttfts), _floats(ttft_t)
    run.series = {k: _floats(v) for k, v in series.items()}
    return side


def _both(
    baseline: Policy, candidate: Policy, trace: Trace, idle_s: float, seed: int, recorded: bool
) -> tuple[World, Run, _Side]:
    global _JOB
    if len(trace.requests) < PARALLEL_MIN or not _FORK:
        world = build_world(trace, idle_s=idle_s)
        base = replay(baseline, trace, world, seed)
        return world, base, _candidate(candidate, trace, world, seed, recorded)
    _JOB = (candidate, trace, idle_s, seed, recorded)
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("fork")) as pool:
            future = pool.submit(_candidate_job)
            world = build_world(trace, idle_s=idle_s)
            base = replay(baseline, trace, world, seed)
            return world, base, _unpack(future.result())
    finally:
        _JOB = None


def parse_fail_on(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in keys if k not in FAIL_ON]
    if bad:
        raise ReplayError(f"--fail-on: unknown {', '.join(bad)} (any of {', '.join(FAIL_ON)})")
    return keys


def main(args: Any) -> int:
    try:
        if (args.trace is None) == (args.scenario is None):
            raise ReplayError("give one of --trace PATH or --scenario NAME")
        if args.scenario is not None and args.scenario not in SCENARIOS:
            raise ReplayError(f"--scenario: one of {', '.join(SCENARIOS)}")
        fail_on = parse_fail_on(args.fail_on or "")
        candidate = load_candidate(args.policy)
        baseline = load_candidate(args.baseline) if args.baseline else None
        out = run_replay(
            candidate,
            trace_path=args.trace,
            scenario=args.scenario,
            baseline=baseline,
            fail_on=fail_on,
            seed=args.seed,
            freeze=True,
        )
    except ReplayError as exc:
        print(f"brownout replay: error: {exc}", file=sys.stderr)
        return 2
    if args.html:
        from proxy.replay.html import render

        Path(args.html).write_text(render(out))
    if args.json:
        sys.stdout.write(json.dumps(out.report, indent=2) + "\n")
    else:
        sys.stdout.write(rep.text(out.report))
        if args.html:
            print(f"report: {args.html}")
    failed = out.report["failed"]
    if failed:
        print(f"brownout replay: the candidate is worse on {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


__all__ = ["Outcome", "ReplayError", "main", "run_replay"]
