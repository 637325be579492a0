"""A/B of Brownout builds against the bare relay, in one run, interleaved.

    .venv/bin/python bench/ab.py TREE [TREE ...] [--rounds 4] [--duration 4]
            [--conc 64] [--kind short] [--extra-path DIR] [--sessions]

Each TREE is a checkout of this repository (e.g. a `git worktree` of an older
commit); its `proxy.cli serve` runs from that checkout, on the same upstream
(nginx, static SSE) as `bench/run.py`, with `bench/run.py`'s policy. Every
round runs wrk on the bare relay and then on each tree, in turn, so machine
noise hits them alike. Per path: requests/s and CPU seconds per 1,000
requests of the proxy process (the steadier figure on a shared machine), and
each tree's share of the bare relay's requests/s in the same round.
`--sessions`: Redis sessions on (a private `redis-server`), a fresh
`X-Session-Id` per request (`bench/post.lua`'s BENCH_SESSIONS=1), as
`bench/run.py`'s Redis variant; the bare relay has none.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from instr import start_redis
from run import Path_, Sample, brownout_policy, run_wrk, serve_cmd, stop


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--kind", default="short", choices=("short", "long"))
    ap.add_argument(
        "--extra-path", default="", help="appended to each tree's PYTHONPATH (an old tree's deps)"
    )
    ap.add_argument(
        "--sessions",
        action="store_true",
        help="Redis sessions on (a private redis-server), a fresh X-Session-Id per request",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-ab-"))
    procs: list[subprocess.Popen[bytes]] = []
    up_port = free_port()
    procs.append(start_static_upstream(tmp, up_port))
    wait_port(up_port)
    upstream = f"http://127.0.0.1:{up_port}/{args.kind}"
    redis_url = "redis://127.0.0.1:6379/0"
    env: dict[str, str] = {}
    if args.sessions:
        redis_port = free_port()
        procs.append(start_redis(tmp, redis_port))
        wait_port(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        env = {"BENCH_SESSIONS": "1"}  # bench/post.lua: a fresh session per request
    samples: dict[str, list[Sample]] = {}
    try:
        bare = free_port()
        p = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "bare_relay.py"), upstream, str(bare)]
        )
        procs.append(p)
        paths = [Path_("bare aiohttp", f"http://127.0.0.1:{bare}/v1/chat/completions", p.pid)]
        for i, tree in enumerate(args.trees):
            tree = tree.resolve()
            port = free_port()
            pol = brownout_policy(
                tmp, upstream, f"ab{i}", sessions=args.sessions, redis_url=redis_url
            )
            p = subprocess.Popen(
                serve_cmd(pol, port),
                stderr=subprocess.DEVNULL,
                cwd=tree,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), args.extra_path])),
                },
            )
            procs.append(p)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            paths.append(Path_(f"{i}:{tree.name}", url, p.pid, env))
        for path in paths:
            wait_port(int(path.url.split(":")[2].split("/")[0]), 120)
        time.sleep(1)
        for path in paths:
            run_wrk(path, 4, 1)  # warm-up
        for r in range(args.rounds):
            # Alternate the order each round: no path always runs right after the bare relay.
            order = paths if r % 2 == 0 else [paths[0], *reversed(paths[1:])]
            for path in order:
                s = run_wrk(path, args.conc, args.duration)
                samples.setdefault(path.name, []).append(s)
                print(
                    f"round {r} {path.name:24} {s.rps:8.0f} req/s "
                    f"cpu/1k {s.cpu_per_1k or 0:6.3f} s errors {s.errors}",
                    flush=True,
                )
    finally:
        stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    bare_rps = [s.rps for s in samples[paths[0].name]]
    sess = ", Redis sessions" if args.sessions else ""
    print(f"\n{args.kind} streams{sess}, c={args.conc}, {args.rounds} rounds x {args.duration:g} s")
    print(
        "| path | req/s (median) | share of bare (per round) | CPU s / 1k req (median, min–max) |"
    )
    print("| --- | --- | --- | --- |")
    for path in paths:
        ss = samples[path.name]
        cpus = [s.cpu_per_1k or 0.0 for s in ss]
        shares = " ".join(f"{s.rps / b:.0%}" for s, b in zip(ss, bare_rps, strict=True))
        print(
            f"| {path.name} | {statistics.median(s.rps for s in ss):,.0f} | {shares} | "
            f"{statistics.median(cpus):.3f} ({min(cpus):.3f}–{max(cpus):.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
