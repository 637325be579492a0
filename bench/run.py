"""`make bench`: Brownout against nginx, a bare aiohttp relay and LiteLLM,
measured in one run, interleaved, on this machine.

Upstream: nginx serving prebuilt OpenAI SSE bodies (16 and 1,024 chunks), so
the proxies are what is measured. Load: wrk (C) with bench/post.lua, closed
loop, at concurrency 1, 16, 64, 256. Per path and concurrency: requests/s,
latency p50/p99, CPU seconds per 1,000 requests of the proxy process tree,
peak RSS. Then memory per open stream (slow upstream, N open streams) and
time to first byte at concurrency 1 (bench/overhead.py's method).

    .venv/bin/python bench/run.py [--duration 5] [--quick]

Writes bench/results/latest.md and bench/results/latest.png (if matplotlib
is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    ROOT,
    cpu_seconds,
    free_port,
    proc_tree,
    rss_bytes,
    start_nginx_proxy,
    start_static_upstream,
    wait_port,
)

from proxy.openai.chunkrun import NATIVE

LITELLM_VENV = Path(
    os.environ.get("BROWNOUT_LITELLM_VENV", Path.home() / ".cache/brownout/litellm-venv")
)
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
# The commit issue 24 measured ("43 % of the bare relay"): run beside this tree.
BEFORE_REV = "8c097b4"
HEADLINE = ("<!-- bench-headline: written by a full bench/run.py -->", "<!-- /bench-headline -->")
LITELLM_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
PURE = {"BROWNOUT_PURE": "1"}  # the pure-Python run scanner (proxy/openai/chunkrun.py)


def serve_cmd(policy: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "proxy.cli",
        "serve",
        "--config",
        str(policy),
        "--port",
        str(port),
    ]


@dataclass
class Path_:
    name: str
    url: str  # full chat completions URL
    pid: int | None  # the process tree measured (None: the upstream itself)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Sample:
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_per_1k: float | None
    errors: int


def parse_wrk(out: str) -> tuple[float, float, float, int, int]:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def ms(label: str) -> float:
        m = re.search(rf"^\s+{label}%?\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v

    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errs = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errs += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errs += sum(int(x) for x in m.groups())
    return rps, ms("50"), ms("99"), total, errs


def run_wrk(p: Path_, conc: int, duration: float) -> Sample:
    pids = proc_tree(p.pid) if p.pid else []
    cpu0 = cpu_seconds(pids)
    env = {**os.environ, **p.env}
    out = subprocess.run(
        [
            "wrk",
            "-t1" if conc < 2 else "-t2",
            f"-c{conc}",
            f"-d{max(1, round(duration))}s",
            "--latency",
            "--timeout",
            "10s",
            "-s",
            str(ROOT / "bench" / "post.lua"),
            p.url,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    rps, p50, p99, total, errs = parse_wrk(out)
    cpu = (cpu_seconds(pids) - cpu0) / total * 1000 if pids and total else None
    return Sample(rps, p50, p99, cpu, errs)


async def open_streams(url: str, n: int, headers: dict[str, str]) -> list[aiohttp.ClientResponse]:
    conn = aiohttp.TCPConnector(limit=0)
    s = aiohttp.ClientSession(connector=conn)
    body = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resps = await asyncio.gather(*(s.post(url, json=body, headers=headers) for _ in range(n)))
    for r in resps:
        await r.content.readany()  # the stream is open and flowing
    resps[0]._bench_session = s  # type: ignore[attr-defined]
    return resps


def memory_per_stream(url: str, pid: int, n: int) -> float:
    """RSS growth of the proxy per open, slowly flowing stream (bytes)."""

    async def go() -> float:
        pids = proc_tree(pid)
        before = rss_bytes(pids)
        resps = await open_streams(url, n, {})
        await asyncio.sleep(1.0)
        after = rss_bytes(pids)
        for r in resps:
            r.close()
        await resps[0]._bench_session.close()  # type: ignore[attr-defined]
        return (after - before) / n

    return asyncio.run(go())


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def brownout_policy(
    tmp: Path,
    upstream: str,
    name: str,
    sessions: bool,
    guard: bool = True,
    primary_extra: str = "",
    *,
    candidate: str | None = None,
    candidate_extra: str = "",
    extra: str = "",
    redis_url: str = "redis://127.0.0.1:6379/0",
    redis_timeout_s: float | None = None,
) -> Path:
    """The benchmarks' policy; `candidate` adds `backends.candidate` (same
    health settings as the primary, `candidate_extra` its own further keys),
    `extra` is appended (a `rollout:` section)."""
    path = tmp / f"policy-{name}.yaml"
    cand = (
        f"  candidate:\n    url: {candidate}\n    health: {{interval_s: 5}}\n{candidate_extra}"
        if candidate is not None
        else ""
    )
    store = (
        f"  store: {redis_url}\n  key_prefix: 'brownout-bench:{os.getpid()}:'\n"
        "  ttl_s: 120\n"
        # A fresh session per request, all from one address: the per-client
        # cap would refuse them after 10,000.
        "  max_sessions_per_client: 0\n"
        + (f"  redis_timeout_s: {redis_timeout_s}\n" if redis_timeout_s is not None else "")
        if sessions
        else ""
    )
    path.write_text(
        f"""# The default policy's knobs, with the admission limit out of the way:
