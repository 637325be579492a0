"""Instructions per request of Brownout builds, under valgrind's callgrind.

    .venv/bin/python bench/instr.py TREE [TREE ...] [--requests 1000] [--conc 16]
        [--kind short|long|usage] [--extra-path DIR] [--bare] [--usage-off-too] [--recorder]
        [--sessions]

A count of executed instructions does not move with the other work on a
shared machine, which the requests/s and CPU-time figures of `bench/ab.py`
do. Each TREE's `proxy.cli serve` (and, with `--bare`, the bare relay) runs
under callgrind on `bench/run.py`'s upstream and policy; after a warm-up the
counters are zeroed, `--requests` streaming chat requests are sent
(`--conc` at a time), and the counters are dumped: instructions / request,
the whole process (every thread) included.

`--kind usage` serves the 16-chunk stream with vLLM's usage chunk (what
Brownout's `stream_options.include_usage` asks for); `--kind paced` a
Python upstream (`bench/paced_upstream.py`) that writes one token every
`--gap-ms` and, like vLLM, the usage chunk only when asked: each token is a
read of its own, as from a real engine; `--usage-off-too`
measures each tree that knows the knob a second time with
`backends.primary.stream_usage: false` (token telemetry on vs off in one run);
`--recorder` measures each tree with the flight recorder off and then on
(its writer thread included); `--sessions` turns Redis sessions on (a private
`redis-server`) and sends a fresh `X-Session-Id` per request: a session load
and save on every request, as `bench/run.py`'s Redis variant.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, start_static_upstream, wait_port
from run import brownout_policy, serve_cmd, stop

BODY = (
    b'{"model":"tiny","stream":true,"max_tokens":16,'
    b'"messages":[{"role":"user","content":"Hello there, how are you?"}]}'
)


async def load(url: str, n: int, conc: int, sticky: bool = False, sessions: bool = False) -> None:
    """`n` streaming chat requests, `conc` at a time; `sticky`: each with a
    fresh `X-Bench-User` (a rollout's sticky key, as bench/post.lua sends it);
    `sessions`: each with a fresh `X-Session-Id` (a session load and save per
    request, as bench/post.lua's BENCH_SESSIONS=1)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:
        left = n
        run_id = uuid.uuid4().hex[:12]

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                headers = {"Content-Type": "application/json"}
                if sticky:
                    headers["X-Bench-User"] = f"user-{left}"
                if sessions:
                    headers["X-Session-Id"] = f"bench-{run_id}-{left}"
                async with s.post(url, data=BODY, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status

        await asyncio.gather(*(worker() for _ in range(conc)))


def callgrind(out: Path, cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def measure(
    p: subprocess.Popen[bytes],
    port: int,
    out: Path,
    n: int,
    conc: int,
    sticky: bool = False,
    sessions: bool = False,
) -> float:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    wait_port(port, 600)
    asyncio.run(
        load(url, 200, conc, sticky, sessions)
    )  # warm-up: connections, caches, lazy imports
    subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
    asyncio.run(load(url, n, conc, sticky, sessions))
    subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
    dumps = sorted(glob.glob(f"{out}*"), key=os.path.getmtime)
    text = Path(dumps[-1]).read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    assert m, dumps[-1]
    return int(m.group(1)) / n


def start_redis(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    """A private redis-server (no persistence): the shared one has other users."""
    return subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def knows_stream_usage(tree: Path) -> bool:
    """Whether a tree's policy has `backends.<name>.stream_usage` (issue 23)."""
    return "stream_usage" in (tree / "proxy" / "policy" / "backends.py").read_text()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", type=Path)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--kind", default="short", choices=("short", "long", "usage", "paced"))
    ap.add_argument("--gap-ms", type=float, default=20.0, help="--kind paced: between tokens")
    ap.add_argument("--extra-path", default="")
    ap.add_argument("--bare", action="store_true", help="measure the bare relay too")
    ap.add_argument("--keep", type=Path, help="copy the callgrind dumps here (callgrind_annotate)")
    ap.add_argument(
        "--usage-off-too",
        action="store_true",
        help="each tree again with backends.primary.stream_usage: false",
    )
    ap.add_argument(
        "--sessions",
        action="store_true",
        help="Redis sessions on (a private redis-server), a fresh X-Session-Id per request",
    )
    ap.add_argument(
        "--recorder",
        action="store_true",
        help="measure each tree twice: flight recorder off, then on (its cost, issue 22)",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-instr-"))
    procs: list[subprocess.Popen[bytes]] = []
    up_port = free_port()
    if args.kind == "paced":
        script = str(ROOT / "bench" / "paced_upstream.py")
        gap = f"--gap-ms={args.gap_ms}"
        procs.append(subprocess.Popen([sys.executable, script, str(up_port), gap]))
        upstream = f"http://127.0.0.1:{up_port}"
    else:
        procs.append(start_static_upstream(tmp, up_port))
        upstream = f"http://127.0.0.1:{up_port}/{args.kind}"
    wait_port(up_port)
    redis_url = "redis://127.0.0.1:6379/0"
    if args.sessions:
        redis_port = free_port()
        procs.append(start_redis(tmp, redis_port))
        wait_port(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    results: list[tuple[str, float]] = []
    try:
        if args.bare:
            port = free_port()
            out = tmp / "cg-bare"
            p = callgrind(out, [sys.executable, str(ROOT / "bench" / "bare_relay.py"), upstream,
                                str(port)], ROOT, dict(os.environ))  # fmt: skip
            procs.append(p)
            results.append(("bare aiohttp", measure(p, port, out, args.requests, args.conc)))
            print(f"bare aiohttp: {results[-1][1]:,.0f} instructions / request", flush=True)
            stop([p])
        variants = [("", "")]
        if args.recorder:
            variants.append((" (recorder on)", "recorder"))
        if args.usage_off_too:
            variants.append((" (stream_usage off)", "    stream_usage: false\n"))
        runs = [
            (tree.resolve(), label, extra)
            for tree in args.trees
            for label, extra in variants
            if not extra or extra == "recorder" or knows_stream_usage(tree)
        ]
        for i, (tree, label, extra) in enumerate(runs):
            port = free_port()
            rec = extra == "recorder"
            pol = brownout_policy(
                tmp,
                upstream,
                f"instr{i}",
                sessions=args.sessions,
                primary_extra="" if rec else extra,
                redis_url=redis_url,
                # Under callgrind a Redis call takes far longer than the
                # default 0.25 s deadline: timed-out calls would take other
                # paths (stragglers, reconnects, queued saves) from run to run.
                redis_timeout_s=30.0,
            )
            if rec:
                with pol.open("a") as f:
                    f.write(f"recorder:\n  enabled: true\n  dir: {tmp / f'rec{i}'}\n")
            out = tmp / f"cg-{i}"
            pp = os.pathsep.join(filter(None, [str(tree), args.extra_path]))
            p = callgrind(out, serve_cmd(pol, port), tree, {**os.environ, "PYTHONPATH": pp})
            procs.append(p)
            name = f"{tree}{label}"
            ir = measure(p, port, out, args.requests, args.conc, sessions=args.sessions)
            results.append((name, ir))
            print(f"{name}: {results[-1][1]:,.0f} instructions / request", flush=True)
            stop([p])
    finally:
        stop(procs)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for f in glob.glob(f"{tmp}/cg-*"):
                shutil.copy(f, args.keep)
        shutil.rmtree(tmp, ignore_errors=True)
    sess = ", Redis sessions (a fresh session per request)" if args.sessions else ""
    print(f"\n{args.kind} streams, {args.requests} requests, {args.conc} at a time{sess}")
    for name, ir in results:
        print(f"| {name} | {ir:,.0f} |")
    if args.recorder and not args.usage_off_too:
        mine = [r for r in results if r[0] != "bare aiohttp"]
        for off, on in zip(mine[0::2], mine[1::2], strict=True):
            print(f"recorder on / off: {on[1] / off[1]:.4f} ({(on[1] / off[1] - 1) * 100:+.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
