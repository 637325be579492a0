"""The backend model's fast passes give what the plain ones gave (issue 22):
the condition timeline from the evidence (runs of answers taken at once,
the background error share counted by bisection) and the recorded
concurrency (two sorted lists instead of a step function). The references
below are the plain passes, as they were."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.replay.world import (
    _FAULT,
    _STATE,
    CUT,
    ERROR,
    ERROR_BIN_S,
    HANG,
    OK,
    REFUSED,
    SPORADIC_S,
    BackendWorld,
    Segment,
    _Seen,
    _segments,
    _segments_of,
)


def _reference_segments(ev: list[tuple[float, str, str]]) -> list[Segment]:
    sporadic: list[bool] = [False] * len(ev)
    for i, (t, cls, _) in enumerate(ev):
        if cls in (OK, CUT):
            continue
        prev = next((ev[j] for j in range(i - 1, -1, -1) if ev[j][0] < t), None)
        nxt = next((ev[j] for j in range(i + 1, len(ev)) if ev[j][0] > t), None)
        if (
            prev is not None
            and nxt is not None
            and prev[1] == OK
            and nxt[1] == OK
            and nxt[0] - prev[0] <= SPORADIC_S
            and cls == ERROR
        ):
            sporadic[i] = True
    fails: dict[int, int] = defaultdict(int)
    oks: dict[int, int] = defaultdict(int)
    fault_of: dict[int, str] = {}
    for (t, cls, fault), sp in zip(ev, sporadic, strict=True):
        b = int(t // ERROR_BIN_S)
        if sp:
            fails[b] += 1
            fault_of[b] = fault
        elif cls == OK:
            oks[b] += 1
    segs: list[Segment] = [Segment(-1e18, "up")]
    state = "up"
    fault = ""
    last = -math.inf
    for (t, cls, f), sp in zip(ev, sporadic, strict=True):
        if sp:
            continue
        new = _STATE[cls]
        new_fault = _FAULT.get(cls, "") if cls != ERROR else (f or "http_500")
        if cls == REFUSED:
            new_fault = "connect"
        if new != state or (new == "down" and new_fault != fault and cls != CUT):
            at = t if cls == CUT or last == -math.inf else (last + t) / 2
            segs.append(Segment(at, new, new_fault))
            state, fault = new, new_fault
        last = t
    out: list[Segment] = []
    for i, s in enumerate(segs):
        out.append(s)
        if s.state != "up":
            continue
        end = segs[i + 1].start if i + 1 < len(segs) else math.inf
        for b in sorted(fails):
            lo = b * ERROR_BIN_S
            if lo + ERROR_BIN_S <= s.start or lo >= end:
                continue
            p = fails[b] / (fails[b] + oks[b])
            out.append(Segment(max(lo, s.start), "erroring", fault_of[b], p))
            hi = lo + ERROR_BIN_S
            if hi < end:
                out.append(Segment(hi, "up"))
    return out


# Mostly answers, on a coarse grid of instants (ties), some on bin edges.
_instant = st.one_of(
    st.integers(0, 400).map(lambda k: k / 8),
    st.integers(0, 5).map(lambda k: k * ERROR_BIN_S),
    st.floats(0, 60, allow_nan=False),
)
_piece = st.tuples(
    _instant,
    st.sampled_from([OK] * 8 + [ERROR, ERROR, REFUSED, HANG, CUT]),
    st.sampled_from(["", "http_500", "http_502", "connect", "upstream_error"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_piece, max_size=80))
def test_the_condition_timeline_is_the_plain_passes(ev: list[tuple[float, str, str]]) -> None:
    ev = sorted(ev, key=lambda e: e[0])
    assert repr(_segments(ev)) == repr(_reference_segments(ev))


@settings(max_examples=400, deadline=None)
@given(st.lists(_piece, max_size=80))
def test_the_timeline_from_the_evidence_columns_is_the_sorted_evidence_s(
    ev: list[tuple[float, str, str]],
) -> None:
    """`_gather` keeps the evidence as its instants in the order taken and
    the pieces other than answers apart: placed back in the stable sort by
    instant (ties too), they give the timeline of the sorted evidence."""
    seen = _Seen()
    seen.evidence(ev)
    want = _segments(sorted(ev, key=lambda e: e[0]))
    assert repr(_segments_of(seen.ev_t, seen.rare)) == repr(want)


def _quarter(k: int) -> float:
    return k / 4


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 100).map(lambda k: k / 4), st.integers(0, 40).map(lambda k: k / 4)
        ),
        max_size=60,
    ),
    st.lists(st.integers(-4, 130).map(_quarter), max_size=30),
)
def test_recorded_concurrency_is_the_step_function(
    spans: list[tuple[float, float]], queries: list[float]
) -> None:
    starts = [a for a, _ in spans]
    ends = [a + d for a, d in spans]
    # The reference: +1 at each start, -1 at each end, ends first at a tie.
    marks = sorted([(t, -1) for t in ends] + [(t, 1) for t in starts], key=lambda m: m[0])
    n_t = [t for t, _ in marks]
    n_v = list(itertools.accumulate(d for _, d in marks))
    bw = BackendWorld("primary")
    bw._n_starts, bw._n_ends = sorted(starts), sorted(ends)
    for t in queries + starts + ends:
        i = bisect.bisect_right(n_t, t) - 1
        assert bw.recorded_n(t) == (n_v[i] if i >= 0 else 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-5, 5), st.floats(0, 3)).map(lambda p: (p[0], p[0] + p[1])),
        max_size=30,
    ),
    st.floats(-6, 9),
)
def test_an_answer_across_an_instant_is_the_plain_scan(
    answers: list[tuple[float, float]], x: float
) -> None:
    """`_kills`' test of the answers (in C, no tuple per answer) is the
    plain `any(a < x < b ...)`, edges included."""
    from proxy.replay.world import _across

    starts = [a for a, _ in answers]
    ends = [b for _, b in answers]
    for at in (x, *starts, *ends):
        assert _across(starts, ends, at) == any(a < at < b for a, b in answers)
