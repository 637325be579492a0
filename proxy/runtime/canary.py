"""A running gray release (issue 21): the rollout and its gates, wired to the
requests that pass, the evaluation loop, the rollback bundle and the saved
state.

Per request (only while a rollout runs): one hash for the sticky bucket at
routing (none for a request that cannot go to the candidate), one
`Gates.observe` at the finish. A candidate failure counts
against it when it is its own: definitive (refused, engine death, OOM), a
stream it cut mid-answer, or a failure before the first byte of a request
that another backend then answered — the same request was fine elsewhere,
so no client can roll a good candidate back by sending what no engine
takes (that fails everywhere: the request's problem).

Each window (`tick`): the candidate's health and breaker, then the gates;
a failing gate rolls back at once, passing gates let the step advance.
Rolled back: `snapshot_dir/<rollout-id>/` gets `verdict.json`,
`errors.jsonl`, `metrics.prom`, `timeline.jsonl` and, while the flight
recorder runs, `recording.jsonl` (its last ten minutes, replayable with
`brownout replay --trace`), written off the loop into
a temporary directory renamed into place (atomic); a write that fails is
shown in status (`bundle_error`), never raised.

`errors.jsonl`: each arm's last `ERRORS_KEPT` failures. A failed attempt is
recorded the moment the outcome inbox learns of it (`attempt_failed`), not
when its request ends: a request that failed on the candidate and is still
being answered by the primary when the health gate (the candidate's /health,
its breaker) rolls back is in the bundle. The request's end completes its
record (`answered_by`, `client_status`, `outcome`, `counted`); a record still
in flight at the rollback shows them as null. The bundle is the evidence at
the rollback moment, built then and written once: a failure known only after
the rollback (an attempt cut as the candidate goes down) is not added to it
(it is in the access log, by request id).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import Callable, Coroutine
from hashlib import blake2b
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import hdrs
from multidict import istr

from proxy.control.attribution import DEFINITIVE, classify
from proxy.control.gates import GateReport, Gates, GateValue
from proxy.control.rollout import (
    RUNNING,
    STATE_VALUES,
    Action,
    Rollout,
    RolloutEvent,
    bucket,
    random_bucket,
)
from proxy.openai.auth import bearer_token
from proxy.policy import Policy, PolicyError
from proxy.policy.evalset import evalset_path, load_evalset
from proxy.runtime.evalrun import run_eval
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.recorder import FLUSH_S as RECORDER_FLUSH_S
from proxy.telemetry.recording import window

if TYPE_CHECKING:
    from proxy.backends.upstream import Upstream
    from proxy.pipeline.record import RequestRecord, Terminal

log = structlog.get_logger("brownout.rollout")

STATE_FILE = "state.json"
ERRORS_KEPT = 200  # error records per arm kept for the bundle
BUNDLE_RECORDING_S = 600.0  # the flight recording's last minutes in a bundle
TIMELINE_KEPT = 5000
OPEN_KEPT = 2 * ERRORS_KEPT  # error records of requests not finished yet


class Canary:
    def __init__(
        self,
        policy: Policy,
        clock: Callable[[], float],
        metrics: Metrics,
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
        publish: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        rp = policy.rollout
        self.policy = rp
        # The flight recorder's directory: a bundle carries its last minutes.
        self.recording = Path(policy.recorder.dir) if policy.recorder.enabled else None
        self.clock = clock
        self.metrics = metrics
        self.spawn = spawn
        self.publish = publish  # to the other replicas (ladder.shared)
        self._following = False
        self._eval_path = evalset_path(policy)
        self._eval_due = False  # at the start and at each step (both arms)
        self._eval_running = False
        self.evals: dict[str, dict[str, Any]] = {}
        self.dir = Path(rp.snapshot_dir)
        self.rollout = Rollout(rp, clock, self._on_event, wall=time.time)
        self.gates = Gates(rp.gates, quality_required=rp.eval is not None)
        self.errors: dict[str, collections.deque[dict[str, Any]]] = {
            "primary": collections.deque(maxlen=ERRORS_KEPT),
            "candidate": collections.deque(maxlen=ERRORS_KEPT),
        }
        # Request id → its error records not completed by its finish yet.
        self._open: dict[str, list[dict[str, Any]]] = {}
        self.timeline: collections.deque[dict[str, Any]] = collections.deque(maxlen=TIMELINE_KEPT)
        self.report: GateReport | None = None
        self.bundles: list[str] = []
        self.bundle_error: str | None = None
        self.state_error: str | None = None
        # The sticky key's header, found once per policy (not per request).
        sticky = rp.sticky
        # (An `istr`: multidict looks it up without case-folding it per request.)
        self._key_header: str | None = (
            istr("X-Session-Id")
            if sticky == "session"
            else istr(sticky[7:])
            if sticky.startswith("header:")
            else None
        )
        self._key_is_api_key = sticky == "api_key"
        self._joined = frozenset(rp.priorities)  # `Rollout.cut`'s joined priorities
        self._wall_offset = time.time() - clock()

    # -- per request ---------------------------------------------------------------

    def bucket_of(self, rec: RequestRecord) -> float:
        name = self._key_header
        if name is not None:
            key = rec.request.headers.get(name)
        elif self._key_is_api_key:
            key = bearer_token(rec.request.headers.get(hdrs.AUTHORIZATION))
        else:
            key = None
        # No key (a request without a session id, say): a bucket of its own.
        return bucket(key) if key else random_bucket()

    def wants_candidate(self, rec: RequestRecord) -> bool:
        """Whether `rec` goes to the candidate now: its bucket below the cut.
        (`bucket_of` and `bucket`, inline: this runs on every request while
        routing; a request that cannot go is not hashed.)"""
        ro = self.rollout
        # `Rollout.cut`, inline: the cuts are set when the step changes.
        joined = rec.priority in self._joined
        cut = ro.cut_joined if joined else ro.cut_other
        if cut <= 0.0:
            return False
        name = self._key_header
        if name is not None:
            key = rec.request.headers.get(name)
        elif self._key_is_api_key:
            key = bearer_token(rec.request.headers.get(hdrs.AUTHORIZATION))
        else:
            key = None
        if not key:
            return random_bucket() < cut
        # `bucket(key) < cut` as bytes: the digest against the cut's bound
        # (`rollout.below`, made when the step changed).
        digest = blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return digest < (ro.below_joined if joined else ro.below_other)

    def maybe_mirror(self, rec: RequestRecord, cand: Upstream) -> None:
        """The mirror state: a share of live requests is copied to the
        candidate; its answer is measured and thrown away (no user sees it)."""
        if random_bucket() < self.policy.mirror:
            self.spawn(self._mirror(rec.body, rec.stream, cand), "rollout_mirror")

    async def _mirror(self, body: dict[str, Any], stream: bool, cand: Upstream) -> None:
        payload = dict(body)
        if cand.policy.model:
            payload["model"] = cand.policy.model
        headers = {"Authorization": cand.auth_header} if cand.auth_header else None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ttft: float | None = None
        status = 0
        text = b""
        try:
            async with asyncio.timeout(cand.policy.timeouts.total_s):
                async with cand.session.post(
                    cand.chat_url, json=payload, headers=headers, allow_redirects=False
                ) as resp:
                    status = resp.status
                    async for data in resp.content.iter_any():
                        if ttft is None:
                            ttft = loop.time() - t0
                        if len(text) < 4096:
                            text += data[:4096]
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, text = 599, type(exc).__name__.encode()
        now = self.clock()
        if self.rollout.state != "mirror":
            return
        if status >= 500:
            v = classify(f"http_{status}", status, text)
            hard = self.gates.observe(
                "candidate", now, latency_s=None, ttft_s=None, failed=True, oom=v.fault == "oom"
            )
            self.errors["candidate"].append(
                {
                    "at": round(time.time(), 3),
                    "arm": "candidate",
                    "mirror": True,
                    "status": status,
                    "fault": v.fault,
                    "detail": text[:200].decode("utf-8", "replace"),
                }
            )
            if hard is not None:
                self.roll_back(hard)
            return
        if 200 <= status < 300:
            self.gates.observe(
                "candidate", now, latency_s=loop.time() - t0, ttft_s=ttft if stream else None
            )

    def attempt_failed(
        self, rid: str, arm: str, status: int, fault: str, detail: str, attribution: str
    ) -> None:
        """A failed attempt of request `rid` on `arm`, recorded for the bundle
        the moment it is known (the outcome inbox calls this; the gates judge
        the request at its finish). Not a sample: no gate sees it."""
        ring = self.errors.get(arm)
        if ring is None or self.rollout.state not in RUNNING:
            return
        # A primary failure never counts; a definitive candidate one always
        # does; any other waits for the request's end (answered elsewhere?).
        counted: bool | None = None
        if arm != "candidate":
            counted = False
        elif fault in DEFINITIVE:
            counted = True
        entry: dict[str, Any] = {
            "at": round(time.time(), 3),
            "request_id": rid,
            "arm": arm,
            "status": status,
            "fault": fault,
            "detail": detail[:500],
            "attribution": attribution,
            "answered_by": None,
            "client_status": None,
            "outcome": None,
            "counted": counted,
        }
        ring.append(entry)
        opened = self._open.get(rid)
        if opened is None:
            if len(self._open) >= OPEN_KEPT:  # a request that never finished
                del self._open[next(iter(self._open))]
            opened = self._open[rid] = []
        opened.append(entry)

    def finished(self, rec: RequestRecord, term: Terminal, elapsed: float) -> None:
        """One request's end, while a rollout runs: the gates' sample."""
        opened = self._open.pop(rec.rid, None) if self._open else None
        if not self.rollout.running:
            return
        if opened:
            for entry in opened:  # its failed attempts, recorded when they failed
                entry["answered_by"] = term.backend
                entry["client_status"] = term.status
                entry["outcome"] = term.outcome
        now = self.clock()
        fault = rec.candidate_fault
        arm = term.backend
        if self.rollout.state == "mirror" and arm != "primary":
            return
        if fault:
            # Its answer started and then failed (rescued or not), or the same
            # request was answered elsewhere: the candidate's own failure.
            own = (
                fault in DEFINITIVE
                or arm == "candidate"
                or (term.status < 400 and not term.stream_error)
            )
            self._error(rec, "candidate", term, fault, opened, counted=own)
            if own:
                hard = self.gates.observe(
                    "candidate", now, latency_s=None, ttft_s=None, failed=True, oom=fault == "oom"
                )
                if hard is not None:
                    self.roll_back(hard)
            return
        if arm not in ("primary", "candidate"):
            return
        if term.status >= 500 or term.stream_error:
            fault = term.stream_error or f"http_{term.status}"
            self._error(rec, arm, term, fault, opened, counted=False)
        if term.status >= 400 or term.outcome == "client_disconnect":
            return  # no latency sample: not an answer
        self.gates.answered(arm, now, elapsed, term.client_ttft if rec.stream else None)  # type: ignore[arg-type]

    def _error(
        self,
        rec: RequestRecord,
        arm: str,
        term: Terminal,
        fault: str,
        opened: list[dict[str, Any]] | None,
        *,
        counted: bool,
    ) -> None:
        """The request's failure on `arm`: its attempt's record completed
        (recorded when it failed), else a record of the request's end."""
        mine = [e for e in opened or () if e["arm"] == arm]
        if mine:
            for entry in mine:
                entry["counted"] = counted
            return
        self.errors[arm].append(
            {
                "at": round(time.time(), 3),
                "request_id": rec.rid,
                "arm": arm,
                "status": term.status,
                "fault": fault,
                "detail": term.detail,
                "attribution": None,
                "answered_by": term.backend,
                "client_status": term.status,
                "outcome": term.outcome,
                "counted": counted,
            }
        )

    # -- each window -----------------------------------------------------------------

    def tick(self, cand: Upstream | None, primary: Upstream | None = None) -> None:
        ro = self.rollout
        if ro.state not in RUNNING:
            return
        now = self.clock()
        if self._eval_due and not self._eval_running and primary is not None and cand is not None:
            self._eval_due = False
            self._eval_running = True
            self.spawn(self._run_eval(primary, cand), "rollout_eval")
        if cand is None:
            self.roll_back(self.gates.unhealthy(now, "backends.candidate is gone"))
            return
        if cand.down or cand.breaker.state == "open":
            why = (
                cand.health.last_error if cand.down else f"breaker open: {cand.breaker.last_reason}"
            )
            # The gate says "candidate unhealthy: …" itself.
            self.roll_back(self.gates.unhealthy(now, why or "health check failed"))
            return
        report = self.gates.evaluate(now)
        self.report = report
        self._gauges(report)
        if report.failed is not None:
            self.roll_back(report.failed)
            return
        self._timeline("gates", now, report=report.as_dict())
        ro.tick(now, self._ready(report) or self._last_step_without_baseline(report))

    def _ready(self, report: GateReport) -> bool:
        """Every gate passes, but a ratio gate left out of `gates.advance_on`,
        which may still wait (it rolls back only when confidently failing)."""
        optional = {"ttft_ratio", "p99_ratio"} - set(self.policy.gates.advance_on)
        return report.failed is None and all(
            g.verdict == "pass" or (g.gate in optional and g.verdict == "wait")
            for g in report.gates
        )

    def _last_step_without_baseline(self, report: GateReport) -> bool:
        """At the last step (all eligible traffic on the candidate) the primary
        may get too little traffic to compare with once the earlier steps'
        samples have left the window: a ratio gate that waits only for the
        baseline does not hold the rollout there (the hard gates still judge)."""
        ro = self.rollout
        if ro.state != "step" or ro.step < len(ro.policy.steps) - 1:
            return False
        need = ro.policy.gates.min_samples
        if report.samples.get("candidate", 0) < need:
            return False
        return all(
            g.verdict == "pass"
            or (
                g.gate in ("ttft_ratio", "p99_ratio")
                and g.verdict == "wait"
                and report.samples.get("primary", 0) < need
            )
            for g in report.gates
        )

    async def _run_eval(self, primary: Upstream, cand: Upstream) -> None:
        """The eval set against both arms (low priority, never shown to users);
        its scores are the quality gate's."""
        try:
            path = self._eval_path
            if path is None:
                return
            try:
                evalset = await asyncio.to_thread(load_evalset, path)
            except (PolicyError, OSError) as exc:
                self.evals["error"] = {"error": str(exc)}
                log.error("rollout_eval_unreadable", path=str(path), error=str(exc))
                return
            t = self.policy.eval_timeout_s
            base, new = await asyncio.gather(
                run_eval(evalset, primary, timeout_s=t), run_eval(evalset, cand, timeout_s=t)
            )
            now = self.clock()
            for arm, result in (("primary", base), ("candidate", new)):
                self.gates.quality(arm, result.passed, result.total, now)  # type: ignore[arg-type]
                self.evals[arm] = result.as_dict()
            self._timeline("eval", now, primary=base.score, candidate=new.score)
            log.info(
                "rollout_eval", primary=base.score, candidate=new.score, step=self.rollout.step
            )
        finally:
            self._eval_running = False

    def roll_back(self, gate: GateValue) -> None:
        ro = self.rollout
        now = self.clock()
        ev = ro.rollback(now, gate.gate, gate.detail or f"{gate.gate} failed")
        if ev is None:
            return
        self.metrics.rollout_rollbacks.labels(gate.gate).inc()
        report = self.gates.evaluate(now)
        self.report = report
        self._gauges(report)
        verdict = {
            "rollout_id": ro.rollout_id,
            "gate": gate.gate,
            "detail": gate.detail,
            "value": gate.value,
            "limit": gate.limit,
            "arms": gate.arms,
            "step": ro.step,
            "share": ro.policy.steps[ro.step],
            "rolled_back_at": self._wall(now),
            "started_at": self._wall(ro.started_at) if ro.started_at is not None else None,
            "gates": report.as_dict(),
        }
        files = {
            "verdict.json": json.dumps(verdict, indent=2, default=str) + "\n",
            "errors.jsonl": "".join(
                json.dumps(e, default=str) + "\n" for arm in self.errors.values() for e in arm
            ),
            "metrics.prom": self.metrics.exposition().decode("utf-8", "replace"),
            "timeline.jsonl": "".join(json.dumps(t, default=str) + "\n" for t in self.timeline),
        }
        self.spawn(self._write_bundle(ro.rollout_id or "rollout", files), "rollout_bundle")

    async def _write_bundle(self, rid: str, files: dict[str, str]) -> None:
        recording = self.recording
        try:
            if recording is not None:
                # The flight recorder's last minutes (it flushes once a second).
                await asyncio.sleep(RECORDER_FLUSH_S)
                now = time.time()
                files["recording.jsonl"] = await asyncio.to_thread(
                    lambda: b"".join(window(recording, now - BUNDLE_RECORDING_S, now)).decode()
                )
            path = await asyncio.to_thread(write_bundle, self.dir, rid, files)
        except OSError as exc:
            self.bundle_error = f"{type(exc).__name__}: {exc}"
            log.error("rollout_bundle_failed", dir=str(self.dir), error=self.bundle_error)
            return
        self.bundle_error = None
        self.bundles.append(str(path))
        log.warning("rollout_bundle_written", path=str(path))

    # -- operator ----------------------------------------------------------------------

    def act(self, action: Action) -> str:
        why = self.rollout.act(action, self.clock())
        if not why and action in ("start", "resume"):
            self.gates.reset()
        if not why and action == "start":
            # A new rollout's bundle holds its own errors, not an earlier one's.
            for ring in self.errors.values():
                ring.clear()
            self._open.clear()
        return why

    # -- events, state, status ------------------------------------------------------------

    def _on_event(self, ev: RolloutEvent) -> None:
        if ev.kind in ("started", "step", "mirror_done") and self._eval_path is not None:
            self._eval_due = True
        self.metrics.rollout_state.set(STATE_VALUES[ev.state])
        self.metrics.rollout_share.set(ev.share)
        self._timeline(
            ev.kind, ev.at, state=ev.state, step=ev.step, share=ev.share, detail=ev.detail
        )
        level = log.warning if ev.kind == "rolled_back" else log.info
        level(
            "rollout_changed",
            rollout_id=self.rollout.rollout_id,
            change=ev.kind,
            state=ev.state,
            step=ev.step,
            share=ev.share,
            gate=ev.gate or None,
            detail=ev.detail or None,
        )
        self.save()
        if self.publish is not None and not self._following:
            self.publish(self.rollout.to_state())

    def _timeline(self, kind: str, at: float, **data: Any) -> None:
        self.timeline.append({"at": self._wall(at), "event": kind, **data})

    def _gauges(self, report: GateReport) -> None:
        g = self.metrics.rollout_gate_value
        for v in report.gates:
            if v.value is not None:
                g.labels(v.gate, "ratio").set(v.value)
            for arm, x in v.arms.items():
                if x is not None:
                    g.labels(v.gate, arm).set(x)

    def _wall(self, t: float) -> float:
        return round(t + self._wall_offset, 3)

    def save(self) -> None:
        """The rollout's state to `snapshot_dir/state.json` (off the loop)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (unit tests of the machine alone)
        self.spawn(self._save(json.dumps(self.rollout.to_state())), "rollout_state")

    async def _save(self, data: str) -> None:
        try:
            await asyncio.to_thread(write_atomic, self.dir / STATE_FILE, data)
            self.state_error = None
        except OSError as exc:
            self.state_error = f"{type(exc).__name__}: {exc}"
            log.error("rollout_state_not_saved", dir=str(self.dir), error=self.state_error)

    def follow(self, remote: dict[str, Any]) -> None:
        """Another replica changed the rollout (a step, a rollback, an action):
        this one takes the same state and step."""
        ro = self.rollout
        before = (ro.rollout_id, ro.state, ro.step)
        self._following = True
        try:
            self.restore(remote)
        finally:
            self._following = False
        if (ro.rollout_id, ro.state, ro.step) != before:
            self._timeline("followed", self.clock(), state=ro.state, step=ro.step)
            log.warning("rollout_followed", rollout_id=ro.rollout_id, state=ro.state, step=ro.step)
            self.save()

    def restore(self, saved: dict[str, Any]) -> None:
        self.rollout.restore(saved, self.clock())
        self.metrics.rollout_state.set(STATE_VALUES[self.rollout.state])
        self.metrics.rollout_share.set(self.rollout.share)

    def adopt(self, prev: Canary, same_candidate: bool) -> None:
        """A reload: the same candidate keeps its rollout (its step and the
        time spent on it; new gate thresholds apply); another starts over."""
        if not same_candidate or prev.policy.steps != self.policy.steps:
            return
        self.rollout.restore(prev.rollout.to_state(), self.clock())
        self.rollout.history = prev.rollout.history
        self.rollout.started_at = prev.rollout.started_at
        self.errors, self.timeline, self._open = prev.errors, prev.timeline, prev._open
        self.bundles = prev.bundles

    def snapshot(self) -> dict[str, Any]:
        snap = self.rollout.snapshot()
        snap["gates"] = self.report.as_dict() if self.report is not None else None
        snap["bundles"] = list(self.bundles)
        snap["eval"] = dict(self.evals) or None
        snap["bundle_error"] = self.bundle_error
        snap["state_error"] = self.state_error
        snap["snapshot_dir"] = str(self.dir)
        snap["history"] = [
            {
                "at": self._wall(e.at),
                "change": e.kind,
                "step": e.step,
                "share": e.share,
                "detail": e.detail,
                "gate": e.gate or None,
            }
            for e in self.rollout.history[-20:]
        ]
        return snap


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_bundle(root: Path, rid: str, files: dict[str, str]) -> Path:
    """`root/<rid>/` with `files`, all or nothing: written into a temporary
    directory, then renamed into place (`<rid>.2`, ... if taken)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{rid}.{os.getpid()}.tmp"
    tmp.mkdir()
    for name, text in files.items():
        (tmp / name).write_text(text)
    final = root / rid
    n = 1
    while final.exists():
        n += 1
        final = root / f"{rid}.{n}"
    os.rename(tmp, final)
    return final


def read_state(root: Path) -> dict[str, Any] | None:
    """The saved rollout state, or None (absent or unreadable)."""
    try:
        data = json.loads((root / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
