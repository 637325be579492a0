"""`brownout replay`'s instructions per request, phase by phase (callgrind).

    .venv/bin/python bench/replay_instr.py [--hours 0.1] [--tree DIR ...] [--keep DIR]

Writes `bench/replay_speed.py`'s synthetic recording (`--hours` at 50
requests/s, seed 0: the same file every time), then runs each phase under
valgrind's callgrind in a fresh interpreter of each `--tree` (default: this
one): `base` (the imports), `load` (+ reading and parsing the trace, the
collector frozen after it as the command line does), `fit` (+ the backend
model, `build_world`), `replay` (+ one replay under the recorded policy),
`report` (+ what `run_replay` makes of two runs: their figures, the
baseline's fidelity and the recording's own figures). A
phase's count less the one before it, divided by the requests, is what the
phase costs per request. Counts of executed instructions do not move with
the other work on a shared machine (wall-clock does): run it under
`flock /tmp/brownout-heavy.lock`.

`--both`: instead of the phases, `run_replay` as a long trace runs it
(its candidate in a forked process, the reading and the fit shared
between the two): each process's instructions per request, the base
(the imports and the policy) subtracted.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("base", "load", "fit", "replay", "report")


def phase(name: str, trace: str) -> None:
    """Run the phases up to `name` (in the child, under callgrind), then
    end the process at once: the teardown (freeing the trace) is in no phase."""
    import gc

    from proxy.replay import report as rep
    from proxy.replay.sim import replay
    from proxy.replay.trace import Trace, policy_from_knobs
    from proxy.replay.world import build_world

    if name == "base":
        gc.freeze()  # as `load` does: the imports are not walked again
        os._exit(0)
    tr = Trace.load(Path(trace), freeze=True)
    if name == "load":
        os._exit(0)
    knobs = tr.recorded_policy
    assert knobs is not None
    pol = policy_from_knobs(knobs)
    world = build_world(tr, idle_s=pol.backends.primary.timeouts.idle_s)
    if name == "fit":
        os._exit(0)
    run = replay(pol, tr, world, 0)
    assert run.requests == len(tr.requests)
    if name == "replay":
        os._exit(0)
    # What both processes make of their runs (`run_replay`): each run's
    # figures, the recording's own, the baseline's fidelity (given the
    # first two where the tree's `fidelity` takes them).
    base = rep.summary(run)
    rep.summary(run)
    recorded = rep.observed(tr)
    if "rec" in inspect.signature(rep.fidelity).parameters:
        rep.fidelity(tr, run, recorded, base)
    else:
        rep.fidelity(tr, run)
    os._exit(0)


def both(trace: str) -> None:
    """`run_replay` on `trace` with its two processes (the forked path
    forced, as past PARALLEL_MIN requests): baseline here, candidate in a
    forked process, sharing the reading and the fit (`--both`)."""
    sys.path.insert(0, str(Path.cwd() / "bench"))
    from replay_speed import CANDIDATE

    from proxy.policy import parse_policy
    from proxy.replay import main as replay_main

    cand = parse_policy(CANDIDATE, env={})
    if trace == "-":  # (the base: imports and the policy)
        os._exit(0)
    replay_main.PARALLEL_MIN = 10
    replay_main.run_replay(cand, trace_path=trace, freeze=True)
    os._exit(0)


def count_both(tree: Path, trace: Path, tmp: Path) -> list[int]:
    """Instructions of the base, then of each process of `--both` (the
    parent first; a forked process's count includes what its parent ran
    before the fork: the base)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out: list[int] = []
    for arg in ("-", str(trace)):
        for f in tmp.glob("both.*"):
            f.unlink()
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/both.%p",
                sys.executable,
                str(Path(__file__).resolve()),
                "--both-child",
                arg,
            ],
            check=True,
            cwd=tree,
            env=env,
            capture_output=True,
        )
        files = sorted(tmp.glob("both.*"), key=lambda f: int(f.name.split(".")[1]))
        for f in files:
            m = re.search(rb"^summary:\s*(\d+)", f.read_bytes(), re.M)
            assert m is not None, f
            out.append(int(m.group(1)))
    return out


def count(tree: Path, name: str, trace: Path, out: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--phase",
            name,
            "--trace",
            str(trace),
        ],
        check=True,
        cwd=tree,
        env=env,
        capture_output=True,
    )
    m = re.search(rb"^summary:\s*(\d+)", out.read_bytes(), re.M)
    assert m is not None, out
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours", type=float, default=0.1)
    ap.add_argument("--tree", type=Path, action="append", default=None)
    ap.add_argument("--keep", type=Path, default=None, help="copy the callgrind dumps here")
    ap.add_argument(
        "--upto", choices=PHASES[1:], default="report", help="the last phase to measure"
    )
    ap.add_argument(
        "--both",
        action="store_true",
        help="instead: both processes of run_replay (the forked path), per process",
    )
    ap.add_argument("--both-child", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        phase(args.phase, args.trace)
        return 0
    if args.both_child:
        both(args.both_child)
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from replay_speed import write_trace

    tmp = Path(tempfile.mkdtemp(prefix="brownout-replay-instr-"))
    trace = tmp / "trace.jsonl.gz"
    n = write_trace(trace, args.hours, 50.0)
    for tree in args.tree or [ROOT]:
        tree = tree.resolve()
        if args.both:
            base, *procs = count_both(tree, trace, tmp)
            print(
                f"{tree}: {n:,} requests, both processes; instructions per request "
                "(the base subtracted): "
                + ", ".join(
                    f"{who} {(c - base) / n / 1000:.1f} k"
                    for who, c in zip(("parent", "candidate's"), procs, strict=False)
                )
                + f" (base {base / 1e6:.0f} M)"
            )
            continue
        phases = PHASES[: PHASES.index(args.upto) + 1]
        counts = {}
        for name in phases:
            out = tmp / f"callgrind.{tree.name}.{name}"
            counts[name] = count(tree, name, trace, out)
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(out, args.keep / out.name)
        per = {name: (counts[name] - counts[prev]) / n for prev, name in itertools.pairwise(phases)}
        print(
            f"{tree}: {n:,} requests; instructions per request: "
            + ", ".join(f"{k} {v / 1000:.1f} k" for k, v in per.items())
            + f"; total {sum(per.values()) / 1000:.1f} k (imports {counts['base'] / 1e6:.0f} M)"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
