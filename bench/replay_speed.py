"""`brownout replay` speed: recorded hours replayed per second of CPU.

    .venv/bin/python bench/replay_speed.py [--hours 1] [--rate 50] [--out FILE]

Writes a recording of `--hours` of traffic at `--rate` requests/s in the
flight recorder's format (a gzipped JSON-lines file: requests with their
attempts on a vLLM primary, a health probe every 2 s and a ladder window
every second, the default policy with room for the load, one engine death
in the middle, and its tier changes), then times `brownout replay` on it — reading
and parsing the trace, then the baseline and the candidate runs — in CPU
seconds of this process. The goal (issue 22): a day at 50 requests/s in
under a minute on this 2-core machine.
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.policy import parse_policy  # noqa: E402
from proxy.replay.main import run_replay  # noqa: E402
from proxy.telemetry.recorder import fingerprint  # noqa: E402

POLICY = """backends:
  primary: {url: http://primary.invalid, kind: vllm}
  fallback: {url: http://fallback.invalid, kind: transformers}
ladder:
  throttle: {max_inflight: 256, queue_size: 256}
"""
CANDIDATE = POLICY + "  breaker: {fail_max: 3}\n"


def write_trace(path: Path, hours: float, rate: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    pol = parse_policy(POLICY, env={})
    digest, knobs = fingerprint(pol)
    start = 1_767_225_600.0
    end = hours * 3600
    death = (end / 2, end / 2 + 90)
    n = 0
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(
            orjson.dumps(
                {"k": "policy", "t": start, "hash": digest, "reason": "start", "knobs": knobs}
            )
            + b"\n"
        )
        t = 0.0
        next_tick = 1.0
        while t < end:
            t += rng.expovariate(rate)
            while next_tick <= t:
                w = next_tick
                lines: list[dict[str, object]] = [{"k": "tick", "t": start + w}]
                if int(w) % 2 == 0:
                    for b in ("primary", "fallback"):
                        ok = not (b == "primary" and death[0] <= w < death[1])
                        lines.append(
                            {
                                "k": "probe",
                                "t": start + w + 0.02,
                                "b": b,
                                "ok": ok,
                                "def": not ok,
                                "cf": 0,
                                "err": None if ok else "connection failed",
                            }
                        )
                if w == death[0] + 2:
                    lines.append(
                        {
                            "k": "tier",
                            "t": start + w,
                            "from": "normal",
                            "to": "failover",
                            "why": "primary_down",
                            "detail": "",
                        }
                    )
                if w == death[1] + 12:
                    lines.append(
                        {
                            "k": "tier",
                            "t": start + w,
                            "from": "failover",
                            "to": "throttle",
                            "why": "recovered",
                            "detail": "",
                        }
                    )
                if w == death[1] + 52:
                    lines.append(
                        {
                            "k": "tier",
                            "t": start + w,
                            "from": "throttle",
                            "to": "normal",
                            "why": "recovered",
                            "detail": "",
                        }
                    )
                f.write(b"".join(orjson.dumps(x) + b"\n" for x in lines))
                next_tick += 1.0
            dead = death[0] <= t < death[1]
            backend = "fallback" if dead else "primary"
            ttft = rng.lognormvariate(-1.9, 0.3) * (3 if dead else 1)
            dur = ttft + rng.randrange(50, 300) * (0.05 if dead else 0.02)
            rec = {
                "k": "req",
                "t": start + t,
                "ep": "chat",
                "pri": "normal",
                "st": True,
                "sid": None,
                "cl": f"{rng.randrange(200):x}",
                "pt": 100,
                "mt": 512,
                "att": [[backend, "answered", 200, None, ttft, dur + 0.001, 0.001]],
                "be": backend,
                "s": 200,
                "o": "complete",
                "ttft": ttft + 0.001,
                "d": dur + 0.002,
                "n": 200,
                "rt": 0,
                "res": False,
                "tier": "failover" if dead else "normal",
            }
            f.write(orjson.dumps(rec) + b"\n")
            n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--out", type=Path, default=None, help="append the result line here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="brownout-replay-speed-"))
    trace = tmp / "trace.jsonl.gz"
    n = write_trace(trace, args.hours, args.rate)
    cand = tmp / "candidate.yaml"
    cand.write_text(CANDIDATE)
    from proxy.replay.trace import Trace

    t0 = time.process_time()
    Trace.load(trace)
    load_s = time.process_time() - t0
    out = run_replay(parse_policy(CANDIDATE, env={}), trace_path=str(trace), freeze=True)
    cpu_s, wall_s = out.report["replay_cpu_s"], out.report["replay_wall_s"]
    per_day = 24 / args.hours * (50.0 / args.rate)
    fid = out.report["fidelity"]
    line = (
        f"replay: {args.hours:g} h at {args.rate:g} req/s ({n:,} requests), baseline and "
        f"candidate: {wall_s:.1f} s wall, {cpu_s:.1f} s CPU (reading the trace {load_s:.1f} "
        f"s of it); {args.hours * 3600 / cpu_s:.0f} recorded seconds per CPU second; a day "
        f"at 50 req/s ≈ {wall_s * per_day:.0f} s wall, {cpu_s * per_day:.0f} s CPU"
        + (f" (fidelity {fid['tier_agreement']:.3f})" if fid else "")
    )
    print(line)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(line + "\n")
    trace.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
