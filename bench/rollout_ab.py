"""The gray release's cost on the hot path (issue 21): Brownout with no
candidate ("off") against the same policy with `backends.candidate` and a
`rollout:` section, idle ("idle") and stepping at 50 % ("step"), in one run.

All three run `bench/run.py`'s policy on the same upstream (nginx, static SSE;
the candidate is that upstream too, so both arms cost alike and only the
routing differs). "step" starts its rollout at load (`auto_start`) on steps
[0.5, 1.0] held for a day, sticky on a header that wrk sends fresh on every
request (`BENCH_STICKY=1`, sent to all three): the bucket hash, the arm
choice and the gates' sample run on every request, half the requests on each
arm. Its ratio gates are set out of reach (this measures routing, not a
rollback on noise); the run checks at the end that it is still stepping and
reports the share each arm got.

Rounds are interleaved (off, idle, step; then step, idle, off; ...), wrk at
one concurrency, so drifting machine load hits all three alike; the figure is
the median of the per-round ratios, with their range. CPU seconds per 1,000
requests of the proxy process is the steadier figure on a shared machine.
Then instructions per request under valgrind's callgrind (`bench/instr.py`'s
method), which do not move with the machine's other work.

    .venv/bin/python bench/rollout_ab.py [--rounds 12] [--duration 3] [--conc 16]
        [--kinds short,long] [--instr-kinds short,long] [--requests 1000]
        [--tree DIR ...] [--quick]

`--tree` measures instructions of other checkouts too (a `git worktree` of an
older commit: what a change bought). Writes bench/results/rollout-cost.md.
Budget: the rollout's routing costs the hot path at most 3 % (ratio ≥ 97 %).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from instr import callgrind, load
from run import Path_, Sample, brownout_policy, run_wrk, serve_cmd, stop

CHUNKS = {"short": 16, "long": 1024}
VARIANTS = ("off", "idle", "step")
BUDGET = 0.03  # the issue's: at most 3 % of the hot path
TOKEN = "bench-admin"
LABEL = {
    "off": "no candidate",
    "idle": "candidate configured, rollout idle",
    "step": "rollout stepping at 50 %",
}


def rollout_section(tmp: Path, name: str, start: bool) -> str:
    return f"""server:
  admin_token: {TOKEN}
rollout:
  steps: [0.5, 1.0]
  step_s: 86400
  sticky: "header:X-Bench-User"
  auto_start: {"true" if start else "false"}
  snapshot_dir: {tmp}/rollouts-{name}
  gates: {{ttft_ratio_max: 1000, p99_ratio_max: 1000}}
"""


def variant_policy(tmp: Path, upstream: str, name: str, variant: str) -> Path:
    if variant == "off":
        # The same admin token (no per-request cost, but the same policy otherwise).
        return brownout_policy(
            tmp, upstream, name, False, extra=f"server:\n  admin_token: {TOKEN}\n"
        )
    return brownout_policy(
        tmp,
        upstream,
        name,
        False,
        candidate=upstream,
        extra=rollout_section(tmp, name, variant == "step"),
    )


def get(url: str, token: str | None = None) -> bytes:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        data: bytes = r.read()
        return data


def rollout_state(base: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(get(base + "/brownout/rollout", TOKEN))
    return data


def requests_by_backend(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = get(base + "/metrics").decode()
    for m in re.finditer(
        r'^brownout_requests_total\{backend="(\w+)",endpoint="chat",status="200"\} ([\d.e+]+)$',
        text,
        re.M,
    ):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class KindResult:
    kind: str
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    state: str = ""  # the step variant's rollout state at the end
    share: float = float("nan")  # measured share of the step variant's answers on the candidate

    def ratios(self, variant: str) -> list[float]:
        return [
            s.rps / b.rps for s, b in zip(self.samples[variant], self.samples["off"], strict=True)
        ]


def throughput(
    tmp: Path, up_port: int, kind: str, rounds: int, duration: float, conc: int
) -> KindResult:
    upstream = f"http://127.0.0.1:{up_port}/{kind}"
    procs: list[subprocess.Popen[bytes]] = []
    res = KindResult(kind)
    try:
        paths: dict[str, Path_] = {}
        for v in VARIANTS:
            port = free_port()
            pol = variant_policy(tmp, upstream, f"{kind}-{v}", v)
            p = subprocess.Popen(serve_cmd(pol, port), stderr=subprocess.DEVNULL, cwd=ROOT)
            procs.append(p)
            paths[v] = Path_(
                v, f"http://127.0.0.1:{port}/v1/chat/completions", p.pid, {"BENCH_STICKY": "1"}
            )
        for path in paths.values():
            wait_port(int(path.url.split(":")[2].split("/")[0]), 120)
        time.sleep(1)
        for path in paths.values():
            run_wrk(path, conc, 1.0)  # warm-up
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                s = run_wrk(paths[v], conc, duration)
                res.samples.setdefault(v, []).append(s)
                print(
                    f"{kind:5} round {r:2} {v:5} {s.rps:8.0f} req/s p50 {s.p50_ms:6.2f} ms "
                    f"p99 {s.p99_ms:6.2f} ms cpu/1k {s.cpu_per_1k or 0:6.3f} s "
                    f"errors {s.errors}",
                    flush=True,
                )
        base = paths["step"].url.removesuffix("/v1/chat/completions")
        st = rollout_state(base)
        res.state = f"{st.get('state')} at share {st.get('share')}"
        by = requests_by_backend(base)
        total = sum(by.values())
        res.share = by.get("candidate", 0.0) / total if total else float("nan")
        idle = rollout_state(paths["idle"].url.removesuffix("/v1/chat/completions"))
        assert idle.get("state") == "idle", idle
    finally:
        stop(procs)
    return res


def _latest_dump(out: Path) -> int:
    """Total instructions of callgrind's latest dump of `out` (out.1, out.2, ...)."""
    dumps = [Path(f) for f in glob.glob(f"{out}.*") if f.rsplit(".", 1)[1].isdigit()]
    last = max(dumps, key=lambda f: int(f.name.rsplit(".", 1)[1]))
    m = re.search(r"^(?:summary|totals):\s+(\d+)", last.read_text(errors="replace"), re.M)
    assert m, last
    return int(m.group(1))


