"""Instructions per request of the gray release's own per-request work, in
process, under valgrind's callgrind (steady: no sockets, no timers, no load).

What `proxy/pipeline/flow.py` and `finish.py` do per request while a
rollout steps at 50 %, sticky on a header that is new on every request (as
`bench/rollout_ab.py` sends it): the routing (`Rollout.routing`,
`Canary.wants_candidate`: the cut, the sticky key, its bucket hash) and the
finish (`Canary.finished`: the gates' sample). The gates first hold
`--held` samples per arm and series (10,000: the cap, which more than ~33
requests/s per arm reach over the default 300 s window; 0: an empty
window). Only the requests' loop is counted (callgrind collects inside
`functools.reduce`, which runs it).

    .venv/bin/python bench/rollout_path.py [TREE ...] [--requests 2000] [--held 0,10000]

Each TREE (a checkout, default this one) is imported in a process of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(requests: int, held: int) -> None:
    """The measured process: a Canary stepping at 50 %, `requests` requests."""
    import functools
    import random
    from types import SimpleNamespace

    import yaml
    from multidict import CIMultiDict, CIMultiDictProxy

    from proxy.control.rollout import RUNNING
    from proxy.pipeline.record import Terminal
    from proxy.policy import parse_policy
    from proxy.runtime.canary import Canary
    from proxy.telemetry.metrics import Metrics

    doc = {
        "backends": {
            "primary": {"url": "http://127.0.0.1:1"},
            "candidate": {"url": "http://127.0.0.1:2"},
        },
        "rollout": {
            "steps": [0.5, 1.0],
            "sticky": "header:X-Bench-User",
            "snapshot_dir": tempfile.mkdtemp(prefix="rollout-path-"),
            "gates": {"ttft_ratio_max": 1000, "p99_ratio_max": 1000},
        },
    }
    pol = parse_policy(yaml.safe_dump(doc), "rollout-path.yaml")
    now = [0.0]
    canary = Canary(pol, lambda: now[0], Metrics(), lambda coro, name: coro.close())
    canary.act("start")
    rnd = random.Random(21)
    for i in range(2 * held):
        now[0] += 0.001
        canary.gates.observe(
            "candidate" if i % 2 else "primary",
            now[0],
            latency_s=rnd.lognormvariate(-3, 0.5),
            ttft_s=rnd.lognormvariate(-5, 0.5),
        )
    base = {"Host": "127.0.0.1", "Content-Type": "application/json", "User-Agent": "wrk"}
    recs = []
    for i in range(requests):
        h = CIMultiDict(base)
        h["X-Bench-User"] = f"user-{i}"
        recs.append(
            SimpleNamespace(
                request=SimpleNamespace(headers=CIMultiDictProxy(h)),
                priority="normal",
                rid=f"r{i}",
                stream=True,
                candidate_fault="",
            )
        )
    latency = [rnd.lognormvariate(-3, 0.5) for _ in range(requests)]
    terms = {
        arm: [Terminal(arm, 200, "ok", client_ttft=x / 4) for x in latency]
        for arm in ("primary", "candidate")
    }

    def run(_a: object, _b: object) -> None:
        for i, rec in enumerate(recs):
            now[0] += 0.001
            arm = "primary"
            if canary.rollout.routing and canary.wants_candidate(rec):  # type: ignore[arg-type]
                arm = "candidate"
            if canary.rollout.state in RUNNING:
                canary.finished(rec, terms[arm][i], latency[i])  # type: ignore[arg-type]

    functools.reduce(run, [0], None)


def measure(tree: Path, requests: int, held: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=functools_reduce",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                str(requests),
                str(held),
            ],
            env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
            cwd=tree,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        m = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(errors="replace"), re.M)
        assert m, out
        return int(m.group(1)) / requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", type=Path)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--held", default="0,10000", help="samples per arm held before")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    trees = [t.resolve() for t in args.trees] or [ROOT]
    print("| tree | samples held per arm | instructions / request |")
    print("| --- | --- | --- |")
    for held in (int(h) for h in args.held.split(",")):
        for tree in trees:
            print(f"| {tree} | {held:,} | {measure(tree, args.requests, held):,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
