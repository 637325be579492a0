"""The P95 window's incremental sort gives exactly what a full sort gives."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.control.pressure import Window


def reference(samples: list[tuple[float, float]], now: float, span: float, cap: int) -> float:
    kept = samples[-cap:]
    vs = sorted(v for t, v in kept if t >= now - span)
    return vs[min(len(vs) - 1, math.ceil(0.95 * len(vs)) - 1)] if vs else 0.0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0, 5, allow_nan=False), st.sampled_from([0.1, 0.5])),
        st.tuples(st.just("p95"), st.floats(0, 3, allow_nan=False), st.just(0.0)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 12), st.floats(0.5, 4))
def test_incremental_p95_equals_a_full_sort(
    steps: list[tuple[str, float, float]], cap: int, span: float
) -> None:
    w = Window(span, cap)
    now = 0.0
    samples: list[tuple[float, float]] = []
    for op, a, b in steps:
        if op == "add":
            now += b
            w.add(now, round(a, 2))  # ties on purpose
            samples.append((now, round(a, 2)))
        else:
            now += a
            p, n = w.p95(now)
            assert p == reference(samples, now, span, cap)
            kept = [s for s in samples[-cap:] if s[0] >= now - span]
            assert n == len(kept)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=60),
    st.integers(50, 3000),
    st.integers(0, 2**32),
)
def test_a_long_drifting_window_gives_what_a_full_sort_gives(
    phases: list[tuple[int, int]], cap: int, seed: int
) -> None:
    """Thousands of samples whose level moves (the top grows, the P95's rank
    falls below the kept top), many ties, P95s asked between them."""
    import random

    rnd = random.Random(seed)
    w = Window(30.0, cap)
    now = 0.0
    samples: list[tuple[float, float]] = []
    for count, level in phases:
        for _ in range(count):
            now += rnd.choice((0.01, 0.05, 0.2))
            v = round(level * rnd.random(), 1)
            w.add(now, v)
            samples.append((now, v))
        now += rnd.choice((0.0, 1.0, 10.0))
        p, n = w.p95(now)
        assert p == reference(samples, now, 30.0, cap)
        assert n == sum(1 for t, _ in samples[-cap:] if t >= now - 30.0)
