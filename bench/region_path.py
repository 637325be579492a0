"""Instructions per request of the relay's per-region work, in process, under
valgrind's callgrind (steady: no sockets, no timers, no load; issue 24).

What `proxy/pipeline/pump.py` does with an answer's bytes between the read
and the write, stage by stage, on `bench/common.py`'s vLLM-shaped stream
(`--chunks` content chunks, the finish, [DONE]) arriving in reads of
`--read` bytes (0: the whole body in one read, as nginx delivers it to the
long-stream benchmark): the framer (`SSEFramer.feed`), the usage-chunk byte
test (`find_usage`), the run of text chunks (`ChunkRuns.cut`), the output
guard (`StreamGuard.feed`, the default rules) and the markers. Each stage's
figure is the cumulative count up to it minus the one before; `write` is the
chunked framing aiohttp builds before Python 3.12.9 (size line, data, CRLF
joined) — what `proxy/server.py` no longer has it do on uvloop — for
scale. Only the requests' loop is counted (callgrind collects inside
`functools.reduce`, which runs it).

    .venv/bin/python bench/region_path.py [TREE ...] [--chunks 16,1024] [--read 0]
        [--requests 200]

Each TREE (a checkout, default this one) is imported in a process of its own.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("framer", "usage test", "cut", "guard", "markers", "write")


def child(chunks: int, read: int, requests: int, stages: int) -> None:
    """The measured process: `requests` answers through the first `stages` stages."""
    import functools

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import sse_body

    from proxy.guard.compiled import Guard
    from proxy.openai.chunkrun import ChunkRuns
    from proxy.openai.chunks import markers
    from proxy.openai.sse import SSEFramer
    from proxy.openai.usage import find_usage
    from proxy.policy import GuardPolicy

    body = sse_body(chunks)
    reads = [body[i : i + read] for i in range(0, len(body), read)] if read else [body]
    guard = Guard(GuardPolicy())

    def answer() -> None:
        framer, runs, sg = SSEFramer(), ChunkRuns(), guard.stream()
        for piece in reads:
            region = framer.feed(piece)
            if not region or stages < 2:
                continue
            tail = region[-4] if len(region) >= 4 else 0
            if tail == 125 or tail == 69:
                find_usage(region)
            if stages < 3:
                continue
            run = runs.cut(region)
            if stages < 4:
                continue
            verdict = sg.feed(region, run)
            assert verdict is region
            if stages < 5:
                continue
            markers(region, run)
            if stages < 6:
                continue
            b"".join((f"{len(region):x}\r\n".encode(), region, b"\r\n"))

    def run(_a: object, _b: object) -> None:
        for _ in range(requests):
            answer()

    answer()  # warm: imports, caches
    functools.reduce(run, [0], None)


def measure(tree: Path, chunks: int, read: int, requests: int, stages: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}",
             sys.executable, __file__, "--child", str(chunks), str(read), str(requests),
             str(stages)],
            env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
            cwd=tree,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        m = re.search(r"^(?:summary|totals):\s+(\d+)", out.read_text(errors="replace"), re.M)
        assert m, out
        return int(m.group(1)) / requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", type=Path)
    ap.add_argument("--chunks", default="16,1024")
    ap.add_argument("--read", type=int, default=0, help="bytes per read (0: one read)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    trees = [t.resolve() for t in args.trees] or [ROOT]
    print(f"reads of {args.read or 'the whole body'} bytes; instructions / request")
    print("| tree | chunks | " + " | ".join(STAGES) + " | total (without write) |")
    print("| --- | --- |" + " --- |" * (len(STAGES) + 1))
    for chunks in (int(c) for c in args.chunks.split(",")):
        for tree in trees:
            cum = [measure(tree, chunks, args.read, args.requests, k) for k in range(1, 7)]
            steps = [cum[0]] + [b - a for a, b in itertools.pairwise(cum)]
            cells = " | ".join(f"{s:,.0f}" for s in steps)
            print(f"| {tree.name} | {chunks:,} | {cells} | {cum[4]:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
