"""Drill 9, a bad canary: a gray release whose candidate runs out of memory at
the second step, under load (issue 21).

The candidate (`backends.candidate`) is a fault proxy (`tests.chaos.faultproxy`,
its own process) in front of the stack's real vLLM: healthy, its answers are
the engine's own; degraded, it plays an engine out of memory — the streams
it is generating end mid-answer with vLLM's engine error event, new
generation requests get a 500 "CUDA out of memory", its `/health` stays 200.
Why this fault: it
is the brief's stability gate ("OOM and timeouts at 0 %"), it is what a
larger step's load does to an engine sized too tight, and it hits the two
paths that must cost users nothing — a failure before the first byte
(retried on the primary) and a stream cut mid-answer (rescued on the
fallback). A second real engine does not fit next to the stack on this
machine (2 cores); the fault proxy keeps the healthy candidate real.

What the drill measures (`summarize`): time from the degradation to the
rollout's `rolled_back` (the proxy's own time, from its history, and as
polled on `GET /brownout/rollout`), and from the first failure the candidate
served to the rollback; the load's requests that saw an error (goal 0) and
what became of each request the candidate failed; users' requests that still
reached the candidate after the rollback (goal 0); and the bundle in
`snapshot_dir/<rollout-id>/`.

Pure parts (policy text, session spread, figures, verdict) are tested in
tests/chaos/test_badcanary.py; the drill itself is in scenarios.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.control.rollout import bucket
from tests.chaos.drill import ROOT, Load, Req, _die_with_parent, _tail
from tests.harness.procs import free_port, terminate_tree, wait_for_http

__all__ = [
    "BUNDLE_FILES",
    "CANARY_STEPS",
    "Bundle",
    "CanarySummary",
    "CandidateProc",
    "canary_policy",
    "canary_problems",
    "canary_sections",
    "judge_bundle",
    "pick_run_id",
    "read_bundle",
    "spread",
    "summarize",
]

CANARY_STEPS = (0.25, 0.5, 1.0)
BUNDLE_FILES = ("verdict.json", "errors.jsonl", "metrics.prom", "timeline.jsonl")
ROLLBACK_LIMIT_S = 60.0  # the "within one minute, by itself"
# A request routed to the candidate just before the rollback reaches it just
# after: arrivals within this long of the rollback are not counted as routed after it.
ROUTED_GRACE_S = 1.0


# --------------------------------------------------------------------------- the candidate


class CandidateProc:
    """The fault proxy as a process, in front of `upstream` (the real engine);
    switched by `POST /_fault` (see tests.chaos.faultproxy)."""

    def __init__(self, upstream: str, log_path: Path) -> None:
        self.upstream = upstream
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "tests.chaos.faultproxy",
            "--upstream", self.upstream, "--port", str(self.port),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        proc = self.proc
        try:
            wait_for_http(
                self.url + "/_fault", timeout=30, interval=0.1, alive=lambda: proc.poll() is None
            )
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RuntimeError(
                f"the fault proxy did not start: {exc}\n{_tail(self.log_path)}"
            ) from exc

    def stop(self) -> None:
        if self.proc is not None:
            terminate_tree(self.proc.pid, timeout=10.0, reap=self.proc.poll)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None


# --------------------------------------------------------------------------- policy, sessions


def canary_policy(text: str, candidate_url: str, snapshot_dir: Path, step_s: float) -> str:
    """The stack's policy plus `backends.candidate` (the fault proxy, with the
    primary's timeouts) and a `rollout:` section of short steps."""
    candidate, rollout = canary_sections(text, candidate_url, snapshot_dir, step_s)
    at = text.find("\nsessions:\n")
    return text[: at + 1] + candidate + text[at + 1 :].rstrip("\n") + "\n" + rollout