def _ctl(p: subprocess.Popen[bytes], flag: str) -> None:
    subprocess.run(["callgrind_control", flag, str(p.pid)], check=True, capture_output=True)


@dataclass
class Instr:
    tree: str
    variant: str
    raw: float  # instructions / request, everything the process did during the load
    background: float  # instructions / s with no load (timers: health probes, gates' window)
    per_request: float  # raw less the background over the load's duration
    requests: int


def measure_instr(
    p: subprocess.Popen[bytes], port: int, dump: Path, n: int, conc: int, idle_s: float
) -> tuple[float, float, float]:
    """(raw, background, per_request) as `Instr`. Under callgrind a request takes
    ~50 times longer while timers keep wall-clock time, so the timer-driven
    work (health probes, the ladder's and the gates' 1 s window) weighs ~50
    times more per request than at full speed: it is measured with no load
    just before and just after the load (the gates then hold what the load
    left) and taken out at their mean rate."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    wait_port(port, 600)
    # Warm-up: connections, caches, lazy imports.
    asyncio.run(load(url, min(200, n // 2), conc, sticky=True))

    def quiet() -> float:
        _ctl(p, "-z")
        t0 = time.monotonic()
        time.sleep(idle_s)
        _ctl(p, "-d")
        return _latest_dump(dump) / (time.monotonic() - t0)

    before = quiet()
    _ctl(p, "-z")
    t0 = time.monotonic()
    asyncio.run(load(url, n, conc, sticky=True))
    took = time.monotonic() - t0
    _ctl(p, "-d")
    total = _latest_dump(dump)
    after = quiet()
    bg = (before + after) / 2
    return total / n, bg, (total - bg * took) / n


def instructions(
    tmp: Path,
    up_port: int,
    kind: str,
    n: int,
    conc: int,
    trees: list[Path],
    idle_s: float,
    control: bool = False,
    hashseed: str = "",
) -> list[Instr]:
    """Instructions per request of each variant (and tree), under callgrind.
    `control`: a second `off` process last ("off2": what two identical
    processes differ by); `hashseed`: PYTHONHASHSEED of the proxies ("": a
    random one per process, as in production)."""
    upstream = f"http://127.0.0.1:{up_port}/{kind}"
    out: list[Instr] = []
    variants = (*VARIANTS, "off2") if control else VARIANTS
    for ti, tree in enumerate(trees):
        for v in variants:
            port = free_port()
            pol = variant_policy(tmp, upstream, f"cg-{kind}-{ti}-{v}", v.rstrip("2"))
            dump = tmp / f"cg-{kind}-{ti}-{v}"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            if hashseed:
                env["PYTHONHASHSEED"] = hashseed
            p = callgrind(dump, serve_cmd(pol, port), tree, env)
            try:
                raw, bg, per = measure_instr(p, port, dump, n, conc, idle_s)
            finally:
                stop([p])
            name = "this tree" if tree == ROOT else tree.name
            out.append(Instr(name, v, raw, bg, per, n))
            print(
                f"{kind:5} {name} {v:5}: {per:,.0f} instructions / request "
                f"(raw {raw:,.0f}; background {bg:,.0f} / s)",
                flush=True,
            )
    return out


def window_cost_of(tree: Path) -> float:
    """`window_cost` of `tree`'s proxy package, in a process of its own."""
    out = subprocess.run(
        [sys.executable, __file__, "--window-only"],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.split()[-1])


