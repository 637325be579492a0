"""The backends as a recording saw them: a model each replay asks instead of
a socket.

**Condition over time.** Each backend's timeline is a series of segments,
each `up`, `down` (requests fail at once: refused, or an engine error),
`hung` (requests get nothing until the hang ends), `erroring` (a share `p`
of requests fail) or `slow` (time to the first token × `factor`). It is inferred from the
evidence the recording holds: every attempt of every request (an answer is
`up` at its start and end; a refused connection or a 5xx before the first
byte is `down` at its start; a first-byte timeout is `hung` from its start;
a stream cut mid-answer is `down` from the instant it was cut) and every
health probe (ok: up; refused or 503: down; a timeout: hung). Evidence is
taken in time order; a state changes half-way between the last evidence of
the old state and the first of the new (at the very instant for a cut),
except a lone failure between two successes within
`SPORADIC_S`, which counts into the background error share of its
`ERROR_BIN_S` bin (`erroring`) instead. Attempts of requests refused for
their own sake (4xx, failed on every backend) are no evidence at all.
A hang the requests saw (a first-byte timeout, a stream silent for
`idle_s`: hung from its last byte) lasts until a request is answered again
(`_hangs`): a health endpoint may pass while the engine is stopped, so a
passing health probe does not end it; a half-open breaker's trial that
waited (`recovery_probe`: the 1-token chat) marks where it ended.
A synthetic scenario states its segments (`cond` records) instead.

A request in flight when its backend goes `down` is cut at that instant (a
stream mid-answer ends with an error: the pipeline's rescue, or before
its first byte: a failure); one caught by a `hung` stretch waits it out,
and fails once it outlasts the policy's `first_byte_s` (before the first
byte) or `idle_s` (mid-answer) — the replayed policy's timeouts, not the
recorded ones.

**Health probes** answer what the recorded probe nearest in time answered
(probes do not depend on the policy), else what the segment implies.

**Load model.** Latency depends on how many requests the backend has in
flight (`n`, counting the new one). From the recorded attempts the model
takes each backend's concurrency at every attempt's start and fits two
curves over `n`: the median TTFT, and the median decode time per output
token, made non-decreasing (more load is never faster). Beyond the largest
`n` observed they grow linearly: at least by the mean service time ÷ the
engine's capacity per extra request once `n` exceeds it (a queue: each
request ahead waits for a slot), the capacity being vLLM's largest
`num_requests_running` in the pressure samples (else the largest `n`
seen). A request the recording answered on that backend keeps its own
latency, moved by curve(n_replay) − curve(n_recorded) (additive: a queue
adds waiting time, and a ratio of small medians would explode); any other
gets curve(n) plus the residual (observed − curve) of the nearest recorded
answer in time, so slow stretches stay slow. vLLM's gauges for the
throttle are the nearest recorded scrape's, moved by the difference between
the replay's requests in flight and the recorded proxy's around that scrape
(more fill `running` up to the capacity, then `waiting`; fewer leave
`waiting` first): with a count the recorded proxy had within
`GAUGE_SLACK_S` of the scrape, the replay reads what the proxy read. (A
scrape's record is written when its answer is in, the engine read its
count a round trip earlier, and an engine's count lags the proxy's — a
request sent but not yet taken in, an answer relayed still counted; the
replay sends a request when it is admitted, the proxy a fraction of a
millisecond later. Near the marks one request decides a window.) The KV
cache moves from its recorded value by the fitted KV-per-running-request
slope. Without scrapes, `running` = min(n, capacity) and `waiting` the rest.

**Limits.** The curves are only as good as the load the recording saw: a
policy admitting far more than was ever admitted is extrapolated (linear
queueing, no preemption, no KV-cache thrashing); prefill cost by prompt
length, prefix caching and the fallback's own queue (its 503s) are not
modelled beyond what the latencies already show; a failure mode the
recording never exercised (the fallback failing while it was not used)
cannot be known and is taken as `up`; sporadic errors are drawn at
random (seeded). The proxy's ~1 ms of own work is ignored.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import itertools
import marshal
import math
import pickle
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import and_, itemgetter, sub
from typing import NamedTuple

from proxy.replay.trace import BACKENDS, Attempt, Cond, EngineSample, Probe, Request, Trace

SPORADIC_S = 2.0
ERROR_BIN_S = 10.0
CONNECT_FAIL_S = 0.002  # a refused connection answers at once
MIN_TTFT_S = 0.001
# An attempt that ended this soon after another began was handing its slot
# over (the proxy stamps an attempt's end after it released its admission
# slot, and the next waiter may call the backend first): not in flight with it.
HANDOVER_S = 0.003
# A streamed answer whose first event came this late in its whole time came
# in one piece (buffered): its time to the first token and its decode rate
# are not observed, and the curves are fitted without it.
ONE_PIECE = 0.8
# A scrape's reading and the recorded proxy's count this far apart in time
# are not ordered by the replay (see the module text).
GAUGE_SLACK_S = 0.005
DEFAULTS = {"ttft_s": 0.5, "tpot_s": 0.05, "capacity": 4.0, "error_s": 0.01}

# Evidence classes.
OK, REFUSED, ERROR, HANG, CUT = "ok", "refused", "error", "hang", "cut"
_STATE = {OK: "up", REFUSED: "down", ERROR: "down", HANG: "hung", CUT: "down"}
_FAULT = {REFUSED: "connect", ERROR: "http_500", HANG: "first_byte_timeout", CUT: "upstream_error"}


@dataclass(frozen=True, slots=True)
class Segment:
    start: float
    state: str  # up | down | hung | erroring | slow
    fault: str = ""
    p: float = 0.0
    factor: float = 1.0


_new = tuple.__new__


class Outcome(NamedTuple):
    """What one attempt does: `ok` (answered), `fail` (before the first
    byte), `cut` (mid-answer)."""

    kind: str
    first: float | None  # trace time of the first byte
    end: float
    fault: str = ""
    status: int = 200


class Curve:
    """A non-decreasing median per concurrency level, extrapolated linearly."""

    def __init__(self, points: dict[int, list[float]], floor_slope: float, default: float) -> None:
        levels = sorted(n for n, v in points.items() if v)
        self.values: list[float] = []
        if not levels:
            self.values = [default]
            self.top = 1
            self.slope = floor_slope
            return
        med = _pava({n: statistics.median(points[n]) for n in levels}, points)
        self.top = levels[-1]
        running = 0.0
        for n in range(1, self.top + 1):
            if n in med:
                v = med[n]
            else:  # interpolate between the observed levels around n
                lo = max((m for m in levels if m < n), default=levels[0])
                hi = min((m for m in levels if m > n), default=levels[-1])
                v = med[lo] if hi == lo else med[lo] + (med[hi] - med[lo]) * (n - lo) / (hi - lo)
            running = max(running, v)
            self.values.append(running)
        tail = self.values[-4:]
        local = (tail[-1] - tail[0]) / (len(tail) - 1) if len(tail) > 1 else 0.0
        self.slope = max(local, floor_slope, 0.0)

    def __call__(self, n: int) -> float:
        values = self.values
        if n <= 1:
            return values[0]
        if n <= len(values):
            return values[n - 1]
        return values[-1] + self.slope * (n - len(values))


def _pava(med: dict[int, float], points: dict[int, list[float]]) -> dict[int, float]:
    """The non-decreasing fit of the medians per level, each weighted by its
    number of answers (pool adjacent violators): a level two answers read
    slow no longer lifts every level above it (a running maximum did: chaos
    drill 6, 2 answers at n = 7 set the decode rate of n = 7 and 8 to 2× the
    23 answers at n = 8)."""
    blocks: list[tuple[float, float, list[int]]] = []  # (value, weight, levels)
    for n in sorted(med):
        v, w, ls = med[n], float(len(points[n])), [n]
        while blocks and blocks[-1][0] > v:
            v0, w0, l0 = blocks.pop()
            v, w, ls = (v0 * w0 + v * w) / (w0 + w), w0 + w, l0 + ls
        blocks.append((v, w, ls))
    return {n: v for v, _, ls in blocks for n in ls}


@dataclass
class BackendWorld:
    name: str
    segments: list[Segment] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    probe_gap: float = 3.0  # a recorded probe this near in time is taken as the answer
    ttft: Curve = field(default_factory=lambda: Curve({}, 0.0, DEFAULTS["ttft_s"]))
    tpot: Curve = field(default_factory=lambda: Curve({}, 0.0, DEFAULTS["tpot_s"]))
    capacity: float = DEFAULTS["capacity"]
    error_s: float = DEFAULTS["error_s"]
    observed: int = 0  # answers the load model was fitted on
    # Residuals of recorded answers (start time → observed / curve).
    _res_t: list[float] = field(default_factory=list)
    _res_ttft: list[float] = field(default_factory=list)
    _res_tpot: list[float] = field(default_factory=list)
    # Recorded concurrency at this backend: the instants its attempts began
    # and ended, each sorted (in flight at t: those begun by t less those
    # ended by t).
    _n_starts: list[float] = field(default_factory=list)
    _n_ends: list[float] = field(default_factory=list)
    # A recorded answer's (TTFT, whole time, requests in flight at its start)
    # as `latency` takes them, by the request's id (the trace holds them all).
    _recorded: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    engine: list[EngineSample] = field(default_factory=list)
    kv_slope: float = 0.0
    # Instants requests in flight died: streams seen cut, else the start of a
    # `down` stretch (a port refusing new connections may still finish the
    # streams it has for a moment: the cut is when they end).
    kills: list[float] = field(default_factory=list)
    _starts: list[float] = field(default_factory=list)
    _probe_t: list[float] = field(default_factory=list)
    _engine_t: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.index()

    def index(self) -> None:
        self.segments.sort(key=lambda s: s.start)
        if not self.segments or self.segments[0].start > -1e17:
            self.segments.insert(0, Segment(-1e18, "up"))
        self._starts = [s.start for s in self.segments]
        self.kills.sort()
        self._probe_t = [p.t for p in self.probes]
        self._engine_t = [e.t for e in self.engine]

    # -- condition ----------------------------------------------------------------

    def segment(self, t: float) -> Segment:
        return self.segments[bisect.bisect_right(self._starts, t) - 1]

    def next_change(self, t: float) -> Segment | None:
        i = bisect.bisect_right(self._starts, t)
        return self.segments[i] if i < len(self.segments) else None

    def next_kill(self, t: float) -> float | None:
        """The next instant after `t` at which requests in flight died."""
        i = bisect.bisect_right(self.kills, t)
        return self.kills[i] if i < len(self.kills) else None

    def probe(self, t: float) -> tuple[bool, bool, str | None, float]:
        """(ok, definitive, error, seconds it takes) of a health probe at `t`."""
        i = bisect.bisect_left(self._probe_t, t)
        best: Probe | None = None
        for j in (i - 1, i):
            if 0 <= j < len(self.probes):
                p = self.probes[j]
                if abs(p.t - t) <= self.probe_gap and (
                    best is None or abs(p.t - t) < abs(best.t - t)
                ):
                    best = p
        if best is not None:
            slow = not best.ok and not best.definitive
            return best.ok, best.definitive, best.error, (1.0 if slow else 0.001)
        seg = self.segment(t)
        if seg.state == "down":
            refused = seg.fault == "connect"
            why = "connection failed: refused" if refused else "health returned HTTP 503"
            return False, True, why, 0.001
        if seg.state == "hung":
            return False, False, "TimeoutError", 1.0
        return True, False, None, 0.001

    # -- load -----------------------------------------------------------------------

    def recorded_n(self, t: float) -> int:
        return bisect.bisect_right(self._n_starts, t) - bisect.bisect_right(self._n_ends, t)

    def recorded_range(self, a: float, b: float) -> tuple[int, int]:
        """The fewest and the most requests the recording had in flight at
        this backend from `a` to `b` (the count at `a`, then after each
        instant something began or ended; several at one instant: the count
        once all of them are done)."""
        st, en = self._n_starts, self._n_ends
        right = bisect.bisect_right
        lo = hi = self.recorded_n(a)
        instants = set(st[right(st, a) : right(st, b)])
        instants.update(en[right(en, a) : right(en, b)])
        for t in instants:
            n = right(st, t) - right(en, t)
            if n < lo:
                lo = n
            elif n > hi:
                hi = n
        return lo, hi

    def residual(self, t: float) -> tuple[float, float]:
        """(TTFT, time per token) of the nearest recorded answer less the curves'."""
        if not self._res_t:
            return 0.0, 0.0
        i = bisect.bisect_left(self._res_t, t)
        j = min(
            range(max(0, i - 1), min(len(self._res_t), i + 1)),
            key=lambda k: abs(self._res_t[k] - t),
        )
        return self._res_ttft[j], self._res_tpot[j]

    def gauges(self, t: float, n: int) -> tuple[float, float, float]:
        """vLLM's (waiting, running, kv cache) with `n` of the replay's
        requests in flight at `t` (see the module text)."""
        cap = self.capacity
        if not self.engine:
            running = min(float(n), cap)
            waiting = max(0.0, n - cap)
            kv = min(1.0, 0.9 * running / cap + 0.05 * waiting / cap)
            return waiting, running, kv
        e = self.engine[max(0, bisect.bisect_right(self._engine_t, t) - 1)]
        # The recorded reading, moved by the replay's difference in flight
        # (not rebuilt from `n`: the engine's count lags the proxy's).
        lo, hi = self.recorded_range(e.t - GAUGE_SLACK_S, e.t + GAUGE_SLACK_S)
        delta = n - hi if n > hi else n - lo if n < lo else 0
        waiting, running = e.waiting, e.running
        if delta >= 0:
            more = min(float(delta), max(0.0, cap - running))
            running += more
            waiting += delta - more
        else:
            fewer = min(float(-delta), waiting)
            waiting -= fewer
            running = max(0.0, running - (-delta - fewer))
        kv = min(1.0, max(0.0, e.kv + self.kv_slope * (running - e.running)))
        return waiting, running, kv

    def latency(self, q: Request, t: float, n: int) -> tuple[float, float]:
        """(seconds to the first byte, seconds of the whole answer) of `q` on
        this backend at `t` with `n` in flight (counting `q`).

        Per attempt of a replay: builtin min/max and the curves' calls are
        written out inline (the same expressions, in the same order)."""
        pre = self._recorded.get(id(q))
        if pre is not None:  # (the fit took them)
            first, whole, n0 = pre
        else:
            rec = cut = None
            name = self.name
            for a in q.attempts:
                if a.backend == name:
                    if a.kind == "answered" and a.status < 400:
                        rec = a
                        break
                    if a.kind == "ended":
                        cut = a
            if rec is None:
                if cut is not None:
                    # Cut mid-answer in the recording: it was still streaming when
                    # cut, so it lasts at least that long (and is cut again there).
                    ft, whole = self._modelled(q, t, n)
                    first = cut.ttft if cut.ttft is not None else ft
                    if cut.ttft is None and q.attempts[0] is cut and q.ttft is not None:
                        # Its first byte reached the client: the client's TTFT
                        # less the wait for the call and the proxy's own time.
                        first = max(MIN_TTFT_S, q.ttft - (cut.start - q.t) - q.overhead)
                    return first, max(whole, cut.end - cut.start + 1e-3)
                return self._modelled(q, t, n)
            _, _, _, _, r_ttft, r_start, r_end = rec
            n0 = bisect.bisect_right(self._n_starts, r_start + 1e-6) - bisect.bisect_right(
                self._n_ends, r_start + HANDOVER_S
            )
            if n0 < 1:  # max(1, recorded_n(...))
                n0 = 1
            whole = r_end - r_start
            if not whole > 1e-4:  # max(1e-4, ...)
                whole = 1e-4
            first = r_ttft if q.stream and r_ttft is not None else whole
            if whole < first:  # min(first, whole)
                first = whole
        # Its own latency, moved by what the load changes (additive: a
        # queue adds waiting time; a ratio of small medians would explode).
        c = self.ttft
        v = c.values
        top = len(v)
        ft = first + (v[n - 1] if 0 < n <= top else c(n)) - (v[n0 - 1] if n0 <= top else c(n0))
        if not ft > MIN_TTFT_S:  # max(MIN_TTFT_S, ...)
            ft = MIN_TTFT_S
        c = self.tpot
        v = c.values
        top = len(v)
        decode = (
            whole
            - first
            + q.tokens_out
            * ((v[n - 1] if 0 < n <= top else c(n)) - (v[n0 - 1] if n0 <= top else c(n0)))
        )
        if not decode > 0.0:  # max(0.0, ...)
            decode = 0.0
        return ft, ft + decode

    def _modelled(self, q: Request, t: float, n: int) -> tuple[float, float]:
        """The curves' latency (plus the nearest recorded answer's residual)."""
        rt, rp = self.residual(t)
        ft = max(MIN_TTFT_S, self.ttft(n) + rt) * q.scale
        decode = q.tokens_out * max(0.0, self.tpot(n) + rp) * q.scale
        if not q.stream:
            ft += decode
            decode = 0.0
        seg = self.segment(t)
        if seg.state == "slow":
            ft *= seg.factor  # a slow prefill: the first token
        return ft, ft + decode

    # -- one attempt ----------------------------------------------------------------

    def call(
        self,
        q: Request,
        t: float,
        n: int,
        first_byte_s: float,
        idle_s: float,
        rng: random.Random,
    ) -> Outcome:
        """What an attempt of `q` sent at `t` does (its whole course, decided
        now: later segments are known)."""
        starts = self._starts
        i = bisect.bisect_right(starts, t)
        seg = self.segments[i - 1]  # (`segment(t)`)
        if seg.state == "down":
            wait = CONNECT_FAIL_S if seg.fault == "connect" else self.error_s
            return Outcome(
                "fail",
                None,
                t + wait,
                seg.fault or "connect",
                502 if seg.fault == "connect" else 500,
            )
        if seg.state == "erroring" and rng.random() < seg.p:
            return Outcome("fail", None, t + self.error_s, seg.fault or "http_500", 500)
        pre = self._recorded.get(id(q))
        if pre is not None:
            # `latency` of a recorded answer, inline (the same expressions).
            first0, whole, n0 = pre
            c = self.ttft
            v = c.values
            top = len(v)
            ft = first0 + (v[n - 1] if 0 < n <= top else c(n)) - (v[n0 - 1] if n0 <= top else c(n0))
            if not ft > MIN_TTFT_S:
                ft = MIN_TTFT_S
            c = self.tpot
            v = c.values
            top = len(v)
            decode = (
                whole
                - first0
                + q.tokens_out
                * ((v[n - 1] if 0 < n <= top else c(n)) - (v[n0 - 1] if n0 <= top else c(n0)))
            )
            if not decode > 0.0:
                decode = 0.0
            first, end = t + ft, t + (ft + decode)
        else:
            first_s, whole_s = self.latency(q, t, n)
            first, end = t + first_s, t + whole_s
        if seg.state != "hung":
            # The first turn of the loop below, inline: most attempts see no
            # change of condition and no kill before their end.
            kills = self.kills
            k = bisect.bisect_right(kills, t)
            if (i == len(starts) or starts[i] >= end) and (k == len(kills) or kills[k] >= end):
                if first > t + first_byte_s:
                    return _new(
                        Outcome, ("fail", None, t + first_byte_s, "first_byte_timeout", 504)
                    )
                return _new(Outcome, ("ok", first, end, "", 200))
        clock = t
        if seg.state == "hung":  # nothing until the hang ends
            clock = self._hang_end(t)
            first += clock - t
            end += clock - t
            if first > t + first_byte_s:
                return Outcome("fail", None, t + first_byte_s, "first_byte_timeout", 504)
        while True:
            nxt = self.next_change(clock)
            kill = self.next_kill(clock)
            if kill is not None and kill < end and (nxt is None or kill <= nxt.start):
                # The backend died with this request in flight.
                if kill < first:
                    return Outcome("fail", None, kill, "upstream_error", 502)
                return Outcome("cut", first, kill, "upstream_disconnect", 200)
            if nxt is None or nxt.start >= end:
                break
            clock = nxt.start
            if nxt.state == "hung":
                resume = self._hang_end(clock)
                stall = resume - clock
                if clock < first:
                    if first + stall > t + first_byte_s:
                        return Outcome("fail", None, t + first_byte_s, "first_byte_timeout", 504)
                    first += stall
                elif stall > idle_s:
                    return Outcome("cut", first, clock + idle_s, "idle_timeout", 200)
                end += stall
                clock = resume
        if first > t + first_byte_s:
            return Outcome("fail", None, t + first_byte_s, "first_byte_timeout", 504)
        return Outcome("ok", first, end)

    def _hang_end(self, t: float) -> float:
        i = bisect.bisect_right(self._starts, t)
        while i < len(self.segments) and self.segments[i].state == "hung":
            i += 1
        return self.segments[i].start if i < len(self.segments) else math.inf