# this measures overhead, not throttling.
backends:
  primary:
    url: {upstream}
    health: {{interval_s: 5}}
{primary_extra}{cand}ladder:
  throttle: {{max_inflight: 4096, queue_size: 4096, scrape_interval_s: 0}}
guard:
  enabled: {"true" if guard else "false"}
sessions:
  max_turns: 4
{store}{extra}"""
    )
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 64 only, 3 s runs")
    ap.add_argument("--streams", type=int, default=500, help="open streams for the memory test")
    ap.add_argument(
        "--before",
        default=BEFORE_REV,
        help="a git revision measured in the same run as 'brownout @REV' (issue 24's "
        "before/after); '' to skip",
    )
    ap.add_argument(
        "--no-readme",
        action="store_true",
        help="leave README.md's headline alone (a full run regenerates it; --quick never does)",
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is missing: apt-get install wrk", file=sys.stderr)
        return 2
    concs = [1, 64] if args.quick else [1, 16, 64, 256]
    duration = 3.0 if args.quick else args.duration
    tmp = Path(tempfile.mkdtemp(prefix="brownout-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    up_port = free_port()
    procs.append(start_static_upstream(tmp, up_port))
    wait_port(up_port)
    results: dict[str, dict[str, dict[int, Sample]]] = {}
    extra: dict[str, str] = {}
    before = export_tree(args.before, tmp / "before") if args.before else None
    try:
        for kind in ("short", "long"):
            paths: list[Path_] = [
                Path_("direct", f"http://127.0.0.1:{up_port}/{kind}/v1/chat/completions", None)
            ]
            ng = free_port()
            p = start_nginx_proxy(tmp, ng, up_port, kind)
            procs.append(p)
            paths.append(Path_("nginx", f"http://127.0.0.1:{ng}/v1/chat/completions", p.pid))
            bare = free_port()
            p = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "bare_relay.py"),
                 f"http://127.0.0.1:{up_port}/{kind}", str(bare)],
            )  # fmt: skip
            procs.append(p)
            paths.append(
                Path_("bare aiohttp", f"http://127.0.0.1:{bare}/v1/chat/completions", p.pid)
            )
            # (name, sessions, guard, tree, environment)
            variants: list[tuple[str, bool, bool, Path, dict[str, str]]] = [
                ("brownout", False, True, ROOT, {}),
                ("brownout (guard off)", False, False, ROOT, {}),
                ("brownout+redis sessions", True, True, ROOT, {}),
            ]
            if NATIVE is not None:  # what the C run scanner buys, same run
                variants.append(("brownout (pure-Python scanner)", False, True, ROOT, PURE))
            if before is not None:
                variants.append((f"brownout @{args.before}", False, True, before, {}))
            for i, (name, sessions, guard, tree, penv) in enumerate(variants):
                port = free_port()
                pol = brownout_policy(
                    tmp, f"http://127.0.0.1:{up_port}/{kind}", f"{kind}{i}", sessions, guard
                )
                p = subprocess.Popen(
                    serve_cmd(pol, port),
                    stderr=subprocess.DEVNULL,
                    cwd=tree,
                    env={**os.environ, "PYTHONPATH": str(tree), **penv},
                )  # fmt: skip
                procs.append(p)
                env = {"BENCH_SESSIONS": "1"} if sessions else {}
                paths.append(
                    Path_(name, f"http://127.0.0.1:{port}/v1/chat/completions", p.pid, env)
                )
            if (LITELLM_VENV / "bin" / "python").exists():
                port = free_port()
                cfg = tmp / f"litellm-{kind}.yaml"
                cfg.write_text(
                    f"""model_list:
  - model_name: tiny
    litellm_params:
      model: openai/tiny
      api_base: http://127.0.0.1:{up_port}/{kind}/v1
      api_key: none
