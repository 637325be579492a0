"""A recording, parsed for replay: the requests as they arrived, what each
backend was seen to do, what the ladder did, and the policy in force.

`Trace.load(path)` reads a recording directory, a segment or a download of
`GET /brownout/recording` (`proxy.telemetry.recording` has the format);
`scenarios` builds one without a recording. Records a replay has no use
for are kept out; nothing here decides anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import marshal
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq, itemgetter, not_
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import yaml

from proxy.policy import Policy, parse_policy
from proxy.telemetry.recording import Reader, segments

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
    # Trials of a half-open breaker that succeeded: (sent, answered, backend)
    # (with `recovery_probe`, the probe: how long a recovering backend kept it).
    trials: list[tuple[float, float, str]] = field(default_factory=list)
    exact_ticks: bool = False  # `tick` records: every evaluation's instant
    calls: bool = False  # attempts carry their backend call's instant (after admission)
    models: dict[str, dict[str, float]] = field(default_factory=dict)  # scenario latency models
    gaps: int = 0  # records the recorder dropped
    skipped: int = 0  # unreadable lines
    truncated: int = 0  # segments cut by a crash
    source: str = ""
    synthetic: bool = False
    _half_open: dict[Any, float] = field(default_factory=dict, repr=False)
    # `ObservedWaits`' rebuild of the recorded waits (a function of the
    # trace): (waits, the proxy's own time before the call by request id,
    # a queued request's own time after its slot came by request id), made
    # by the first replay, or sent by the process that made it.
    rebuilt_waits: (
        tuple[list[tuple[float, float, bool]], dict[int, float], dict[int, float]] | None
    ) = field(default=None, init=False, repr=False, compare=False)

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
    def load(cls, path: Path, *, freeze: bool = False, peer: Peer | None = None) -> Trace:
        """Read a recording. Millions of small tuples, none in a cycle: the
        collector stays off while they are made; `freeze` (the command line,
        whose process ends with the replay) also keeps every later full
        collection from walking them again (`gc.freeze`, process-wide).
        `peer`: another process reading the same recording at the same time
        (see `Peer`): each parses half of it and they exchange the rest."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            files = segments(path) if path.is_dir() else [path]
            reader = Reader()
            tr = None
            if peer is not None:
                try:
                    tr = _shared(cls, reader, files, str(path), peer)
                finally:
                    peer.close()
                if tr is None:
                    reader = Reader()
            if tr is None:
                tr = _chunked(cls, reader, files, str(path))
            if tr is None:  # a record older than the first chunk's: all at once
                reader = Reader()
                recs: list[Any] = []
                for f in files:
                    recs.extend(_parsed(reader, f))
                tr = cls._build(recs, str(path), in_order=False)
                del recs
        finally:
            if enabled:
                gc.enable()
        if freeze:
            gc.freeze()
        tr.skipped += reader.skipped  # (lines not JSON; the rest: records it could not read)
        tr.truncated = reader.truncated
        return tr

    @classmethod
    def from_records(cls, recs: list[dict[str, Any]], source: str = "") -> Trace:
        """A trace of records taken in the order given (`load` reads a file's
        in time order)."""
        return cls._build(recs, source, in_order=True)

    @classmethod
    def _build(cls, recs: list[Any], source: str, in_order: bool) -> Trace:
        """`recs`: parsed lines, any of them not a record (not an object with
        a numeric `t`: skipped, unless `in_order`, whose records are trusted).
        Request records (all but a few) are converted in one tight loop; the
        others, taken in time order (`in_order`: as given), by `_add`. A
        request's conversion depends on no other record: the result is the
        one of taking every record in time order."""
        bad = 0
        try:
            ts: list[Any] = list(map(_get, recs, repeat("t")))  # (not an object: TypeError)
            ok = in_order or set(map(type, ts)) <= _NUMBERS
        except TypeError:
            ok = False
        if not ok:  # lines that are not records (rare): skipped
            valid = [r for r in recs if type(r) is dict and type(r.get("t")) in _NUMBERS]
            bad = len(recs) - len(valid)
            recs = valid
            ts = list(map(_get, recs, repeat("t")))
        ks = list(map(_get, recs, repeat("k")))
        is_req = list(map(eq, ks, repeat("req")))
        reqs = list(compress(recs, is_req))
        others = list(compress(recs, map(not_, is_req)))
        if "seg" in ks:
            ts = [t for t, k in zip(ts, ks, strict=True) if k != "seg"]
        del ks, is_req
        if not ts:
            raise ValueError(f"{source or 'trace'}: no records")
        # (The first of equal values, as of records in time order: an int
        # and a float can be equal.)
        lo, hi = min(ts), max(ts)
        del ts
        t0 = lo
        tr = cls(start=t0, end=hi - t0, source=source, skipped=bad)
        failed: list[dict[str, Any]] = []
        tr.calls, end = _requests(reqs, t0, tr.requests, failed)
        tr.requests.sort(key=_Q_T)
        tr.skipped += len(failed)
        del reqs
        if not in_order:
            others.sort(key=_T)
        tr._others(others, end)
        return tr

    def _others(self, others: list[dict[str, Any]], end: float) -> None:
        """The records other than requests, in time order (`_add`); the
        trace's end (the latest recorded request's, `end`) and first tier."""
        tr = self
        t0 = tr.start
        for r in others:
            k = r.get("k")
            t = float(r["t"]) - t0
            try:
                _add(tr, k, t, r)
            except (KeyError, TypeError, ValueError):
                tr.skipped += 1
        tr.ticks.sort()
        if tr.requests:
            tr.end = max(tr.end, end)
        first_sample = next((s for s in tr.samples), None)
        first_tier = tr.tiers[0] if tr.tiers else None
        if first_tier is not None and (first_sample is None or first_tier[0] <= first_sample["t"]):
            tr.initial_tier = first_tier[1]
        elif first_sample is not None:
            tr.initial_tier = str(first_sample.get("tier", "normal"))


