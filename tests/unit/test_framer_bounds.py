"""SSEFramer on a stream that never ends its event (issue 13, defect 8): the
cost is linear in the bytes fed, and the event's size is bounded."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.openai.sse import EventTooLarge, SSEFramer


def test_an_event_over_the_bound_raises() -> None:
    framer = SSEFramer(max_event_bytes=4096)
    assert framer.feed(b"data: {}\n\ndata: ") == b"data: {}\n\n"
    with pytest.raises(EventTooLarge) as info:
        for _ in range(10):
            assert framer.feed(b"x" * 1024) == b""
    assert info.value.limit == 4096


def test_a_big_event_in_small_pieces_costs_linear_time() -> None:
    # 16 MiB in 1 KiB reads: re-joining the buffer per read (the old framer)
    # copies ~128 GiB; pieces joined once cost one copy.
    framer = SSEFramer(max_event_bytes=32 << 20)
    piece = b"y" * 1024
    t0 = time.process_time()
    assert framer.feed(b"data: ") == b""
    for _ in range(16 * 1024):
        assert framer.feed(piece) == b""
    out = framer.feed(b"\n\ndata: next")
    assert time.process_time() - t0 < 2.0
    assert len(out) == 6 + 16 * 1024 * 1024 + 2
    assert framer.pending == len(b"data: next")


def test_an_event_boundary_split_across_reads_is_found() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: a") == b""
    assert framer.feed(b"\n") == b""
    assert framer.feed(b"\ndata: b\n") == b"data: a\n\n"
    assert framer.feed(b"\n") == b"data: b\n\n"
    assert framer.pending == 0


def _reference(chunks: list[bytes]) -> list[bytes]:
    """The framer before the bound (re-joins its buffer per read): the output
    the new one must reproduce, region for region."""
    buf, cr, out = b"", False, []
    for chunk in chunks:
        if cr:
            chunk, cr = b"\r" + chunk, False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk, cr = chunk[:-1], True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf += chunk
        end = buf.rfind(b"\n\n")
        if end >= 0:
            out.append(buf[: end + 2])
            buf = buf[end + 2 :]
        else:
            out.append(b"")
    rest = buf.rstrip(b"\n")
    out.append(rest + b"\n\n" if rest else b"")
    return out


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.lists(
            st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b": c", b"yy"]), max_size=8
        ).map(b"".join),
        max_size=30,
    )
)
def test_regions_match_the_unbounded_framer(parts: list[bytes]) -> None:
    framer = SSEFramer()
    got = [framer.feed(p) for p in parts] + [framer.flush()]
    assert got == _reference(parts)