general_settings:
  master_key: sk-bench
litellm_settings:
  telemetry: false
"""
                )
                p = subprocess.Popen(
                    [str(LITELLM_VENV / "bin" / "python"), "-m", "litellm.proxy.proxy_cli",
                     "--config", str(cfg), "--port", str(port),
                     "--host", "127.0.0.1", "--num_workers", "1"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env={**os.environ, **LITELLM_ENV},
                )  # fmt: skip
                procs.append(p)
                paths.append(
                    Path_("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", p.pid,
                          {"BENCH_AUTH": "sk-bench"})
                )  # fmt: skip
            else:
                extra["litellm"] = f"not measured: no LiteLLM venv at {LITELLM_VENV}"
            for path in paths:
                port = int(path.url.split(":")[2].split("/")[0])
                wait_port(port, 120)
            time.sleep(2)  # health probes, LiteLLM start-up
            for path in paths:  # warm-up
                run_wrk(path, 4, 1)
            res = results.setdefault(kind, {})
            for conc in concs:
                for path in paths:  # interleaved: every path at this load, in turn
                    s = run_wrk(path, conc, duration)
                    res.setdefault(path.name, {})[conc] = s
                    print(
                        f"{kind:5} c={conc:<3} {path.name:24} {s.rps:9.0f} req/s "
                        f"p50 {s.p50_ms:7.2f} ms p99 {s.p99_ms:7.2f} ms "
                        f"cpu/1k {s.cpu_per_1k or 0:6.3f} s errors {s.errors}",
                        flush=True,
                    )
            for path in paths:
                if path.pid:
                    extra[f"peak RSS {kind} {path.name}"] = (
                        f"{rss_bytes(proc_tree(path.pid), 'VmHWM') / 2**20:.1f} MiB"
                    )
            if kind == "short":
                # Memory per open stream, through Brownout, on a slow upstream.
                port = free_port()
                pol = brownout_policy(tmp, f"http://127.0.0.1:{up_port}/slow", "slow", False)
                p = subprocess.Popen(
                    serve_cmd(pol, port),
                    stderr=subprocess.DEVNULL, cwd=ROOT,
                )  # fmt: skip
                procs.append(p)
                wait_port(port)
                per = memory_per_stream(
                    f"http://127.0.0.1:{port}/v1/chat/completions", p.pid, args.streams
                )
                extra["memory per open stream (brownout)"] = f"{per / 1024:.1f} KiB"
            stop(procs[1:])
            del procs[1:]
    finally:
        stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(results, extra, concs, duration, args.before)
    if not args.quick and not args.no_readme:
        write_headline(results, extra)
    return 0


def headline_rows(
    results: dict[str, dict[str, dict[int, Sample]]], extra: dict[str, str]
) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) of issue 24's goals from one run."""
    rows: list[tuple[str, str, bool | None]] = []
    for kind, chunks, goal in (("short", 16, 0.60), ("long", 1024, 0.55)):
        res = results.get(kind, {})
        bo, bare = res.get("brownout"), res.get("bare aiohttp")
        if bo and bare:
            r = best(bo) / best(bare)
            target = f"≥ {goal * 100:.0f} % of the bare relay's best req/s, {chunks:,}-chunk"
            target += " streams"
            rows.append((target, f"{r:.0%}", r >= goal))
    for kind, chunks in (("short", 16), ("long", 1024)):
        res = results.get(kind, {})
        a = added_ratio(res, "brownout")
        if a is not None:
            ms = res["brownout"][1].p50_ms - res["direct"][1].p50_ms
            bare_ms = res["bare aiohttp"][1].p50_ms - res["direct"][1].p50_ms
            rows.append((f"added latency at c=1 ≤ 1.5 × the bare relay's (wrk), {chunks:,}-chunk",
                         f"{a:.2f} × ({ms:.2f} ms vs {bare_ms:.2f} ms)", a <= 1.5))  # fmt: skip
    short = results.get("short", {})
    bs, bare = short.get("brownout+redis sessions"), short.get("bare aiohttp")
    if bs and bare:
        r = best(bs) / best(bare)
        rows.append(("≥ 45 % of the bare relay with Redis sessions on (16-chunk)", f"{r:.0%}",
                     r >= 0.45))  # fmt: skip
    mem = extra.get("memory per open stream (brownout)")
    if mem:
        rows.append(("memory per open stream ≤ 64 KB", mem, float(mem.split()[0]) <= 62.5))
    bo, ll = short.get("brownout"), short.get("litellm")
    if bo and ll:
        x = best(bo) / best(ll)
        rows.append(("≥ 50 × LiteLLM's requests/s (16-chunk)", f"{x:.0f} ×", x >= 50))
    ng = short.get("nginx")
    if bo and ng:
        rows.append(("nginx (the C ceiling; no target)", f"Brownout = {best(bo) / best(ng):.0%}",
                     None))  # fmt: skip
    return rows