_NUMBERS = {int, float, bool}  # `isinstance(t, int | float)` of what orjson makes
_get = dict.get
_T = itemgetter("t")
_Q_T = itemgetter(0)  # a Request's `t`


def _parsed(reader: Reader, path: Path) -> list[Any]:
    """The parsed lines of one file (`Reader.records` without its checks,
    which `Trace._build` makes): a chunk of lines at a time, line by line
    only in a chunk with a line that is not JSON."""
    out: list[Any] = []
    loads = orjson.loads
    for lines in reader.raw_chunks(path):
        try:
            out += list(map(loads, lines))
        except orjson.JSONDecodeError:
            for ln in lines:
                try:
                    out.append(loads(ln))
                except orjson.JSONDecodeError:
                    reader.skipped += 1
    return out


_REQ = itemgetter(
    "t",
    "att",
    "pri",
    "st",
    "ep",
    "cl",
    "pt",
    "n",
    "mt",
    "be",
    "s",
    "o",
    "ttft",
    "d",
    "rt",
    "res",
    "sid",
)
_new = tuple.__new__


def _requests(
    recs: list[dict[str, Any]], t0: float, out: list[Request], failed: list[dict[str, Any]]
) -> tuple[bool, float]:
    """The request records as `Request`s, appended to `out` in the order
    given (not sorted); the records that are not requests to `failed`
    (skipped). Whether their attempts carry the backend call's instant; the
    latest recorded end.

    Hot (a day of traffic is millions): one loop, no call per record for
    what the flight recorder always writes (every key, one attempt); any
    other record goes through `_request`, the reference, and a fast
    conversion that would differ from it raises instead and goes there too."""
    add = out.append
    calls = False
    end = -math.inf
    new = _new
    req, att_t = Request, Attempt
    fields = _REQ
    intern = sys.intern
    for r in recs:
        try:
            t, att, pri, st, ep, cl, pt, n, mt, be, s, o, ttft, d, rt, res, sid = fields(r)
            t = float(t) - t0
            if len(att) != 1:
                raise _Slow
            a0 = att[0]
            if type(a0) is not list:
                raise _Slow
            b, kind, a_s, fault, a_ttft, a_end, call = a0
            # (Strings that repeat, interned: one object each, not millions
            # of copies; not a string: `_request` decides.)
            b, kind = intern(b), intern(kind)
            if a_end is None:
                a_end = 0.0
            start = t + (0.0 if call is None else call)
            a = new(att_t, (b, kind, a_s, fault or "", a_ttft, start, t + a_end))
            overhead = 0.0
            if kind == "answered" and a_ttft is not None and ttft is not None:
                x = ttft - (start - t) - a_ttft
                x = x if x < 5.0 else 5.0
                overhead = x if x > 0.0 else 0.0
            if not (isinstance(n, int) and n > 0):
                n = mt if isinstance(mt, int) else 64
            if not isinstance(s, int):
                raise _Slow
            scale = r.get("scale")
            d = float(d or 0.0)
            add(
                new(
                    req,
                    (
                        t,
                        intern(pri),
                        st is True,
                        intern(ep),
                        intern(cl) if cl else "",
                        pt or 1,
                        n,
                        (a,),
                        intern(be),
                        s,
                        intern(o),
                        ttft,
                        d,
                        res is True,
                        rt or 0,
                        1.0 if scale is None else float(scale or 1.0),
                        sid or "",
                        overhead,
                    ),
                )
            )
            calls = True
            x = t + d
        except Exception:  # the reference decides (or skips)
            try:
                q = _request(float(r["t"]) - t0, r)
            except (KeyError, TypeError, ValueError):
                failed.append(r)
                continue
            if not calls and q.attempts and len(r["att"][0]) > 6:
                calls = True
            add(q)
            x = q.t + q.duration
        if x > end:
            end = x
    return calls, end


