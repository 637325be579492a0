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