def write_headline(results: dict[str, dict[str, dict[int, Sample]]], extra: dict[str, str]) -> None:
    """README.md's headline table from this (full) run, between its markers."""
    text = README.read_text()
    start, end = HEADLINE
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        print("README.md has no bench headline markers: not updated", file=sys.stderr)
        return
    when = time.strftime("%Y-%m-%d", time.gmtime())
    rows = headline_rows(results, extra)
    table = ["| target | measured | |", "| --- | --- | --- |"] + [
        f"| {t} | {m} | {'' if ok is None else 'met' if ok else '**not met**'} |"
        for t, m, ok in rows
    ]
    block = "\n".join(
        [start, f"From the last full `make bench` ({when}, `bench/run.py`):", "", *table, ""]
    )
    README.write_text(text[:i] + block + text[j:])


def export_tree(rev: str, dest: Path) -> Path | None:
    """The tree of `rev` (git archive), to run its proxy side by side; None
    (and a note) where this is no git checkout or the revision is unknown."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True
    )
    if archive.returncode != 0:
        print(f"--before {rev}: {archive.stderr.decode().strip()}; not measured", file=sys.stderr)
        return None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def best(per: dict[int, Sample]) -> float:
    return max(s.rps for s in per.values())


def added_ratio(res: dict[str, dict[int, Sample]], name: str) -> float | None:
    """Added p50 latency at c=1 of `name` over the bare relay's (above direct)."""
    d, b, x = (res.get(n, {}).get(1) for n in ("direct", "bare aiohttp", name))
    if d is None or b is None or x is None or b.p50_ms <= d.p50_ms:
        return None
    return (x.p50_ms - d.p50_ms) / (b.p50_ms - d.p50_ms)


