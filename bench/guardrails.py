"""The guard-rail table (issue 24): every optional feature's cost on the hot
path, on against off, in one run, each against its budget.

One Brownout process per variant, all on `bench/run.py`'s upstream (nginx,
static 16-chunk SSE answers) and policy. "base" has every optional feature
off; every other variant turns exactly one on:

- guard — the output guard (`guard.enabled`);
- sessions — Redis sessions, a fresh session per request (load + save);
- tokens — token telemetry's usage question (`backends.primary.stream_usage`;
  the static upstream sends no usage chunk, so this is the request rewrite,
  the per-chunk usage test and the ITL/TPOT bookkeeping:
  `bench/results/tokens.md` measures the usage chunk itself);
- rollout — a candidate stepping at 50 %, sticky on a header that is fresh on
  every request (the bucket hash, the arm choice and the gates' samples on
  every request; gates out of reach);
- tracing — OpenTelemetry at the default `sample_ratio: 0.1`, exported to
  nginx (outside the proxy's process);
- tracing, collector down — the same, exporting to a socket that never answers;
- recorder — the flight recorder on (its writer thread included).

wrk sends the same headers to every variant (a fresh `X-Session-Id` and
`X-Bench-User` per request). Rounds are interleaved, the order reversed
every other round, so drifting machine load hits all variants alike; the
figures are the medians of the per-round ratios to "base" (req/s) and the
proxy's CPU seconds per 1,000 requests (every thread), the steadier figure
on a shared machine. A feature passes when its CPU per request is within
its budget of base's, over it by more than the run's noise (how far the
`control` process, a second `base`, lands from base) when the excess is
larger than that noise, and inconclusive in between.

    .venv/bin/python bench/guardrails.py [--rounds 6] [--duration 3] [--conc 16] [--quick]

Writes bench/results/guardrails.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from run import Path_, Sample, brownout_policy, run_wrk, serve_cmd, stop

TOKEN = "bench-admin"


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    budget: float | None  # the largest CPU-per-request increase allowed, or None (base)
    why: str  # where the budget comes from


VARIANTS = (
    Variant("base", "base: every optional feature off", None, ""),
    # A second `base` process: what two identical processes differ by in this
    # run — the noise a verdict must clear.
    Variant("control", "control: a second base process (the run's noise)", None, ""),
    Variant("guard", "output guard", 0.10, "issue 8: guard under 10 %"),
    Variant(
        "sessions",
        "Redis sessions (load + save per request)",
        0.25,
        "issue 24: sessions ≥ 45 % and Brownout ≥ 60 % of the bare relay",
    ),
    Variant("tokens", "token telemetry (usage asked)", 0.05, "issue 23: 5 %"),
    Variant("rollout", "rollout stepping at 50 %", 0.03, "issue 21: 3 %"),
    Variant("tracing", "tracing, sample_ratio 0.1", 0.05, "issue 23: 5 %"),
    Variant("blackhole", "tracing, collector never answers", 0.05, "issue 23: 5 %"),
    Variant("recorder", "flight recorder", 0.05, "issue 22: 5 %"),
)


def variant_policy(tmp: Path, up_port: int, hole: int, v: str) -> Path:
    upstream = f"http://127.0.0.1:{up_port}/short"
    usage = "    stream_usage: true\n" if v == "tokens" else "    stream_usage: false\n"
    extra = f"server:\n  admin_token: {TOKEN}\n"
    candidate = None
    if v == "rollout":
        candidate = upstream
        extra += f"""rollout:
  steps: [0.5, 1.0]
  step_s: 86400
  sticky: "header:X-Bench-User"
  auto_start: true
  snapshot_dir: {tmp}/rollouts
  gates: {{ttft_ratio_max: 1000, p99_ratio_max: 1000}}