def canary_sections(
    text: str, candidate_url: str, snapshot_dir: Path, step_s: float
) -> tuple[str, str]:
    """What `canary_policy` adds: the candidate's lines (under `backends:`) and
    the `rollout:` section."""
    m = re.search(r"^  primary:\n(?:    .*\n)*?    (timeouts: .*)\n", text, re.M)
    if m is None or "\nsessions:\n" not in text:
        raise RuntimeError("the drill policy no longer has `primary: timeouts:` and `sessions:`")
    candidate = (
        "  candidate:\n"
        f"    url: {candidate_url}\n"
        "    kind: vllm\n"
        "    model: tiny\n"
        f"    {m.group(1)}\n"
        "    health: {interval_s: 0.2, timeout_s: 3}\n"
    )
    steps = ", ".join(f"{s:g}" for s in CANARY_STEPS)
    rollout = f"""rollout:
  steps: [{steps}]
  step_s: {step_s:g}
  sticky: session
  snapshot_dir: "{snapshot_dir}"
  gates:
    # The brief's stability gates: the first OOM or own failure rolls back.
    error_rate_max: 0
    oom_max: 0
    # The candidate is the primary's own engine behind the fault proxy (as
    # fast, give or take a hop): wide ratio limits, so only the fault can roll
    # it back, and no ratio gate holds a step for want of samples.
    ttft_ratio_max: 3
    p99_ratio_max: 3
    min_samples: 10
    window_s: 60
    advance_on: []
"""
    return candidate, rollout


def spread(run_id: str, workers: int, steps: Sequence[float] = CANARY_STEPS) -> list[int]:
    """How many of the steady load's sessions are on the candidate at each step
    (the proxy's own sticky buckets of their `X-Session-Id`)."""
    buckets = [bucket(Load.session_id(run_id, "steady", i)) for i in range(workers)]
    return [sum(1 for b in buckets if b < s) for s in steps]


def spread_ok(counts: Sequence[int], workers: int) -> bool:
    """At least one session on the candidate at the first step (else it has no
    sample and holds), at least two on each arm at the second (the fault hits
    both a candidate under load and a primary that takes the retries)."""
    return counts[0] >= 1 and counts[1] >= 2 and workers - counts[1] >= 2


def pick_run_id(
    workers: int, prefix: str = "d9", new: Callable[[], str] = lambda: uuid.uuid4().hex[:6]
) -> str:
    """A run id whose sessions spread over the arms as `spread_ok` wants. With
    a handful of users a 25 % step can hold none of them (0.75⁸ = 10 % for 8);
    production traffic has thousands. Drawn, not forced: the buckets stay the
    proxy's hash."""
    for _ in range(10_000):
        run_id = f"{prefix}-{new()}"
        if spread_ok(spread(run_id, workers), workers):
            return run_id
    raise RuntimeError(f"no run id spreads {workers} sessions over the steps {CANARY_STEPS}")


# --------------------------------------------------------------------------- the bundle


@dataclass(frozen=True)
class Bundle:
    """What `snapshot_dir/<rollout-id>/` held after the rollback."""

    path: str | None
    sizes: dict[str, int]  # file → bytes, for the files present
    verdict: dict[str, Any]
    errors_lines: int
    errors_by_arm: dict[str, int]
    metrics_rollbacks: dict[str, float]  # gate → brownout_rollout_rollbacks_total
    timeline_events: dict[str, int]  # event → count
    problems: list[str] = field(default_factory=list)


_ROLLBACKS = re.compile(r'^brownout_rollout_rollbacks_total\{gate="([^"]*)"\}\s+(\S+)$', re.M)


def judge_bundle(
    path: str | None, texts: dict[str, str | None], rollout_id: str, gate: str, step: int
) -> Bundle:
    """The bundle's files (name → text, None when missing) checked against the
    rollout it should describe."""
    problems: list[str] = []
    if path is None:
        return Bundle(None, {}, {}, 0, {}, {}, {}, ["no bundle was written"])
    missing = [n for n in BUNDLE_FILES if texts.get(n) is None]
    if missing:
        problems.append(f"bundle files missing: {', '.join(missing)}")
    sizes = {n: len(t.encode()) for n, t in texts.items() if t is not None}
    verdict: dict[str, Any] = {}
    try:
        loaded = json.loads(texts.get("verdict.json") or "")
        verdict = loaded if isinstance(loaded, dict) else {}
    except ValueError:
        problems.append("verdict.json is not JSON")
    if verdict:
        if verdict.get("rollout_id") != rollout_id:
            problems.append(f"verdict.json names rollout {verdict.get('rollout_id')!r}")
        if verdict.get("gate") != gate:
            problems.append(f"verdict.json names gate {verdict.get('gate')!r}, status {gate!r}")
        if verdict.get("step") != step:
            problems.append(f"verdict.json says step {verdict.get('step')!r}, not {step}")
        if not (verdict.get("gates") or {}).get("gates"):
            problems.append("verdict.json has no gate values")
    by_arm: collections.Counter[str] = collections.Counter()
    lines = [ln for ln in (texts.get("errors.jsonl") or "").splitlines() if ln.strip()]
    for ln in lines:
        try:
            by_arm[str(json.loads(ln).get("arm"))] += 1
        except (ValueError, AttributeError):
            problems.append(f"errors.jsonl has a line that is not a JSON object: {ln[:80]!r}")
            break
    rollbacks = {g: float(v) for g, v in _ROLLBACKS.findall(texts.get("metrics.prom") or "")}
    if texts.get("metrics.prom") is not None and not rollbacks.get(gate):
        problems.append(f"metrics.prom has no brownout_rollout_rollbacks_total{{gate={gate!r}}}")
    events: collections.Counter[str] = collections.Counter()
    for ln in (texts.get("timeline.jsonl") or "").splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            events[str(json.loads(ln).get("event"))] += 1
    if texts.get("timeline.jsonl") is not None:
        lacking = [e for e in ("started", "step", "rolled_back") if not events[e]]
        if lacking:
            problems.append(f"timeline.jsonl has no {', '.join(lacking)} event")
    return Bundle(path, sizes, verdict, len(lines), dict(by_arm), rollbacks, dict(events), problems)