def _chunked(cls: type[Trace], reader: Reader, files: list[Path], source: str) -> Trace | None:
    """`Trace._build` of the files' records, a chunk of lines at a time:
    each chunk's requests converted as soon as it is parsed (its parsed
    lines dropped then: a day of them at once is gigabytes), against the
    first chunk's earliest instant. None if a later chunk holds an earlier
    one (the instants are relative to the earliest: the caller reads the
    records all at once instead). The same trace as `_build`'s: the same
    filtering per record, the same earliest and latest instants (the first
    of equal values), the requests in the same order before their stable
    sort."""
    reqs: list[Request] = []
    failed: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    bad = 0
    calls = False
    end = -math.inf
    lo: Any = None
    hi: Any = None
    for f in files:
        for lines in reader.raw_chunks(f):
            recs, ts, ks, n_bad = _records(reader, lines)
            bad += n_bad
            if ts:
                a, b = min(ts), max(ts)
                if lo is None:
                    lo, hi = a, b
                else:
                    if a < lo:
                        if reqs or failed:
                            return None
                        lo = a
                    if b > hi:
                        hi = b
            is_req = list(map(eq, ks, repeat("req")))
            if True in is_req:
                c, e = _requests(list(compress(recs, is_req)), lo, reqs, failed)
                calls = calls or c
                if e > end:
                    end = e
                others += compress(recs, map(not_, is_req))
            else:
                others += recs
    if lo is None:
        raise ValueError(f"{source or 'trace'}: no records")
    tr = cls(start=lo, end=hi - lo, source=source, skipped=bad + len(failed))
    reqs.sort(key=_Q_T)
    tr.requests, tr.calls = reqs, calls
    others.sort(key=_T)
    tr._others(others, end)
    return tr


def _records(reader: Reader, lines: list[bytes]) -> tuple[list[Any], list[Any], list[Any], int]:
    """A chunk's lines parsed: its records (objects with a numeric `t`),
    their instants (but a segment header's), their kinds, and how many
    parsed lines were not records (the lines not JSON: `reader.skipped`)."""
    loads = orjson.loads
    bad = 0
    try:
        recs: list[Any] = list(map(loads, lines))
    except orjson.JSONDecodeError:
        recs = []
        for ln in lines:
            try:
                recs.append(loads(ln))
            except orjson.JSONDecodeError:
                reader.skipped += 1
    try:
        ts: list[Any] = list(map(_get, recs, repeat("t")))
        ok = set(map(type, ts)) <= _NUMBERS
    except TypeError:
        ok = False
    if not ok:
        valid = [r for r in recs if type(r) is dict and type(r.get("t")) in _NUMBERS]
        bad = len(recs) - len(valid)
        recs = valid
        ts = list(map(_get, recs, repeat("t")))
    ks = list(map(_get, recs, repeat("k")))
    if "seg" in ks:
        ts = [t for t, k in zip(ts, ks, strict=True) if k != "seg"]
    return recs, ts, ks, bad