"""
    elif v in ("tracing", "blackhole"):
        endpoint = f"http://127.0.0.1:{hole if v == 'blackhole' else up_port}/v1/traces"
        extra += (
            f"telemetry:\n  otlp_endpoint: {endpoint}\n  sample_ratio: 0.1\n  export_timeout_s: 2\n"
        )
    elif v == "recorder":
        extra += f"recorder:\n  enabled: true\n  dir: {tmp}/recordings\n"
    return brownout_policy(
        tmp,
        upstream,
        f"guardrail-{v}",
        sessions=v == "sessions",
        guard=v == "guard",
        primary_extra=usage,
        candidate=candidate,
        # The candidate configured as the primary is: the rollout variant
        # measures the routing, not a usage question only its candidate asks.
        candidate_extra=usage,
        extra=extra,
    )


def rollout_stepping(port: int) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/brownout/rollout")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as r:
        state = json.loads(r.read())
    return str(state.get("state"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "guardrails.md"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration = 2, 2.0
    tmp = Path(tempfile.mkdtemp(prefix="brownout-guardrails-"))
    up_port = free_port()
    upstream = start_static_upstream(tmp, up_port)
    # The collector: nginx answers POST /v1/traces with this (empty) file, 200.
    (tmp / "www" / "v1").mkdir(parents=True, exist_ok=True)
    (tmp / "www" / "v1" / "traces").write_bytes(b"")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(4096)
    hole_port = hole.getsockname()[1]
    procs: list[subprocess.Popen[bytes]] = [upstream]
    samples: dict[str, list[Sample]] = {v.key: [] for v in VARIANTS}
    env = {"BENCH_SESSIONS": "1", "BENCH_STICKY": "1"}
    ports: dict[str, int] = {}
    try:
        wait_port(up_port)
        paths: dict[str, Path_] = {}
        for v in VARIANTS:
            port = ports[v.key] = free_port()
            pol = variant_policy(tmp, up_port, hole_port, v.key)
            p = subprocess.Popen(serve_cmd(pol, port), stderr=subprocess.DEVNULL, cwd=ROOT)
            procs.append(p)
            paths[v.key] = Path_(v.key, f"http://127.0.0.1:{port}/v1/chat/completions", p.pid, env)
        for port in ports.values():
            wait_port(port, 120)
        time.sleep(1)
        for path in paths.values():
            run_wrk(path, args.conc, 1.0)  # warm-up
        keys = [v.key for v in VARIANTS]
        for r in range(args.rounds):
            for k in keys if r % 2 == 0 else list(reversed(keys)):
                s = run_wrk(paths[k], args.conc, args.duration)
                samples[k].append(s)
                print(
                    f"round {r:2} {k:9} {s.rps:8.0f} req/s p50 {s.p50_ms:6.2f} ms "
                    f"cpu/1k {s.cpu_per_1k or 0:6.3f} s errors {s.errors}",
                    flush=True,
                )
        stepping = rollout_stepping(ports["rollout"])
    finally:
        stop(procs)
        hole.close()
    report = render(samples, args, stepping)
    print("\n" + report)
    Path(args.out).write_text(report)
    print(f"wrote {args.out}")
    return 0


def verdict_of(extra: float, budget: float, noise: float) -> str:
    """`within` the budget; `**over**` it by more than the run's noise;
    `inconclusive` when the excess is inside that noise."""
    if extra <= budget:
        return "within"
    if extra > budget + noise:
        return "**over**"
    return f"inconclusive (over by {extra - budget:.1%}, noise {noise:.1%})"


def render(samples: dict[str, list[Sample]], args: argparse.Namespace, stepping: str) -> str:
    base = samples["base"]
    cpu_base = statistics.median(x.cpu_per_1k or 0 for x in base)
    ctl = samples.get("control") or []
    noise = (
        abs(statistics.median(x.cpu_per_1k or 0 for x in ctl) / cpu_base - 1)
        if (ctl and cpu_base)
        else 0.0
    )
    lines = [
        "# Guard rails: what each optional feature costs the hot path",
        "",
        f"`bench/guardrails.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"16-chunk streams, wrk at concurrency {args.conc}, {args.rounds} interleaved rounds "
        f"of {args.duration:g} s, one Brownout process per variant, every variant against "
        "`base` (all optional features off) in the same run. A feature passes when the "
        "proxy's CPU per request (every thread) is within its budget of base's; the "
        "req/s ratio is shown beside it (noisier on a shared machine). `control` is a "
        f"second base process: the run's noise, {noise:.1%} here; a feature over its "
        "budget by less than that is inconclusive, not over.",
        "",
        "| feature | req/s (median) | req/s vs base (median, range) | CPU s / 1k req "
        "| CPU vs base | budget | verdict | errors |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for v in VARIANTS:
        s = samples[v.key]
        if not s:
            continue
        ratios = [a.rps / b.rps for a, b in zip(s, base, strict=True)]
        cpu = statistics.median(x.cpu_per_1k or 0 for x in s)
        extra = cpu / cpu_base - 1 if cpu_base else 0.0
        if v.budget is None:
            budget, verdict = "—", "—"
        else:
            budget = f"{v.budget:.0%}"
            verdict = verdict_of(extra, v.budget, noise)
        lines.append(
            f"| {v.label} | {statistics.median(x.rps for x in s):,.0f} "
            f"| {statistics.median(ratios):.1%} ({min(ratios):.1%}–{max(ratios):.1%}) "
            f"| {cpu:.3f} | {extra:+.1%} | {budget} | {verdict} | "
            f"{sum(x.errors for x in s)} |"
        )
    lines += [
        "",
        f"The rollout variant was still `{stepping}` at the end (gates out of reach: "
        "this measures routing, not a rollback on noise).",
        "",
        "Budgets: "
        + "; ".join(f"{v.key} {v.budget:.0%} ({v.why})" for v in VARIANTS if v.budget is not None)
        + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