def window_cost(reps: int = 5, per_tick: int = 1000) -> float:
    """Milliseconds one gates evaluation takes with every series at the cap
    (10,000 samples per arm: > 33 requests/s per arm over the default 300 s
    window) after `per_tick` new requests per arm since the last one (the
    window slid: as many old samples left): the rollout's work per ladder
    window (1 s) at ~2,000 requests/s. Best of `reps`."""
    import random

    from proxy.control.gates import CAP, Gates
    from proxy.policy.rollout import GatesPolicy

    g = Gates(GatesPolicy(ttft_ratio_max=1000, p99_ratio_max=1000))
    rnd = random.Random(21)
    t = 0.0

    def requests(n: int) -> None:
        nonlocal t
        for i in range(2 * n):
            t += 0.0005
            g.observe(
                "candidate" if i % 2 else "primary",
                t,
                latency_s=rnd.lognormvariate(-3, 0.5),
                ttft_s=rnd.lognormvariate(-5, 0.5),
            )

    requests(CAP)
    g.evaluate(t)
    best = math.inf
    for _ in range(reps):
        requests(per_tick)
        t0 = time.perf_counter()
        g.evaluate(t)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def pct(x: float) -> str:
    return f"{x:.1%}"


def report(
    results: list[KindResult],
    instr: dict[str, list[Instr]],
    args: argparse.Namespace,
) -> tuple[str, bool]:
    ok = True
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# The rollout's cost on the hot path (issue 21)",
        "",
        f"{stamp}; `bench/rollout_ab.py`; {os.cpu_count()} cores shared by wrk, the upstream "
        "(nginx, static SSE) and the proxies. Three Brownout processes on the same policy "
        "(`bench/run.py`'s): **off** (no candidate), **idle** (`backends.candidate` and a "
        "`rollout:` section, not started), **step** (the rollout started, stepping at 50 %, "
        "sticky on a header sent fresh with every request: the bucket hash, the arm choice and "
        "the gates' sample on every request, half of them answered by the candidate, which is "
        "the same upstream). Budget: the routing costs at most "
        f"{BUDGET:.0%} (ratio ≥ {1 - BUDGET:.0%}).",
        "",
    ]
    if results:
        lines += [
            f"## Throughput: wrk at c={args.conc}, {args.rounds} interleaved rounds of "
            f"{args.duration:g} s per variant",
            "",
            "| stream | variant | req/s (median) | p50 ms | p99 ms | CPU s / 1k req "
            "| / off, req/s: median of rounds (range) | / off, CPU per request |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        guard_rows = []
        for r in results:
            off_cpu = statistics.median(s.cpu_per_1k or 0.0 for s in r.samples["off"])
            for v in VARIANTS:
                ss = r.samples[v]
                cpu = statistics.median(s.cpu_per_1k or 0.0 for s in ss)
                if v == "off":
                    rel = rel_cpu = "–"
                else:
                    rs = r.ratios(v)
                    med = statistics.median(rs)
                    rel = f"**{pct(med)}** ({pct(min(rs))}–{pct(max(rs))})"
                    rel_cpu = pct(cpu / off_cpu) if off_cpu else "–"
                    verdict = "within" if med >= 1 - BUDGET else "OVER"
                    ok = ok and med >= 1 - BUDGET
                    guard_rows.append(
                        f"| {r.kind} ({CHUNKS[r.kind]} chunks) | {LABEL[v]} | {pct(med)} "
                        f"| {pct(statistics.quantiles(rs, n=4)[0])}–"
                        f"{pct(statistics.quantiles(rs, n=4)[2])} | {rel_cpu} | {verdict} |"
                    )
                lines.append(
                    f"| {r.kind} ({CHUNKS[r.kind]} chunks) | {v} | "
                    f"{statistics.median(s.rps for s in ss):,.0f} | "
                    f"{statistics.median(s.p50_ms for s in ss):.2f} | "
                    f"{statistics.median(s.p99_ms for s in ss):.2f} | {cpu:.3f} | {rel} | "
                    f"{rel_cpu} |"
                )
        lines += [
            "",
            "Guard rail (budget: ratio ≥ 97 %):",
            "",
            "| stream | rollout | req/s ratio to off (median) | interquartile range "
            "| CPU per request, ratio to off | budget |",
            "| --- | --- | --- | --- | --- | --- |",
            *guard_rows,
            "",
        ]
        for r in results:
            lines.append(
                f"- {r.kind}: the step variant ended `{r.state}`; share of its answers "
                f"from the candidate: {r.share:.1%}"
            )
        lines.append("")
    for kind, rows in instr.items():
        lines += [
            f"## Instructions per request ({kind}: {CHUNKS[kind]} chunks; callgrind, "
            f"{rows[0].requests} requests, {args.conc_instr} at a time)",
            "",
            "Per request: what the load cost, less the timer-driven work (measured with no "
            f"load for {args.idle_s:g} s before and after, taken out at its mean rate; under "
            "callgrind a request is ~50× slower while timers keep wall-clock time). Raw: "
            "everything, timers included. Background: instructions per second with no load.",
            "",
            "| tree | variant | per request | / off | raw per request | background / s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        base = {i.tree: i.per_request for i in rows if i.variant == "off"}
        for i in rows:
            rel = "–" if i.variant == "off" else f"{i.per_request / base[i.tree] - 1:+.2%}"
            lines.append(
                f"| {i.tree} | {i.variant} | {i.per_request:,.0f} | {rel} | {i.raw:,.0f} | "
                f"{i.background:,.0f} |"
            )
        lines.append("")
    lines += [
        "## Per window",
        "",
        "One gates evaluation with every series at the cap (10,000 samples per arm and "
        "series, > 33 requests/s per arm over the default 300 s window) after 1,000 new "
        "requests per arm since the last (the window slid by as many: ~2,000 requests/s), "
        "once per ladder window (1 s); best of 5. (The series are put in order here, "
        "not per sample: this is work the requests no longer do.)",
        "",
        "| tree | ms per evaluation | share of one core |",
        "| --- | --- | --- |",
        *(f"| {t} | {ms:.2f} | {ms / 10:.2f} % |" for t, ms in args.window_ms.items()),
        "",
    ]
    lines += [
        "The rollout's own per-request work alone (routing and the gates' sample, "
        "in process): `bench/rollout_path.py`.",
        "",
    ]
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--kinds", default="short,long", help="throughput runs ('' for none)")
    ap.add_argument("--instr-kinds", default="short,long", help="callgrind runs ('' for none)")
    ap.add_argument(
        "--requests", type=int, default=1000, help="per callgrind measurement (long: a tenth)"
    )
    ap.add_argument("--conc-instr", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=8.0, help="no-load span under callgrind")
    ap.add_argument(
        "--control", action="store_true", help="callgrind: a second off process (off2) last"
    )
    ap.add_argument("--hashseed", default="", help="callgrind: the proxies' PYTHONHASHSEED")
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another checkout")
    ap.add_argument("--quick", action="store_true", help="4 rounds of 2 s, 300 requests")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout-cost.md")
    ap.add_argument("--window-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.window_only:
        print(f"{window_cost():.4f}")
        return 0
    if args.quick:
        args.rounds, args.duration, args.requests, args.idle_s = 4, 2.0, 300, 5.0
    kinds = [k for k in args.kinds.split(",") if k]
    instr_kinds = [k for k in args.instr_kinds.split(",") if k]
    if kinds and shutil.which("wrk") is None:
        print("wrk is missing: apt-get install wrk", file=sys.stderr)
        return 2
    if instr_kinds and shutil.which("valgrind") is None:
        print("valgrind is missing (instruction counts skipped): apt-get install valgrind")
        instr_kinds = []
    tmp = Path(tempfile.mkdtemp(prefix="brownout-rollout-ab-"))
    procs: list[subprocess.Popen[bytes]] = []
    up = free_port()
    procs.append(start_static_upstream(tmp, up))
    wait_port(up)
    results: list[KindResult] = []
    instr: dict[str, list[Instr]] = {}
    trees = [ROOT, *(t.resolve() for t in args.tree)]
    try:
        for kind in kinds:
            results.append(throughput(tmp, up, kind, args.rounds, args.duration, args.conc))
        for kind in instr_kinds:
            n = args.requests if kind == "short" else max(50, args.requests // 10)
            instr[kind] = instructions(
                tmp, up, kind, n, args.conc_instr, trees, args.idle_s, args.control, args.hashseed
            )
    finally:
        stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    args.window_ms = {("this tree" if t == ROOT else t.name): window_cost_of(t) for t in trees}
    text, ok = report(results, instr, args)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    if not ok:
        print(f"the rollout costs more than {BUDGET:.0%} on this run", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