def write_report(
    results: dict[str, dict[str, dict[int, Sample]]],
    extra: dict[str, str],
    concs: list[int],
    duration: float,
    before: str = "",
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Benchmark: Brownout vs nginx, a bare aiohttp relay and LiteLLM",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores shared by "
        f"the load generator (wrk), the upstream (nginx, static SSE) and the proxy; "
        f"closed loop, {duration:g} s per point, paths interleaved at each concurrency. "
        "Brownout runs its default policy (guard and metrics on; admission limit raised "
        "out of the way).",
        "",
    ]
    for kind, chunks in (("short", 16), ("long", 1024)):
        res = results.get(kind)
        if not res:
            continue
        lines += [f"## {kind}: {chunks}-chunk streams", ""]
        lines += ["| path | " + " | ".join(f"c={c} req/s" for c in concs) + " | c=1 p50 ms | "
                  "c=1 p99 ms | added p50 ms (c=1) | CPU s / 1k req (c=64) |"]  # fmt: skip
        lines += ["| --- " * (len(concs) + 5) + "|"]
        direct = res.get("direct", {}).get(1)
        for name, per in res.items():
            c1 = per.get(1)
            added = (c1.p50_ms - direct.p50_ms) if c1 and direct else float("nan")
            c64 = per.get(64)
            cpu = f"{c64.cpu_per_1k:.3f}" if c64 and c64.cpu_per_1k is not None else "–"
            lines.append(
                f"| {name} | "
                + " | ".join(f"{per[c].rps:,.0f}" if c in per else "–" for c in concs)
                + f" | {c1.p50_ms:.2f} | {c1.p99_ms:.2f} | {added:.2f} | {cpu} |"
                if c1
                else f"| {name} | – |"
            )
        sat = max(concs)
        bo = res.get("brownout", {})
        bare = res.get("bare aiohttp", {})
        ratios = []
        if bo and bare:
            ratios.append(f"Brownout / bare relay, best req/s: **{best(bo) / best(bare):.0%}**")
            if 1 in bo and 1 in bare and 1 in res.get("direct", {}):
                d = res["direct"][1].p50_ms
                ab, ar = bo[1].p50_ms - d, bare[1].p50_ms - d
                ratios.append(f"added latency at c=1, Brownout / bare relay: **{ab / ar:.2f}×**")
        bs = res.get("brownout+redis sessions", {})
        if bs and bare:
            ratios.append(
                f"Brownout with Redis sessions / bare relay, best req/s: "
                f"**{best(bs) / best(bare):.0%}**"
            )
        ng = res.get("nginx", {})
        if bo and ng:
            ratios.append(f"Brownout / nginx, best req/s: {best(bo) / best(ng):.0%}")
        ll = res.get("litellm", {})
        if bo and ll:
            ratios.append(f"Brownout / LiteLLM, best req/s: **{best(bo) / best(ll):.1f}×**")
        if bo and sat in bo:
            events = bo[sat].rps * (chunks + 1)
            ratios.append(f"relay throughput at c={sat}: {events:,.0f} events/s")
        bb = res.get(f"brownout @{before}", {}) if before else {}
        if bb and bare:
            was = added_ratio(res, f"brownout @{before}")
            ratios.append(
                f"before ({before}, same run): {best(bb) / best(bare):.0%} of the bare relay"
                + (f", added latency {was:.2f}×" if was is not None else "")
                + f"; Brownout now / then, best req/s: {best(bo) / best(bb):.2f}×"
            )
        bp = res.get("brownout (pure-Python scanner)", {})
        if bo and bp and bare:
            was = added_ratio(res, "brownout (pure-Python scanner)")
            ratios.append(
                f"C run scanner: with the pure-Python one (same tree, `BROWNOUT_PURE=1`) "
                f"{best(bp) / best(bare):.0%} of the bare relay"
                + (f", added latency {was:.2f}×" if was is not None else "")
                + f"; C / pure, best req/s: {best(bo) / best(bp):.2f}×"
            )
        go = res.get("brownout (guard off)", {})
        if bo and go:
            ratios.append(
                f"guard cost: guard-on / guard-off best req/s = **{best(bo) / best(go):.0%}**"
            )
        lines += [""] + [f"- {r}" for r in ratios] + [""]
    lines += ["## Other figures", ""] + [f"- {k}: {v}" for k, v in extra.items()] + [""]
    (RESULTS / "latest.md").write_text("\n".join(lines))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("short", "long"), strict=True):
        for name, per in results.get(kind, {}).items():
            xs = sorted(per)
            ax.plot(xs, [per[c].rps for c in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{kind} streams: requests/s by concurrency")
        ax.set_xlabel("concurrent connections")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "latest.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