@dataclass
class World:
    backends: dict[str, BackendWorld]
    notes: list[str] = field(default_factory=list)


# What `pack_world` leaves out: the trace's own (the probes, the scrapes)
# and what `BackendWorld.index` makes of them; `_recorded`, keyed by the
# requests' ids, goes as columns.
_LOCAL = frozenset({"probes", "engine", "_recorded", "_starts", "_probe_t", "_engine_t"})


def pack_world(world: World, trace: Trace) -> bytes:
    """`world` (`build_world(trace)`'s) as bytes for another process that
    holds the same trace (the same requests in the same order): its fitted
    figures as they are, `_recorded` as which requests it holds (a byte
    each) and its values in the requests' order (its insertion order: the
    fit takes the requests in order). `unpack_world` gives it back."""
    ids = list(map(id, trace.requests))
    out = []
    for name, bw in world.backends.items():
        state = {
            f.name: getattr(bw, f.name) for f in dataclasses.fields(bw) if f.name not in _LOCAL
        }
        rec = bw._recorded
        # (`marshal`'s version 2: no table of the tuples it wrote, as
        # pickle keeps, for the values of a day of traffic)
        values = marshal.dumps(list(rec.values()), 2)
        out.append((name, state, bytes(map(rec.__contains__, ids)) if rec else b"", values))
    return pickle.dumps((out, world.notes), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_world(blob: bytes, trace: Trace, *, freeze: bool = False) -> World:
    """`pack_world`'s world, in the process that got it (`trace`: this
    process's, the same; `freeze` as in `build_world`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        out, notes = pickle.loads(blob)
        reqs = trace.requests
        backends: dict[str, BackendWorld] = {}
        for name, state, mask, packed in out:
            values = marshal.loads(packed)
            bw = BackendWorld(
                probes=[p for p in trace.probes if p.backend == name],
                engine=list(trace.engine) if name == "primary" else [],
                **state,
            )
            if mask.count(1) != len(values):
                raise ValueError("a packed world of another trace")
            bw._recorded = dict(zip(map(id, compress(reqs, mask)), values, strict=True))
            backends[name] = bw
        world = World(backends, notes)
    finally:
        if enabled:
            gc.enable()
    if freeze:
        gc.freeze()
    return world


# --------------------------------------------------------------------------- building


class _Seen:
    """What the recording holds about one backend, gathered in one pass over
    the requests (a day of traffic is millions of them): a list per field,
    no object per answer."""

    def __init__(self) -> None:
        # Attempts other than answers (status < 400), of requests not refused
        # for their own sake.
        self.attempts: list[Attempt] = []
        # The evidence (`_evidence`, unsorted): every instant in the order
        # taken; the pieces other than `ok` as (instant, its position in
        # `ev_t`, class, fault).
        self.ev_t: list[float] = []
        self.rare: list[tuple[float, int, str, str]] = []
        self.starts: list[float] = []  # of every attempt that was sent
        self.ends: list[float] = []
        # Answers (status < 400) of requests not refused for their own sake:
        # start, end, TTFT, the request.
        self.a_start: list[float] = []
        self.a_end: list[float] = []
        self.a_ttft: list[float | None] = []
        self.a_q: list[Request] = []
        self.wholes: list[float] = []  # every answer's time, refused or not
        self.errors: list[float] = []  # seconds failures (not timeouts) took

    def evidence(self, ev: list[tuple[float, str, str]]) -> None:
        """Take pieces of evidence (in order)."""
        ev_t, rare = self.ev_t, self.rare
        for t, cls, fault in ev:
            if cls != OK:
                rare.append((t, len(ev_t), cls, fault))
            ev_t.append(t)


_NO_EVIDENCE_OF_CUT = ("invalid_output", "idle_timeout", "first_byte_timeout", "connect_timeout")
_TIMEOUTS = ("first_byte_timeout", "connect_timeout")


def _gather(requests: Sequence[Request], idle_s: float) -> dict[str, _Seen]:
    seen = {name: _Seen() for name in BACKENDS}
    # Per backend, the lists' appends (bound once).
    cols = {
        name: (
            d,
            d.starts.append,
            d.ends.append,
            d.wholes.append,
            d.a_start.append,
            d.a_end.append,
            d.a_ttft.append,
            d.a_q.append,
            d.ev_t.append,
        )
        for name, d in seen.items()
    }
    for q in requests:
        atts = q.attempts
        if not atts:
            continue
        outcome, status = q.outcome, q.status
        intrinsic = outcome == "rejected" or (
            400 <= status < 500 and status != 429 and not outcome.startswith("shed")
        )
        for a in atts:
            b, kind, a_status, fault, ttft, start, end = a
            c = cols.get(b)
            if c is None:
                continue
            d, starts, ends, wholes, a_start, a_end, a_ttft, a_q, ev_t = c
            if kind != "shed":
                starts(start)
                ends(end)
            if kind == "answered" and a_status < 400:
                wholes(end - start)
                if not intrinsic:
                    a_start(start)
                    a_end(end)
                    a_ttft(ttft)
                    a_q(q)
                    # (`_evidence`, inline for the answers: all but a few)
                    ev_t(start)
                    if ttft is not None:
                        ev_t(start + ttft)
                continue
            if kind == "failed" and fault not in _TIMEOUTS:
                d.errors.append(end - start)
            if not intrinsic:
                d.attempts.append(a)
                ev: list[tuple[float, str, str]] = []
                _attempt_evidence(ev, a, idle_s)
                d.evidence(ev)
    return seen


def build_world(trace: Trace, idle_s: float = 30.0, *, freeze: bool = False) -> World:
    """The backends' model of `trace`. Millions of small tuples and lists of
    floats, none in a cycle: the collector stays off while they are made
    (its passes over them were a fifth of the fit); `freeze` as in
    `Trace.load`."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        world = _build_world(trace, idle_s)
    finally:
        if enabled:
            gc.enable()
    if freeze:
        gc.freeze()
    return world


def _build_world(trace: Trace, idle_s: float) -> World:
    notes: list[str] = []
    out: dict[str, BackendWorld] = {}
    conds: dict[str, list[Cond]] = defaultdict(list)
    for c in trace.conds:
        conds[c.backend].append(c)
    seen = _gather(trace.requests, idle_s)
    tokens = statistics.median([q.tokens_out for q in trace.requests]) if trace.requests else 64
    for name in BACKENDS:
        d = seen[name]
        attempts = d.attempts
        probes = [p for p in trace.probes if p.backend == name]
        cuts: list[float] = []
        if conds[name]:
            segments = [Segment(c.t, c.state, c.fault, c.p, c.factor) for c in conds[name]]
        else:
            ev: list[tuple[float, str, str]] = []
            _probe_evidence(ev, probes)
            d.evidence(ev)
            segments = _segments_of(d.ev_t, d.rare)
            trials = [(a, b) for a, b, who in trace.trials if who == name]
            segments = _hangs(segments, d, probes, trials, idle_s)
            cuts = sorted(
                a.end for a in attempts if a.kind == "ended" and a.fault not in _NO_EVIDENCE_OF_CUT
            )
        d.ev_t, d.rare = [], []
        gap = _probe_gap(probes)
        bw = BackendWorld(
            name,
            segments=segments,
            probes=probes,
            probe_gap=gap,
            kills=_kills(segments, cuts, attempts, d.a_start, d.a_end),
        )
        _fit(bw, trace, d, tokens, notes)
        out[name] = bw
    return World(out, notes)


TRIAL_SLOW_S = 1.0  # a breaker's trial this long waited on a backend that did not answer
# A 1-token probe a hang kept answers this long after the hang ends (and a
# trial that waited marks the hang's end so: the replay's probe answers when
# the recorded one did).
RESUME_S = 0.05


def _hangs(
    segments: list[Segment],
    d: _Seen,
    probes: Sequence[Probe],
    trials: list[tuple[float, float]],
    idle_s: float,
) -> list[Segment]:
    """`segments` with the hangs the requests saw held until a request was
    answered again. A health endpoint may answer while the engine is stopped
    (chaos drill 2: vLLM's worker SIGSTOPped, `/health` 200 every 0.2 s): a
    health probe that passes is no evidence against a hang, only an answer
    is — one of a request, or the breaker's trial (with `recovery_probe`, a
    1-token chat) that waited for it: hung from its start until just before
    it was answered. Without a hang in the requests: `segments` unchanged."""
    ev: list[tuple[float, str, str]] = []
    for a in d.attempts:
        if a.kind == "ended" and a.fault == "idle_timeout" and a.end - idle_s > a.start:
            # A stream silent for idle_s: its last byte came then, the hang after.
            ev += [(a.end - idle_s, OK, ""), (a.end - idle_s + 2e-3, HANG, a.fault)]
        else:
            _attempt_evidence(ev, a, idle_s)
    if not any(cls == HANG for _, cls, _ in ev):
        return segments
    for start, ttft in zip(d.a_start, d.a_ttft, strict=True):
        ev.append((start, OK, ""))
        if ttft is not None:
            ev.append((start + ttft, OK, ""))
    for sent, answered in trials:
        if answered - sent > TRIAL_SLOW_S:
            ev += [(sent, HANG, "first_byte_timeout"), (answered - 2 * RESUME_S, HANG, "")]
            ev.append((answered, OK, ""))
    ev += [e for e in _evidence((), probes, idle_s) if e[1] != OK]
    ev.sort(key=_EV_T)
    seen = _segments(ev)
    stretches = [
        (s.start, seen[i + 1].start if i + 1 < len(seen) else math.inf)
        for i, s in enumerate(seen)
        if s.state == "hung"
    ]
    out: list[Segment] = []
    for i, s in enumerate(segments):
        end = segments[i + 1].start if i + 1 < len(segments) else math.inf
        t = s.start
        if s.state == "hung":  # (the stretches have the hangs, where they end)
            s = Segment(s.start, "up")
        if s.state != "down":
            for lo, hi in stretches:
                if hi <= t or lo >= end:
                    continue
                if lo > t:
                    out.append(dataclasses.replace(s, start=t))
                out.append(Segment(max(lo, t), "hung", "first_byte_timeout"))
                t = min(hi, end)
        if t < end:
            out.append(s if t == s.start else dataclasses.replace(s, start=t))
    merged = out[:1]
    for s in out[1:]:
        if s.state in ("hung", "up") and merged[-1].state == s.state:
            continue
        merged.append(s)
    return merged


KILL_NEAR_S = 1.0  # streams cut this near a `down` stretch's start died with it


def _kills(
    segments: list[Segment],
    cuts: list[float],
    attempts: list[Attempt],
    a_start: Sequence[float] = (),
    a_end: Sequence[float] = (),
) -> list[float]:
    """When requests in flight died: each `down` stretch entered from a
    working state kills at the first stream cut from just before its start
    to its end (the cut is the fact; a refused probe can come earlier: a
    port closes before the server drops the streams it has); with no cut
    in it, at its start — unless a recorded answer was in flight across
    that start and finished (the server stopped taking requests but
    finished the ones it had: no kill). The answers: `attempts`' and those
    from `a_start` to `a_end`."""
    out: list[float] = []
    survived: list[tuple[float, float]] | None = None  # answers (made when needed)
    prev = "up"
    for i, s in enumerate(segments):
        if s.state == "down" and prev not in ("down", "hung"):
            # The stretch lasts until the backend works again.
            end = next(
                (x.start for x in segments[i + 1 :] if x.state not in ("down", "hung")), math.inf
            )
            near = [c for c in cuts if s.start - KILL_NEAR_S <= c < end]
            if near:
                out.append(near[0])
            else:
                if survived is None:
                    survived = [
                        (a.start, a.end)
                        for a in attempts
                        if a.kind == "answered" and a.status < 500
                    ]
                x = s.start
                if not any(a < x < b for a, b in survived) and not _across(a_start, a_end, x):
                    out.append(x)
        prev = s.state
    return sorted(out)


def _across(starts: Sequence[float], ends: Sequence[float], x: float) -> bool:
    """Whether some answer began before `x` and ended after it (`starts[i]
    < x < ends[i]`): the comparisons in C, no tuple per answer (there are
    millions)."""
    if len(starts) != len(ends):
        raise ValueError("starts and ends differ in length")
    return any(map(and_, map(x.__gt__, starts), map(x.__lt__, ends)))


def _probe_gap(probes: Sequence[Probe]) -> float:
    if len(probes) < 2:
        return 0.0
    gaps = [b.t - a.t for a, b in itertools.pairwise(probes) if b.t > a.t]
    return 1.5 * statistics.median(gaps) if gaps else 0.0


_EV_T = itemgetter(0)


def _attempt_evidence(ev: list[tuple[float, str, str]], a: Attempt, idle_s: float) -> None:
    if a.kind == "answered":
        if a.status >= 500:
            ev.append((a.start, ERROR, f"http_{a.status}"))
        else:
            # It took the request and answered: up then. (Its end is no
            # evidence for new requests: a server that stopped taking
            # them may still finish the streams it has.)
            ev.append((a.start, OK, ""))
            if a.ttft is not None:
                ev.append((a.start + a.ttft, OK, ""))
    elif a.kind == "failed":
        f = a.fault
        if f == "connect":
            ev.append((a.start, REFUSED, f))
        elif f in _TIMEOUTS:
            ev.append((a.start, HANG, f))
        elif f:
            ev.append((a.start, ERROR, f))
        # no fault: load (a 429, a 503 with Retry-After) — the backend works
        else:
            ev.append((a.start, OK, ""))
    elif a.kind == "ended":
        if a.fault in _TIMEOUTS:  # the answer's headers came, its first token never
            ev.append((a.start, HANG, a.fault))
        elif a.fault == "idle_timeout":
            ev.append((max(a.start, a.end - idle_s), HANG, a.fault))
        elif a.fault != "invalid_output":
            ev.append((a.start, OK, ""))
            if a.ttft is not None:
                ev.append((a.start + a.ttft, OK, ""))
            ev.append((a.end, CUT, a.fault))


def _probe_evidence(ev: list[tuple[float, str, str]], probes: Sequence[Probe]) -> None:
    for p in probes:
        if p.ok:
            ev.append((p.t, OK, ""))
        elif p.definitive:
            refused = (p.error or "").startswith("connection")
            ev.append((p.t, REFUSED if refused else ERROR, "connect" if refused else "http_503"))
        else:
            ev.append((p.t, HANG, "probe_timeout"))


def _evidence(
    attempts: Sequence[object], probes: Sequence[Probe], idle_s: float
) -> list[tuple[float, str, str]]:
    """Every piece of evidence, in time order."""
    ev: list[tuple[float, str, str]] = []
    for a in attempts:
        assert isinstance(a, Attempt)
        _attempt_evidence(ev, a, idle_s)
    _probe_evidence(ev, probes)
    ev.sort(key=_EV_T)
    return ev


def infer_segments(
    attempts: Sequence[object], probes: Sequence[Probe], idle_s: float = 30.0
) -> list[Segment]:
    """The condition timeline from the evidence (see the module text)."""
    return _segments(_evidence(attempts, probes, idle_s))


def _segments(ev: list[tuple[float, str, str]]) -> list[Segment]:
    """`infer_segments` of the evidence in time order."""
    times = list(map(_EV_T, ev))
    return _segments_at(times, {i: e for i, e in enumerate(ev) if e[1] != OK})


def _segments_of(ev_t: list[float], rare: list[tuple[float, int, str, str]]) -> list[Segment]:
    """`_segments` of the evidence in `_Seen`'s columns: its instants in the
    order taken, the pieces other than `ok` with their positions there. The
    order `_segments` takes is the stable sort by instant: the instants
    sorted, each other piece at its place among them (a tie: after the
    pieces of its instant taken before it)."""
    times = sorted(ev_t)
    rev: dict[int, tuple[float, str, str]] = {}
    left, right = bisect.bisect_left, bisect.bisect_right
    placed: dict[int, int] | None = None  # (with a tie: every rare piece's place)
    for t, seq, cls, fault in rare:
        i = left(times, t)
        if right(times, t) - i > 1:
            if placed is None:
                seqs = {x[1] for x in rare}
                order = sorted(range(len(ev_t)), key=ev_t.__getitem__)
                placed = {k: p for p, k in enumerate(order) if k in seqs}
                del order
            i = placed[seq]
        rev[i] = (t, cls, fault)
    return _segments_at(times, rev)


def _segments_at(times: list[float], rev: dict[int, tuple[float, str, str]]) -> list[Segment]:
    """`_segments` of the evidence in time order given as its instants and
    the pieces other than answers by position. Answers (`ok`) are all but a
    few of it and change nothing while the backend is up: the loops visit
    the rest, and each run of answers between two of them as one (its
    first and last instants)."""
    # Positions of the evidence other than answers, in order.
    rare = sorted(rev)
    n = len(times)
    sporadic: set[int] = set()
    for i in rare:
        t, cls, _ = rev[i]
        if cls != ERROR:
            continue
        # The evidence just before and just after (strictly earlier, later).
        j = bisect.bisect_left(times, t) - 1
        k = bisect.bisect_right(times, t)
        if j >= 0 and k < n and j not in rev and k not in rev and times[k] - times[j] <= SPORADIC_S:
            sporadic.add(i)
    # The background error share per bin, from sporadic errors among answers.
    fails: dict[int, int] = defaultdict(int)
    oks: dict[int, int] = {}
    fault_of: dict[int, str] = {}
    for i in rare:
        if i in sporadic:
            b = int(rev[i][0] // ERROR_BIN_S)
            fails[b] += 1
            fault_of[b] = rev[i][2]
    for b in fails:
        # The answers in [b, b + 1) bins: the evidence there less the rest.
        lo = bisect.bisect_left(times, b * ERROR_BIN_S)
        hi = bisect.bisect_left(times, (b + 1) * ERROR_BIN_S)
        oks[b] = hi - lo - (bisect.bisect_left(rare, hi) - bisect.bisect_left(rare, lo))
    segs: list[Segment] = [Segment(-1e18, "up")]
    state = "up"
    fault = ""
    last = -math.inf  # the last evidence of the current state
    nxt = 0  # the first position not yet taken
    for i in [*rare, n]:
        if nxt < i:
            # Answers from nxt to i - 1: up from the first (if not up already).
            if state != "up":
                t = times[nxt]
                segs.append(Segment(t if last == -math.inf else (last + t) / 2, "up", ""))
                state, fault = "up", ""
            last = times[i - 1]
        nxt = i + 1
        if i == n or i in sporadic:
            continue
        t, cls, f = rev[i]
        new = _STATE[cls]
        new_fault = _FAULT.get(cls, "") if cls != ERROR else (f or "http_500")
        if cls == REFUSED:
            new_fault = "connect"
        if new != state or (new == "down" and new_fault != fault and cls != CUT):
            # The change happened between the last evidence of the old state
            # and this one: the middle (a cut is seen at its very instant).
            at = t if cls == CUT or last == -math.inf else (last + t) / 2
            segs.append(Segment(at, new, new_fault))
            state, fault = new, new_fault
        last = t
    # Lay the background error share over the `up` stretches.
    out: list[Segment] = []
    for i, s in enumerate(segs):
        out.append(s)
        if s.state != "up":
            continue
        end = segs[i + 1].start if i + 1 < len(segs) else math.inf
        for b in sorted(fails):
            lo_t = b * ERROR_BIN_S
            if lo_t + ERROR_BIN_S <= s.start or lo_t >= end:
                continue
            p = fails[b] / (fails[b] + oks[b])
            out.append(Segment(max(lo_t, s.start), "erroring", fault_of[b], p))
            hi_t = lo_t + ERROR_BIN_S
            if hi_t < end:
                out.append(Segment(hi_t, "up"))
    return out


_EV_CLS = itemgetter(1)


def _fit(bw: BackendWorld, trace: Trace, d: _Seen, tokens: float, notes: list[str]) -> None:
    """The load model of one backend (see the module text), from what
    `_gather` saw of it."""
    name = bw.name
    # Requests in flight at this backend: begun by t less ended by t.
    bw._n_starts = sorted(d.starts)
    bw._n_ends = sorted(d.ends)
    d.starts = d.ends = []
    n_s, n_e = bw._n_starts, bw._n_ends
    model = trace.models.get(name, {})
    bw.engine = list(trace.engine) if name == "primary" else []
    running = [e.running for e in bw.engine]
    # Each answer's requests in flight at its start (counting it, at least 1).
    right = bisect.bisect_right
    starts = d.a_start
    ats = [x + 1e-6 for x in starts]
    over = [x + HANDOVER_S for x in starts]
    ks = list(map(sub, map(right, repeat(n_s), ats), map(right, repeat(n_e), over)))
    del ats, over
    if ks and min(ks) < 1:
        ks = [k if k >= 1 else 1 for k in ks]
    firsts: list[float] = []  # TTFT (or the whole time)
    tpots: list[float] = []  # time per token (0: not a stream)
    # Streams that came in one piece (`ONE_PIECE`): (level, TTFT, time per token).
    pieces: list[tuple[int, float, float]] = []
    keep_first, keep_tpot = firsts.append, tpots.append
    recorded = bw._recorded
    # Per level of concurrency, the answers' TTFTs and times per token (> 0).
    ttft_pts: dict[int, list[float]] = defaultdict(list)
    tpot_pts: dict[int, list[float]] = defaultdict(list)
    for start, end, ttft, q, k in zip(starts, d.a_end, d.a_ttft, d.a_q, ks, strict=True):
        x = end - start
        whole = x if x > 1e-4 else 1e-4  # (max(1e-4, x), min(), max(): inline, the same)
        stream = q[2]  # (q.stream, q.tokens_out: by position)
        ft = -1.0 if ttft is None else ttft
        first = ft if stream and ft >= 0 else whole
        if whole < first:
            first = whole
        keep_first(first)
        tp = (whole - first) / (q[6] if q[6] > 1 else 1) if stream else 0.0
        keep_tpot(tp)
        if stream and first < whole and first >= ONE_PIECE * whole:
            # In one piece: no evidence of either curve (`pieces`: unless all are).
            pieces.append((k, first, tp))
        else:
            ttft_pts[k].append(first)
            if tp > 0:
                tpot_pts[k].append(tp)
        # What `latency` takes of the request's (first) answer here.
        key = id(q)
        if key not in recorded:
            ft = ttft if stream and ttft is not None else whole
            recorded[key] = (whole if whole < ft else ft, whole, k)
    wholes = d.wholes
    d.a_end, d.a_ttft, d.a_q, d.wholes = [], [], [], []
    bw.observed = len(firsts)
    seen_top = max(ks, default=0)
    cap = model.get("capacity") or (max(running) if running and max(running) > 0 else 0.0)
    bw.capacity = float(cap or seen_top or DEFAULTS["capacity"])
    if pieces and not ttft_pts:  # every answer came in one piece: they are the curves
        for k, ft, tp in pieces:
            ttft_pts[k].append(ft)
            if tp > 0:
                tpot_pts[k].append(tp)
        pieces = []
    med_ttft = statistics.median(firsts) if firsts else model.get("ttft_s", DEFAULTS["ttft_s"])
    # (The times per token > 0: the levels' lists hold them all, each a
    # positive float: their order changes no value of the median.)
    tp_all = list(itertools.chain.from_iterable(tpot_pts.values()))
    tp_all += [tp for _, _, tp in pieces if tp > 0]
    med_tpot = statistics.median(tp_all) if tp_all else model.get("tpot_s", DEFAULTS["tpot_s"])
    del tp_all
    mean_service = statistics.median(wholes) if wholes else med_ttft + tokens * med_tpot
    queue_slope = mean_service / bw.capacity
    bw.ttft = Curve(
        ttft_pts, queue_slope if not model else model.get("queue_s", queue_slope), med_ttft
    )
    bw.tpot = Curve(tpot_pts, 0.0, med_tpot)
    if "ttft_s" in model and not firsts:
        # A scenario: TTFT grows by `slope_s` per request in flight beyond the capacity.
        bw.ttft = _model_curve(model["ttft_s"], model.get("slope_s", queue_slope), bw.capacity)
        bw.tpot = _model_curve(
            model.get("tpot_s", DEFAULTS["tpot_s"]), model.get("tpot_slope_s", 0.0), bw.capacity
        )
    if d.errors:
        bw.error_s = max(0.001, statistics.median(d.errors))
    # The curves at every level seen (all of them: `k` is at most the top).
    top = max(seen_top, 1)
    ttft_at = [0.0, *map(bw.ttft, range(1, top + 1))]
    tpot_at = [0.0, *map(bw.tpot, range(1, top + 1))]
    bw._res_t = starts
    d.a_start = []
    bw._res_ttft = [ft - ttft_at[k] for ft, k in zip(firsts, ks, strict=True)]
    bw._res_tpot = [tp - tpot_at[k] if tp > 0 else 0.0 for tp, k in zip(tpots, ks, strict=True)]
    if bw.engine and len(bw.engine) > 3:
        xs = [e.running for e in bw.engine]
        ys = [e.kv for e in bw.engine]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            bw.kv_slope = max(
                0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            )
    if not firsts and not model:
        notes.append(
            f"no answers of the {name} were recorded: its latency is a default "
            f"({DEFAULTS['ttft_s']} s to the first token)"
        )
    bw.index()


def _model_curve(base: float, slope: float, capacity: float) -> Curve:
    top = max(1, int(capacity))
    c = Curve({k: [base] for k in range(1, top + 1)}, slope, base)
    c.slope = slope
    return c
