"""SSEFramer on a stream that never ends its event (issue 13, defect 8): the
cost is linear in the bytes fed, and the event's size is bounded."""

from __future__ import annotations

import time

import pytest

from proxy.sse import EventTooLarge, SSEFramer


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
