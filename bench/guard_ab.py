"""The output guard's cost on relay throughput: Brownout with the guard on
against the same build with it off, alternating short wrk runs many times
(on, off, on, off, …) so drifting machine load hits both alike.

bench/run.py reports the same ratio from its best-of-concurrencies table,
which one noisy point can swing by ±10 %; this is the figure to quote.

    .venv/bin/python bench/guard_ab.py [--rounds 6] [--duration 3] [--conc 16]

Writes bench/results/guard.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from run import Path_, brownout_policy, run_wrk, serve_cmd, stop

CHUNKS = {"short": 16, "long": 1024}
HEADER = (
    "| stream | guard on req/s (median) | guard off req/s (median) "
    "| on / off, median of rounds (range) | CPU s / 1k req on | off | guard share of CPU |\n"
    "| --- | --- | --- | --- | --- | --- | --- |"
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "guard.md"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-guard-ab-"))
    procs: list[subprocess.Popen[bytes]] = []
    up = free_port()
    procs.append(start_static_upstream(tmp, up))
    wait_port(up)
    rows: list[str] = []
    try:
        for kind, chunks in CHUNKS.items():
            paths: dict[str, Path_] = {}
            for name, guard in (("on", True), ("off", False)):
                pol = brownout_policy(
                    tmp, f"http://127.0.0.1:{up}/{kind}", f"{kind}-{name}", False, guard
                )
                port = free_port()
                p = subprocess.Popen(serve_cmd(pol, port), stderr=subprocess.DEVNULL, cwd=ROOT)
                procs.append(p)
                wait_port(port)
                paths[name] = Path_(name, f"http://127.0.0.1:{port}/v1/chat/completions", p.pid)
            for p_ in paths.values():  # warm up
                run_wrk(p_, args.conc, 1.0)
            rps: dict[str, list[float]] = {"on": [], "off": []}
            cpu: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                for name, p_ in paths.items():
                    s = run_wrk(p_, args.conc, args.duration)
                    rps[name].append(s.rps)
                    if s.cpu_per_1k is not None:
                        cpu[name].append(s.cpu_per_1k)
            ratios = [a / b for a, b in zip(rps["on"], rps["off"], strict=True)]
            med = statistics.median(ratios)
            cpu_on = statistics.median(cpu["on"]) if cpu["on"] else float("nan")
            cpu_off = statistics.median(cpu["off"]) if cpu["off"] else float("nan")
            line = (
                f"| {kind} ({chunks} chunks) | {statistics.median(rps['on']):,.0f} | "
                f"{statistics.median(rps['off']):,.0f} | **{med:.0%}** "
                f"({min(ratios):.0%}–{max(ratios):.0%}) | {cpu_on:.3f} | {cpu_off:.3f} | "
                f"{1 - cpu_off / cpu_on:.0%} |"
            )
            print(line, flush=True)
            rows.append(line)
    finally:
        stop(procs)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out).write_text(
        f"""# Output guard cost on relay throughput

{stamp}; 2 shared cores; upstream nginx with static SSE bodies (all chunks in
one read: the guard sees bursts); wrk at concurrency {args.conc}, {args.rounds}
alternating rounds of {args.duration:g} s per side. Target: guard-on costs under
10 % of relay throughput (ratio ≥ 90 %).

{HEADER}
{chr(10).join(rows)}
"""
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