def read_bundle(path: str | None, rollout_id: str, gate: str, step: int) -> Bundle:
    texts: dict[str, str | None] = {}
    if path is not None:
        for name in BUNDLE_FILES:
            try:
                texts[name] = (Path(path) / name).read_text(errors="replace")
            except OSError:
                texts[name] = None
    return judge_bundle(path, texts, rollout_id, gate, step)


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class CanarySummary:
    """What drill 9 reports (times: wall clock, seconds)."""

    rollout_id: str
    state: str
    failed_gate: str
    gate_detail: str
    rolled_back_step: int | None
    steps_taken: list[tuple[float, int, float]]  # (at, step, share) as the proxy logged them
    degraded_at: float | None
    rolled_back_at: float | None  # the proxy's own time (its rollout history)
    polled_at: float | None  # first seen `rolled_back` on GET /brownout/rollout
    first_failure_at: float | None  # the candidate's first failed request (fault proxy)
    spread: list[int]  # sessions on the candidate per step
    workers: int
    candidate_failed: dict[str, int]  # the load's requests: "oom" / "cut" → count
    probes_failed: int  # other generation requests it failed (the proxy's own probes)
    failed_outcomes: dict[str, int]  # what the clients got for those requests
    users_after_rollback: int  # the load's requests the candidate got after the rollback
    arms: dict[str, dict[str, int]]  # stretch → X-Brownout-Backend → requests sent in it
    saw_error: int  # the load's requests with an error, truncated or hung
    bundle: Bundle | None
    policy_added: str = ""  # the candidate's and the rollout's policy lines

    @property
    def rollback_s(self) -> float | None:
        if self.rolled_back_at is None or self.degraded_at is None:
            return None
        return self.rolled_back_at - self.degraded_at

    @property
    def polled_s(self) -> float | None:
        if self.polled_at is None or self.degraded_at is None:
            return None
        return self.polled_at - self.degraded_at

    @property
    def first_failure_s(self) -> float | None:
        if self.first_failure_at is None or self.degraded_at is None:
            return None
        return self.first_failure_at - self.degraded_at

    @property
    def detect_to_rollback_s(self) -> float | None:
        if self.rolled_back_at is None or self.first_failure_at is None:
            return None
        return self.rolled_back_at - self.first_failure_at


def _rid(r: Req) -> str:
    return f"{r.session}-{r.n}"


def _fate(r: Req) -> str:
    if r.outcome == "complete":
        if r.rescued:
            return f"complete, rescued mid-stream (X-Brownout-Backend {r.backend})"
        return f"complete from the {r.backend or '?'}"
    return f"{r.outcome}" + (f" ({r.code})" if r.code else "")