class Peer:
    """The other end of a shared reading: two processes (a replay's baseline
    and candidate) read the same recording at the same time; each parses
    and converts every other chunk of it (both decompress all of it, which
    is cheap) and sends the other its requests as columns of plain values
    (`marshal`: exact types and bits, one object per string sent once), and
    its other records and per-chunk figures; each then puts the chunks
    together in order. The trace is the one `_chunked` gives, in each.

    `rank` 0 takes the first chunks (up to one with a request) and every
    other one from there, 1 the rest;
    `rfd` is read from, `wfd` written to (the other's `wfd` and `rfd`: two
    pipes). Both ends are closed once the reading is done (the other sees
    its end: a process that failed or died before sending sends nothing,
    and the one left reads the recording on its own)."""

    def __init__(self, rank: int, rfd: int, wfd: int) -> None:
        self.rank, self.rfd, self.wfd = rank, rfd, wfd
        self._open = [rfd, wfd]

    @property
    def fds(self) -> tuple[int, int]:
        return self.rfd, self.wfd

    def close(self) -> None:
        while self._open:
            fd = self._open.pop()
            with contextlib.suppress(OSError):
                os.close(fd)

    def exchange(self, blob: bytes) -> bytes | None:
        """Send `blob`, receive the other's (None: its end closed first)."""
        failed: list[BaseException] = []
        wfd, rfd = self.wfd, self.rfd
        self._open = []  # (the files below close them)

        def send() -> None:
            try:
                with open(wfd, "wb", closefd=True) as f:
                    f.write(len(blob).to_bytes(8, "little"))
                    f.write(blob)
            except OSError as exc:  # the other closed its end: it reads alone
                failed.append(exc)

        writer = threading.Thread(target=send, daemon=True)
        writer.start()
        try:
            with open(rfd, "rb", closefd=True) as f:
                head = f.read(8)
                if len(head) < 8:
                    return None
                size = int.from_bytes(head, "little")
                data = f.read(size)
                return data if len(data) == size else None
        finally:
            writer.join()


def _shared(
    cls: type[Trace], reader: Reader, files: list[Path], source: str, peer: Peer
) -> Trace | None:
    """`_chunked`'s trace, half of it read here, half by `peer`'s process
    (see `Peer`). The chunks up to the first with a request (where the
    instant the requests are converted against is known) are read by both
    and taken by rank 0. None where `_chunked` must read it instead,
    decided the same in both: a later chunk holds a record earlier than
    that instant (`_chunked` would give None: the caller's reading at
    once), no request at all, or the other side failed."""
    rank = peer.rank
    reqs: list[Request] = []
    failed: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    # Per chunk taken here: (index, requests, others, failed, latest
    # instant or None, calls, latest end, not records, lines not JSON).
    stats: list[tuple[int, int, int, int, Any, bool, float, int, int]] = []
    lo: Any = None
    early = False  # a record earlier than the first chunk's: all at once
    head = True  # up to the first chunk with a request: read by both, taken by 0
    i = 0

    def want() -> bool:  # (the other's chunks are not split into lines)
        return head or i % 2 == rank

    for f in files:
        for lines in reader.raw_chunks(f, want):
            if not head and i % 2 != rank:
                i += 1
                continue
            skipped = reader.skipped
            recs, ts, ks, bad = _records(reader, lines)
            is_req = list(map(eq, ks, repeat("req")))
            if head:
                # (`_chunked`'s earliest instant: no request converted yet)
                if ts and (lo is None or min(ts) < lo):
                    lo = min(ts)
                head = True not in is_req
                if rank:  # (read here for the instant only)
                    reader.skipped = skipped
                    i += 1
                    continue
            elif ts and min(ts) < lo:
                early = True
                break
            n_req, n_failed, n_others = len(reqs), len(failed), len(others)
            calls, end = False, -math.inf
            if True in is_req:
                calls, end = _requests(list(compress(recs, is_req)), lo, reqs, failed)
                others += compress(recs, map(not_, is_req))
            else:
                others += recs
            stats.append(
                (
                    i,
                    len(reqs) - n_req,
                    len(others) - n_others,
                    len(failed) - n_failed,
                    max(ts) if ts else None,
                    calls,
                    end,
                    bad,
                    reader.skipped - skipped,
                )
            )
            i += 1
        if early:
            break
    if head:  # no request (the same in both)
        return None
    got = peer.exchange(marshal.dumps((early, _columns(reqs), others, stats)))
    if got is None:
        return None
    p_early, p_cols, p_others, p_stats = marshal.loads(got)
    del got
    if early or p_early:
        return None
    p_reqs = _from_columns(p_cols)
    del p_cols
    # The chunks in order: their requests and other records as `_chunked`
    # took them, its figures folded the same way.
    mine = (reqs, others)
    theirs = (p_reqs, p_others)
    all_reqs: list[Request] = []
    all_others: list[dict[str, Any]] = []
    at = {0: [0, 0], 1: [0, 0]}  # (mine, theirs): next request, next other
    hi: Any = None
    calls = False
    end = -math.inf
    bad = n_failed = skipped = 0
    for st, side in sorted([*zip(stats, repeat(0)), *zip(p_stats, repeat(1))]):
        _idx, n_req, n_oth, n_fail, top, c, e, n_bad, n_skip = st
        rs, os_ = (mine, theirs)[side]
        pos = at[side]
        all_reqs += rs[pos[0] : pos[0] + n_req]
        all_others += os_[pos[1] : pos[1] + n_oth]
        pos[0] += n_req
        pos[1] += n_oth
        if top is not None and (hi is None or top > hi):
            hi = top
        calls = calls or c
        if e > end:
            end = e
        bad += n_bad
        n_failed += n_fail
        if side:
            skipped += n_skip
    del reqs, others, p_reqs, p_others, mine, theirs
    reader.skipped += skipped
    tr = cls(start=lo, end=hi - lo, source=source, skipped=bad + n_failed)
    all_reqs.sort(key=_Q_T)
    tr.requests, tr.calls = all_reqs, calls
    all_others.sort(key=_T)
    tr._others(all_others, end)
    return tr


