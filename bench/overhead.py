"""Added latency of the proxy at concurrency 1, against direct and a bare relay.

Upstream: nginx serving prebuilt OpenAI SSE bodies from static files (POST is
answered through `error_page 405 =200 $uri`), so the upstream costs almost
nothing and what is measured is the path in between. Paths are interleaved
request by request, in one run, so machine noise hits them alike.

    .venv/bin/python bench/overhead.py [--rounds 300] [--out bench/results/overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port

BODY = json.dumps(
    {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


async def one(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as r:
        first = await r.content.readany()
        ttfb = time.perf_counter() - t0
        assert first, url
        async for _ in r.content.iter_any():
            pass
        assert r.status == 200
    return ttfb, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def measure(paths: dict[str, str], rounds: int, kind: str) -> dict[str, dict[str, float]]:
    res: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in paths}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for name, base in paths.items():  # warm-up: connections, caches
            for _ in range(20):
                await one(s, f"{base}/{kind}/v1/chat/completions" if name == "direct" else base)
        for _ in range(rounds):
            for name, base in paths.items():
                url = f"{base}/{kind}/v1/chat/completions" if name == "direct" else base
                ttfb, total = await one(s, url)
                res[name][0].append(ttfb)
                res[name][1].append(total)
    out = {}
    for name, (ttfb, total) in res.items():
        out[name] = {
            "ttfb_p50": statistics.median(ttfb),
            "ttfb_p99": pct(ttfb, 0.99),
            "total_p50": statistics.median(total),
            "total_p99": pct(total, 0.99),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.md"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port, bo_ports, bare_ports = free_port(), {}, {}
        procs.append(start_static_upstream(tmp, up_port))
        for kind in ("short", "long"):
            bo_ports[kind] = free_port()
            policy = tmp / f"policy-{kind}.yaml"
            policy.write_text(
                "backends:\n  primary:\n"
                f"    url: http://127.0.0.1:{up_port}/{kind}\n"
                "    health: {interval_s: 5}\n"
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "proxy.cli",
                        "serve",
                        "--config",
                        str(policy),
                        "--port",
                        str(bo_ports[kind]),
                    ],
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                )
            )
            bare_ports[kind] = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(ROOT / "bench" / "bare_relay.py"),
                        f"http://127.0.0.1:{up_port}/{kind}",
                        str(bare_ports[kind]),
                    ],
                    stderr=subprocess.DEVNULL,
                )
            )

        async def run() -> dict[str, dict[str, dict[str, float]]]:
            for p in [up_port, *bo_ports.values(), *bare_ports.values()]:
                await asyncio.to_thread(wait_port, p)
            results = {}
            for kind in ("short", "long"):
                paths = {
                    "direct": f"http://127.0.0.1:{up_port}",
                    "bare aiohttp relay": f"http://127.0.0.1:{bare_ports[kind]}/v1/chat/completions",
                    "brownout": f"http://127.0.0.1:{bo_ports[kind]}/v1/chat/completions",
                }
                results[kind] = await measure(paths, args.rounds, kind)
            return results

        results = asyncio.run(run())
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "# Proxy overhead at concurrency 1",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
        f"{args.rounds} interleaved rounds per path; upstream = nginx static SSE files; "
        "Brownout on its default knobs (metrics and request logs on).",
        "",
    ]
    for kind, chunks in (("short", 16), ("long", 1024)):
        r = results[kind]
        d = r["direct"]
        lines += [
            f"## {kind}: {chunks} chunks",
            "",
            "| path | TTFB p50 ms | TTFB p99 ms | total p50 ms | total p99 ms "
            "| added TTFB p50 ms | added total p50 ms |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, m in r.items():
            lines.append(
                f"| {name} | {m['ttfb_p50'] * 1e3:.3f} | {m['ttfb_p99'] * 1e3:.3f} "
                f"| {m['total_p50'] * 1e3:.3f} | {m['total_p99'] * 1e3:.3f} "
                f"| {(m['ttfb_p50'] - d['ttfb_p50']) * 1e3:.3f} "
                f"| {(m['total_p50'] - d['total_p50']) * 1e3:.3f} |"
            )
        bare = r["bare aiohttp relay"]
        bo = r["brownout"]
        ratio = (bo["ttfb_p50"] - d["ttfb_p50"]) / max(1e-9, bare["ttfb_p50"] - d["ttfb_p50"])
        lines += ["", f"Brownout added TTFB / bare relay added TTFB (p50): **{ratio:.2f}×**", ""]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
