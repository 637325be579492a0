"""A recording, parsed for replay: the requests as they arrived, what each
backend was seen to do, what the ladder did, and the policy in force.

`Trace.load(path)` reads a recording directory, a segment or a download of
`GET /brownout/recording` (`proxy.telemetry.recording` has the format);
`scenarios` builds one without a recording. Records a replay has no use
for are kept out; nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from proxy.policy import Policy, parse_policy
from proxy.telemetry.recording import Reader, read_trace

BACKENDS = ("primary", "fallback")
STALL_FACTOR = 1.8  # a gap between two once-a-second samples this long is a stall


class Attempt(NamedTuple):
    """(NamedTuples: a day of traffic is millions of them, built in C.)"""

    backend: str
    kind: str  # answered | failed | ended | shed | refused | client_gone
    status: int
    fault: str
    ttft: float | None  # upstream call → first event (streams)
    start: float  # trace time
    end: float


class Request(NamedTuple):
    """One recorded request (times relative to the trace's start)."""

    t: float
    priority: str
    stream: bool
    endpoint: str
    client: str
    prompt_tokens: int
    tokens_out: int  # events of the answer (≈ tokens), or max_tokens, or 64
    attempts: tuple[Attempt, ...]
    # What the client got, as recorded.
    backend: str
    status: int
    outcome: str
    ttft: float | None
    duration: float
    rescued: bool
    retries: int
    scale: float = 1.0  # a scenario's latency factor for this request
    session: str = ""  # hashed X-Session-Id: a session's requests follow one another
    # The proxy's own time in the client's TTFT (relay, a busy event loop):
    # the recorded client TTFT less the wait for the backend call and the
    # backend's own TTFT. Replayed as recorded.
    overhead: float = 0.0

    @property
    def shed(self) -> bool:
        return self.outcome.startswith("shed")

    @property
    def maintenance(self) -> bool:
        return self.backend == "maintenance"

    @property
    def intrinsic(self) -> bool:
        """Refused for its own sake (a 4xx, a request that failed on every
        backend while their probes passed): the same under any policy."""
        return self.outcome == "rejected" or (
            400 <= self.status < 500 and self.status != 429 and not self.shed
        )

    @property
    def client_gone(self) -> bool:
        return self.outcome == "client_disconnect"


@dataclass(frozen=True, slots=True)
class Probe:
    t: float
    backend: str
    ok: bool
    definitive: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class EngineSample:
    t: float
    waiting: float
    running: float
    kv: float
    rejections: float


@dataclass(frozen=True, slots=True)
class Cond:
    """A scenario's explicit backend condition from `t` on (see `world`)."""

    t: float
    backend: str
    state: str  # up | down | hung | erroring | slow
    fault: str = ""
    p: float = 1.0  # erroring: share of requests that fail
    factor: float = 1.0  # slow: latency multiplier


@dataclass
class Trace:
    start: float  # wall clock of t = 0
    end: float  # trace time of the last record
    requests: list[Request] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    engine: list[EngineSample] = field(default_factory=list)
    scrape_failures: list[float] = field(default_factory=list)  # /metrics did not answer
    tiers: list[tuple[float, str, str, str]] = field(default_factory=list)  # t, from, to, why
    initial_tier: str = "normal"
    forces: list[tuple[float, str | None]] = field(default_factory=list)
    limits: list[tuple[float, int]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    policies: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    reloads: list[tuple[float, bool, str | None]] = field(default_factory=list)
    conds: list[Cond] = field(default_factory=list)
    # Instants the recorded proxy evaluated its ladder window (what happens
    # only there: a limit change, an open breaker's reset timeout).
    ticks: list[float] = field(default_factory=list)
    exact_ticks: bool = False  # `tick` records: every evaluation's instant
    calls: bool = False  # attempts carry their backend call's instant (after admission)
    models: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario latency models
    gaps: int = 0  # records the recorder dropped
    skipped: int = 0  # unreadable lines
    truncated: int = 0  # segments cut by a crash
    source: str = ""
    synthetic: bool = False

    @property
    def duration(self) -> float:
        return self.end

    def stalls(self, sample_s: float = 1.0) -> list[tuple[float, float]]:
        """Stretches in which the recorded proxy's event loop did not run its
        once-a-second sample (a host too busy, a blocking call): its loops
        (ladder windows, probes, scrapes) did not run either."""
        ts = [s["t"] for s in self.samples]
        return [(a, b) for a, b in itertools.pairwise(ts) if b - a > STALL_FACTOR * sample_s]

    @property
    def recorded_policy(self) -> dict[str, Any] | None:
        """The knobs of the policy in force at the trace's start."""
        return self.policies[0][2] if self.policies else None

    @property
    def policy_hash(self) -> str | None:
        return self.policies[0][1] if self.policies else None

    @classmethod
    def load(cls, path: Path, *, freeze: bool = False) -> Trace:
        """Read a recording. Millions of small tuples, none in a cycle: the
        collector stays off while they are made; `freeze` (the command line,
        whose process ends with the replay) also keeps every later full
        collection from walking them again (`gc.freeze`, process-wide)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            reader = Reader()
            recs = read_trace(path, reader)
            tr = cls.from_records(recs, source=str(path))
            del recs
        finally:
            if enabled:
                gc.enable()
        if freeze:
            gc.freeze()
        tr.skipped, tr.truncated = reader.skipped, reader.truncated
        return tr

    @classmethod
    def from_records(cls, recs: list[dict[str, Any]], source: str = "") -> Trace:
        times = [r["t"] for r in recs if r.get("k") not in ("seg",)]
        if not times:
            raise ValueError(f"{source or 'trace'}: no records")
        t0 = min(times)
        tr = cls(start=t0, end=max(times) - t0, source=source)
        for r in recs:
            k = r.get("k")
            t = float(r["t"]) - t0
            try:
                _add(tr, k, t, r)
            except (KeyError, TypeError, ValueError):
                tr.skipped += 1
        tr.requests.sort(key=lambda q: q.t)
        tr.ticks.sort()
        if tr.requests:
            tr.end = max(tr.end, max(q.t + q.duration for q in tr.requests))
        first_sample = next((s for s in tr.samples), None)
        first_tier = tr.tiers[0] if tr.tiers else None
        if first_tier is not None and (first_sample is None or first_tier[0] <= first_sample["t"]):
            tr.initial_tier = first_tier[1]
        elif first_sample is not None:
            tr.initial_tier = str(first_sample.get("tier", "normal"))
        return tr


def _add(tr: Trace, k: Any, t: float, r: dict[str, Any]) -> None:
    if k == "req":  # most records first
        q = _request(t, r)
        tr.requests.append(q)
        if not tr.calls and q.attempts and len(r["att"][0]) > 6:
            tr.calls = True
    elif k == "tick":
        if not tr.exact_ticks:  # the instants recorded: no need to guess them
            tr.exact_ticks = True
            tr.ticks.clear()
        tr.ticks.append(t)
    elif k == "breaker" and r.get("from") == "open" and r.get("to") == "half-open":
        if not tr.exact_ticks:
            tr.ticks.append(t)
    elif k == "probe":
        tr.probes.append(Probe(t, r["b"], bool(r["ok"]), bool(r.get("def")), r.get("err")))
    elif k == "engine":
        if r.get("err") is None:
            tr.engine.append(
                EngineSample(
                    t, float(r["w"]), float(r["r"]), float(r["kv"]), float(r.get("rej") or 0.0)
                )
            )
        else:
            tr.scrape_failures.append(t)
    elif k == "tier":
        tr.tiers.append((t, r["from"], r["to"], r.get("why", "")))
    elif k == "force":
        tr.forces.append((t, r.get("tier")))
    elif k == "limit":
        tr.limits.append((t, int(r["to"])))
        if not tr.exact_ticks:
            tr.ticks.append(t)
    elif k == "sample":
        tr.samples.append({**r, "t": t})
    elif k == "policy":
        if not tr.policies or tr.policies[-1][1] != r["hash"]:
            tr.policies.append((t, r["hash"], r["knobs"]))
    elif k == "reload":
        tr.reloads.append((t, bool(r["ok"]), r.get("hash")))
    elif k == "gap":
        tr.gaps += int(r.get("dropped", 0))
    elif k == "cond":
        tr.conds.append(
            Cond(
                t,
                r["b"],
                r["state"],
                r.get("fault", ""),
                float(r.get("p", 1.0)),
                float(r.get("factor", 1.0)),
            )
        )
        tr.synthetic = True
    elif k == "model":
        tr.models[r["b"]] = {key: float(v) for key, v in r.items() if key not in ("k", "t", "b")}


def _request(t: float, r: dict[str, Any]) -> Request:
    # Hot (a day of traffic is millions of these): positional, few lookups.
    get = r.get
    atts = []
    prev_end = 0.0
    answered: Attempt | None = None
    for a in get("att") or ():
        end = a[5]
        end = prev_end if end is None else end
        # The backend call began after admission (an older recording: at the
        # end of the attempt before).
        call = a[6] if len(a) > 6 else None
        start = prev_end if call is None else call
        att = Attempt(a[0], a[1], a[2], a[3] or "", a[4], t + start, t + end)
        atts.append(att)
        if a[1] == "answered":
            answered = att
        prev_end = end
    ttft = get("ttft")
    overhead = 0.0
    if answered is not None and answered.ttft is not None and ttft is not None:
        overhead = max(0.0, min(5.0, ttft - (answered.start - t) - answered.ttft))
    n = get("n")
    if not (isinstance(n, int) and n > 0):
        mt = get("mt")
        n = mt if isinstance(mt, int) else 64
    status = get("s", 0)
    if not isinstance(status, int):
        raise TypeError("status")
    return Request(
        t,
        get("pri", "normal"),
        get("st", True) is True,
        get("ep", "chat"),
        get("cl") or "",
        get("pt") or 1,
        n,
        tuple(atts),
        get("be", "none"),
        status,
        get("o", ""),
        ttft,
        float(get("d") or 0.0),
        get("res") is True,
        get("rt") or 0,
        float(get("scale") or 1.0),
        get("sid") or "",
        overhead,
    )


# Sections of the policy a replay needs: the rest (server, sessions, guard,
# FAQ, rollout, recorder) does not change what the control code decides.
_SECTIONS = ("backends.primary.", "backends.fallback.", "ladder.")
_DROPPED = (
    "ladder.shared.",
    "backends.primary.api_key",
    "backends.fallback.api_key",
    "ladder.throttle.key_priorities",
)


def policy_from_knobs(knobs: dict[str, Any], source: str = "<recording>") -> Policy:
    """The recorded policy (its `policy` record's knobs) as a Policy: the
    sections replay uses, secrets and the shared-state URL left out."""
    tree: dict[str, Any] = {}
    for path, value in knobs.items():
        if not path.startswith(_SECTIONS) or path.startswith(_DROPPED):
            continue
        node = tree
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    for name in BACKENDS:
        b = tree.get("backends", {}).get(name)
        if b is not None and "<redacted>" in str(b.get("url", "")):
            b["url"] = "http://recorded.invalid"  # hidden: the replay never connects
    tree["server"] = {"heartbeat_s": 0}  # not replayed; its cross-checks need the rest
    text = yaml.safe_dump(tree, sort_keys=False)
    return parse_policy(text, source, env={})


def with_backends(policy: Policy, like: Policy) -> Policy:
    """`policy` with `like`'s backends where it has none (a candidate file
    written without them still replays against the recorded backends)."""
    if policy.backends.fallback is None and like.backends.fallback is not None:
        return dataclasses.replace(
            policy, backends=dataclasses.replace(policy.backends, fallback=like.backends.fallback)
        )
    return policy