def _columns(reqs: list[Request]) -> tuple[Any, ...] | None:
    """Requests as columns of plain values (`marshal`'s): their fields but
    the attempts, the attempts' count per request (None: one each), the
    attempts' fields."""
    if not reqs:
        return None
    cols = list(zip(*reqs, strict=True))
    atts = cols.pop(7)
    counts = list(map(len, atts))
    flat = list(itertools.chain.from_iterable(atts))
    del atts
    a_cols = list(zip(*flat, strict=True))
    return (cols, None if counts.count(1) == len(counts) else counts, a_cols, len(flat))


def _from_columns(cols: tuple[Any, ...] | None) -> list[Request]:
    """`_columns`' requests back."""
    if cols is None:
        return []
    fields, counts, a_fields, n_atts = cols
    atts: list[Attempt] = (
        list(map(_new, repeat(Attempt), zip(*a_fields, strict=True))) if n_atts else []
    )
    per: Any
    if counts is None:
        per = zip(atts)  # (one each: 1-tuples)
    else:
        it = iter(atts)
        per = [tuple(itertools.islice(it, n)) for n in counts]
    return list(map(_new, repeat(Request), zip(*fields[:7], per, *fields[7:], strict=True)))


class _Slow(Exception):
    """A request record the fast conversion leaves to `_request`."""


def _add(tr: Trace, k: Any, t: float, r: dict[str, Any]) -> None:
    if k == "req":  # (`_requests` takes them all at once)
        q = _request(t, r)
        tr.requests.append(q)
        if not tr.calls and q.attempts and len(r["att"][0]) > 6:
            tr.calls = True
    elif k == "tick":
        if not tr.exact_ticks:  # the instants recorded: no need to guess them
            tr.exact_ticks = True
            tr.ticks.clear()
        tr.ticks.append(t)
    elif k == "breaker":
        _breaker(tr, t, r)
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


def _breaker(tr: Trace, t: float, r: dict[str, Any]) -> None:
    old, new, b = r.get("from"), r.get("to"), r.get("b")
    if old == "open" and new == "half-open":
        if not tr.exact_ticks:
            tr.ticks.append(t)
        if r.get("m") is None:
            tr._half_open[b] = t
    elif old == "half-open" and new == "closed" and r.get("m") is None:
        sent = tr._half_open.pop(b, None)
        if sent is not None and isinstance(b, str):
            tr.trials.append((sent, t, b))


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