def summarize(
    rollout: dict[str, Any],
    fault: dict[str, Any],
    records: Sequence[Req],
    *,
    run_id: str,
    workers: int,
    degraded_at: float | None,
    polled_at: float | None,
    bundle: Bundle | None,
    policy_added: str = "",
) -> CanarySummary:
    """`rollout`: the final GET /brownout/rollout; `fault`: the fault proxy's
    report; `records`: every request of the load (the whole drill)."""
    history = rollout.get("history") or []
    rolled = [h for h in history if h.get("change") == "rolled_back"]
    rolled_back_at = float(rolled[-1]["at"]) if rolled else None
    steps = [
        (float(h["at"]), int(h["step"]), float(h["share"]))
        for h in history
        if h.get("change") in ("started", "step")
    ]
    mine = run_id + "-"
    failed = [s for s in fault.get("seen") or [] if s.get("action") != "passed"]
    users = [s for s in failed if str(s.get("request_id", "")).startswith(mine)]
    by_rid = {_rid(r): r for r in records}
    fates = collections.Counter(
        _fate(by_rid[s["request_id"]]) if s["request_id"] in by_rid else "not in the load's records"
        for s in users
    )
    after = (
        [
            s
            for s in fault.get("seen") or []
            if str(s.get("request_id", "")).startswith(mine)
            and float(s["at"]) > rolled_back_at + ROUTED_GRACE_S
        ]
        if rolled_back_at is not None
        else []
    )
    stretches: list[tuple[str, float, float]] = []
    for i, (at, step, share) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else (rolled_back_at or float("inf"))
        stretches.append((f"step {step + 1} ({share:.0%})", at, end))
    if rolled_back_at is not None:
        stretches.append(("after the rollback", rolled_back_at, float("inf")))
    arms: dict[str, dict[str, int]] = {}
    for name, a, b in stretches:
        # By the time the request was sent: its arm was chosen then (a stream
        # rescued after the rollback still says `candidate`, its first arm).
        c = collections.Counter(r.backend or "?" for r in records if a <= r.started < b)
        arms[name] = dict(sorted(c.items()))
    return CanarySummary(
        rollout_id=str(rollout.get("id") or ""),
        state=str(rollout.get("state")),
        failed_gate=str(rollout.get("failed_gate") or ""),
        gate_detail=str(rolled[-1].get("detail") or "") if rolled else "",
        rolled_back_step=int(rolled[-1]["step"]) if rolled else None,
        steps_taken=steps,
        degraded_at=degraded_at,
        rolled_back_at=rolled_back_at,
        polled_at=polled_at,
        first_failure_at=min((float(s["failed_at"]) for s in failed), default=None),
        spread=spread(run_id, workers),
        workers=workers,
        candidate_failed=dict(collections.Counter(str(s["action"]) for s in users)),
        probes_failed=len(failed) - len(users),
        failed_outcomes=dict(fates),
        users_after_rollback=len(after),
        arms=arms,
        saw_error=sum(1 for r in records if r.outcome in ("error", "truncated", "hung")),
        bundle=bundle,
        policy_added=policy_added,
    )


def canary_problems(s: CanarySummary) -> list[str]:
    """Drill 9's rules: rolled back by itself at the second step within a
    minute of the fault, no user saw an error, none went to the candidate
    afterwards, the bundle is whole and consistent."""
    out: list[str] = []
    if s.degraded_at is None:
        reached = max((st for _, st, _ in s.steps_taken), default=-1) + 1
        out.append(
            f"the candidate was never degraded: the rollout reached step {reached} of "
            f"{len(CANARY_STEPS)}, state {s.state}"
            + (f" ({s.failed_gate}: {s.gate_detail})" if s.failed_gate else "")
        )
    if s.state != "rolled_back" or s.rolled_back_at is None:
        out.append(f"the rollout was not rolled back (state {s.state})")
    elif s.degraded_at is not None and s.rolled_back_at < s.degraded_at:
        out.append(
            f"a healthy candidate was rolled back before the fault ({s.failed_gate}: "
            f"{s.gate_detail})"
        )
    else:
        if s.rolled_back_step != 1:
            out.append(f"rolled back at step {s.rolled_back_step}, not the second (index 1)")
        if s.rollback_s is not None and s.rollback_s > ROLLBACK_LIMIT_S:
            out.append(f"the rollback took {s.rollback_s:.1f} s (limit {ROLLBACK_LIMIT_S:.0f} s)")
    if s.saw_error:
        out.append(f"{s.saw_error} of the load's requests saw an error (goal 0)")
    bad = {k: v for k, v in s.failed_outcomes.items() if not k.startswith("complete")}
    if bad:
        out.append(f"requests the candidate failed that did not end complete: {bad}")
    if s.users_after_rollback:
        out.append(
            f"{s.users_after_rollback} of the load's requests reached the candidate after "
            "the rollback"
        )
    if s.bundle is not None:
        out.extend(s.bundle.problems)
    elif s.state == "rolled_back":
        out.append("no bundle was read")
    return out
