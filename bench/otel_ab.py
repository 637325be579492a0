"""What tracing costs the hot path (issue 23): Brownout with no `telemetry:`
("off") against the same policy exporting traces to a collector, every
request sampled ("on") and one in ten ("on 10 %"), and to a collector that
takes connections and never answers ("blackhole", every request sampled).

All run `bench/run.py`'s policy on the same upstream (nginx, static SSE). The
collector is that nginx too (`POST /v1/traces` answered 200 from a file), so
its cost is outside the proxy's process; the blackhole is a listening socket
no one accepts from. Rounds are interleaved (the order reversed every other
round), wrk at one concurrency, so drifting machine load hits all variants
alike; the figure is the median of the per-round ratios to "off", with their
range. CPU seconds per 1,000 requests of the proxy process (every thread:
the export thread's encoding is the proxy's cost too) is the steadier
figure on a shared machine. Then instructions per request under valgrind's
callgrind (`bench/instr.py`'s method), which do not move with the machine's
other work.

    .venv/bin/python bench/otel_ab.py [--rounds 6] [--duration 3] [--conc 16]
        [--requests 1000] [--no-instr]

Writes bench/results/otel-cost.md. Budget: tracing configured costs the hot
path at most 5 % (throughput ratio ≥ 95 %), an unreachable collector too.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from instr import callgrind, measure
from run import Path_, Sample, brownout_policy, run_wrk, serve_cmd, stop

VARIANTS = ("off", "on", "on10", "blackhole")
LABEL = {
    "off": "tracing off (no `telemetry:`)",
    "on": "tracing on, every request sampled",
    "on10": "tracing on, `sample_ratio: 0.1` (the default)",
    "blackhole": "tracing on, collector never answers",
}
BUDGET = 0.05


def variant_policy(tmp: Path, upstream: str, up_port: int, hole: int, v: str, tag: str) -> Path:
    pol = brownout_policy(tmp, upstream, f"{tag}-{v}", sessions=False)
    if v == "off":
        return pol
    endpoint = f"http://127.0.0.1:{hole if v == 'blackhole' else up_port}/v1/traces"
    ratio = {"on10": 0.1, "on0": 0.0}.get(v, 1.0)
    pol.write_text(
        pol.read_text()
        + f"telemetry:\n  otlp_endpoint: {endpoint}\n  sample_ratio: {ratio}\n"
        + "  export_timeout_s: 2\n"
    )
    return pol


def throughput(
    tmp: Path, up_port: int, hole: int, rounds: int, duration: float, conc: int
) -> dict[str, list[Sample]]:
    upstream = f"http://127.0.0.1:{up_port}/short"
    procs: list[subprocess.Popen[bytes]] = []
    samples: dict[str, list[Sample]] = {v: [] for v in VARIANTS}
    try:
        paths: dict[str, Path_] = {}
        ports = {}
        for v in VARIANTS:
            port = ports[v] = free_port()
            pol = variant_policy(tmp, upstream, up_port, hole, v, "wrk")
            p = subprocess.Popen(serve_cmd(pol, port), stderr=subprocess.DEVNULL, cwd=ROOT)
            procs.append(p)
            paths[v] = Path_(v, f"http://127.0.0.1:{port}/v1/chat/completions", p.pid)
        for port in ports.values():
            wait_port(port, 120)
        time.sleep(1)
        for path in paths.values():
            run_wrk(path, conc, 1.0)  # warm-up (and the blackhole's queue fills)
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                s = run_wrk(paths[v], conc, duration)
                samples[v].append(s)
                print(
                    f"round {r:2} {v:9} {s.rps:8.0f} req/s p50 {s.p50_ms:6.2f} ms "
                    f"p99 {s.p99_ms:6.2f} ms cpu/1k {s.cpu_per_1k or 0:6.3f} s errors {s.errors}",
                    flush=True,
                )
    finally:
        stop(procs)
    return samples


def instructions(
    tmp: Path, up_port: int, hole: int, n: int, conc: int, which: Sequence[str] = ()
) -> dict[str, float]:
    upstream = f"http://127.0.0.1:{up_port}/short"
    out: dict[str, float] = {}
    for v in which or VARIANTS:
        port = free_port()
        pol = variant_policy(tmp, upstream, up_port, hole, v, "cg")
        dump = tmp / f"cg-{v}"
        p = callgrind(dump, serve_cmd(pol, port), ROOT, dict(os.environ))
        try:
            out[v] = measure(p, port, dump, n, conc)
        finally:
            stop([p])
        print(f"{v:9}: {out[v]:,.0f} instructions / request", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--no-instr", action="store_true")
    ap.add_argument(
        "--instr-only",
        nargs="*",
        choices=(*VARIANTS, "on0"),
        help="only instructions / request of these variants (all when none named), "
        "printed, no report; `on0`: sample_ratio 0 (the unsampled path alone)",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-otel-"))
    up_port = free_port()
    upstream = start_static_upstream(tmp, up_port)
    # The collector: nginx answers POST /v1/traces with this (empty) file, 200.
    (tmp / "www" / "v1").mkdir(parents=True, exist_ok=True)
    (tmp / "www" / "v1" / "traces").write_bytes(b"")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(4096)
    hole_port = hole.getsockname()[1]
    if args.instr_only is not None:
        try:
            wait_port(up_port)
            instructions(tmp, up_port, hole_port, args.requests, args.conc, args.instr_only)
        finally:
            stop([upstream])
            hole.close()
        return 0
    try:
        wait_port(up_port)
        samples = throughput(tmp, up_port, hole_port, args.rounds, args.duration, args.conc)
        instr = (
            {} if args.no_instr else instructions(tmp, up_port, hole_port, args.requests, args.conc)
        )
    finally:
        stop([upstream])
        hole.close()
    lines = [
        "# What tracing costs the hot path",
        "",
        f"`bench/otel_ab.py`: 16-chunk streams, wrk at concurrency {args.conc}, "
        f"{args.rounds} interleaved rounds of {args.duration:g} s; the collector is nginx "
        "(outside the proxy's process), the blackhole a socket that never answers. "
        f"Budget: at most {BUDGET:.0%} of the hot path.",
        "",
        "| variant | req/s (median) | ratio to off (median, range) | CPU s / 1k req "
        "| CPU vs off | instructions / req | vs off |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    off = samples["off"]
    for v in VARIANTS:
        s = samples[v]
        ratios = [a.rps / b.rps for a, b in zip(s, off, strict=True)]
        cpu = statistics.median(x.cpu_per_1k or 0 for x in s)
        cpu_off = statistics.median(x.cpu_per_1k or 0 for x in off)
        ir = instr.get(v)
        ir_txt = f"{ir:,.0f}" if ir else "—"
        ir_vs = f"{ir / instr['off'] - 1:+.1%}" if ir and instr.get("off") else "—"
        lines.append(
            f"| {LABEL[v]} | {statistics.median(x.rps for x in s):,.0f} "
            f"| {statistics.median(ratios):.1%} ({min(ratios):.1%}–{max(ratios):.1%}) "
            f"| {cpu:.3f} | {cpu / cpu_off - 1:+.1%} | {ir_txt} | {ir_vs} |"
        )
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if args.no_instr:
        # Wall-clock only: printed, not written over the report and its
        # instruction tables (the figures that decide on a shared machine).
        print("(--no-instr: bench/results/otel-cost.md left as it is)")
        return 0
    out = ROOT / "bench" / "results" / "otel-cost.md"
    out.write_text(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
