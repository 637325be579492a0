"""`Trace.load` reads a recording as the reference reading does: every
record in time order (`read_trace`), each request through `_request`. The
fast path (the flight recorder's own records, converted in one loop) must
give the same requests, in the same order, for any file — old attempts
without the call instant, retries, missing keys, lines that are not JSON or
not records, times that tie, segments out of order."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.replay import trace as trace_mod
from proxy.replay.trace import Trace, _request
from proxy.telemetry import recording
from proxy.telemetry.recording import Reader, read_trace

T = 1_767_225_600.0


def _member(lines: list[bytes]) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return c.compress(b"\n".join(lines) + b"\n") + c.flush()


def _req(t: float, **over: Any) -> bytes:
    rec: dict[str, Any] = {
        "k": "req",
        "t": T + t,
        "ep": "chat",
        "pri": "normal",
        "st": True,
        "sid": None,
        "cl": "c1",
        "pt": 100,
        "mt": 512,
        "att": [["primary", "answered", 200, None, 0.1, 0.5, 0.001]],
        "be": "primary",
        "s": 200,
        "o": "complete",
        "ttft": 0.11,
        "d": 0.52,
        "n": 20,
        "rt": 0,
        "res": False,
        "tier": "normal",
    }
    rec.update(over)
    return orjson.dumps(rec)


def _recording(d: Path) -> None:
    d.mkdir()
    first = [
        orjson.dumps({"k": "seg", "t": T - 5, "v": 1, "pid": 1}),
        orjson.dumps({"k": "policy", "t": T + 0.5, "hash": "h", "knobs": {}}),
        _req(3.0),
        _req(
            1.0,
            att=[
                ["primary", "failed", 502, "connect", None, 0.01, 0.0],
                ["fallback", "answered", 200, None, 0.2, 0.9, 0.02],
            ],
            rt=1,
        ),
        _req(2.0, att=[["primary", "answered", 200, None, 0.1, 0.5]]),  # no call instant
        _req(2.1, att=[["primary", "answered", 200, None, 0.1, None, None]], ttft=9.0),
        _req(2.2, att=[["primary", "answered", 200, None, 0.1, 0.5, 0.2]], ttft=0.0),
        _req(2.5, att=[{"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7}]),
        _req(2.6, att=None, o="shed_queue_timeout", s=429, be="none"),
        _req(2.7, s="200"),  # not a status: not readable
        _req(2.8, n=True, mt=None, cl=None, pt=None, d=-0.0, sid="s1", res=True),
        _req(2.9, n=0, mt="x", ttft=None, scale=2.5),
        b"not json",
        b"[1, 2]",
        orjson.dumps({"k": "tick"}),
        orjson.dumps({"k": "tick", "t": T + 1}),
        orjson.dumps(
            {"k": "probe", "t": T + 1.5, "b": "primary", "ok": True, "def": False, "err": None}
        ),
        orjson.dumps({"k": "sample", "t": T + 1.2, "tier": "normal"}),
    ]
    late = [_req(0.2 + i / 100, sid="s1" if i % 2 else None) for i in range(20)]
    second = [_req(4.0 + i / 10) for i in range(30)] + [
        orjson.dumps({"k": "tier", "t": T + 4.5, "from": "normal", "to": "failover", "why": "x"}),
        _req(4.0, pri="critical"),  # ties with the first of the segment
        _req(4.0, ep="completions", st=False),
        {"k": "sample", "t": int(T) + 4, "tier": "normal"}.__repr__().encode(),  # not JSON
        orjson.dumps({"k": "limit", "t": int(T) + 4, "to": 8}),  # an int time
    ]
    (d / "rec-1767225600-1-00000.jsonl.gz").write_bytes(_member(first) + _member(late))
    # The second segment ends in a member cut short by a crash.
    (d / "rec-1767225604-1-00001.jsonl.gz").write_bytes(_member(second) + _member(second)[:-30])


def test_a_recording_loads_as_the_reference_reading_gives_it(tmp_path: Path) -> None:
    d = tmp_path / "rec"
    _recording(d)
    tr = Trace.load(d)

    reader = Reader()
    recs = read_trace(d, reader)  # every record, in time order
    times = [r["t"] for r in recs if r.get("k") != "seg"]
    t0 = min(times)
    want = []
    unreadable = 0
    for r in recs:
        if r.get("k") != "req":
            continue
        try:
            want.append(_request(float(r["t"]) - t0, r))
        except (KeyError, TypeError, ValueError):
            unreadable += 1
    want.sort(key=lambda q: q.t)

    assert tr.start == t0
    assert repr(tr.requests) == repr(want)  # (floats by their repr: -0.0, ints)
    assert tr.calls
    assert tr.end == max(max(times) - t0, max(q.t + q.duration for q in want))
    assert unreadable == 2  # the dict attempt, the string status
    assert tr.skipped == reader.skipped + unreadable == 4 + 2  # 2 not JSON, 2 not records
    assert tr.truncated == 1
    assert [p.t for p in tr.probes] == [T + 1.5 - t0]
    assert tr.ticks == [T + 1 - t0]
    assert [t for t, _ in tr.limits] == [float(int(T) + 4) - t0]


def test_a_recording_read_a_few_lines_at_a_time_loads_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests are converted a chunk of lines at a time, against the first
    chunk's earliest instant: a later chunk with an earlier record (the
    fixture's `late` member) sends the whole reading back to the records
    all at once; the trace is the same either way."""
    d = tmp_path / "rec"
    _recording(d)
    whole = Trace.load(d)
    monkeypatch.setattr(recording, "READ_CHUNK", 64)  # a few lines a chunk
    seen: list[object] = []
    real = trace_mod._chunked

    def spy(*args: Any) -> object:
        out = real(*args)
        seen.append(out)
        return out

    monkeypatch.setattr(trace_mod, "_chunked", spy)
    chunked = Trace.load(d)
    assert seen == [None]  # (the late records: read again all at once)
    assert repr(chunked) == repr(whole)


def test_a_trace_in_time_order_is_converted_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [orjson.dumps({"k": "policy", "t": T, "hash": "h", "knobs": {}})]
    lines += [_req(0.1 * i, sid="s1" if i % 3 else None) for i in range(200)]
    lines.insert(50, b"not json")
    lines.insert(90, orjson.dumps({"k": "tick", "t": T + 3}))
    lines.insert(120, _req(5.0, s="200"))  # not readable
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(_member(lines[:100]) + _member(lines[100:]))
    reader = Reader()
    whole = Trace._build(trace_mod._parsed(reader, path), str(path), in_order=False)
    whole.skipped += reader.skipped  # (as `load` does)
    monkeypatch.setattr(recording, "READ_CHUNK", 32)
    assert len(list(Reader().raw_chunks(path))) > 10
    reader = Reader()
    chunked = trace_mod._chunked(Trace, reader, [path], str(path))
    assert chunked is not None
    chunked.skipped += reader.skipped
    assert repr(chunked) == repr(whole)
    assert chunked.skipped == 2 and len(chunked.requests) == 200


def _wanted(taken: list[list[bytes]], rank: int) -> bool:
    return len(taken) % 2 == rank


def test_chunks_not_wanted_are_not_split_and_the_rest_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`raw_chunks(path, want)`: the same chunks, one for one; those `want`
    turns down come as no lines, the others as without `want` (a line
    across a chunk turned down is whole in the next one)."""
    lines = [_req(0.1 * i) for i in range(200)]
    lines.insert(77, b"")
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(_member(lines[:100]) + _member(lines[100:]))
    plain = tmp_path / "t.jsonl"
    plain.write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setattr(recording, "READ_CHUNK", 40)
    for path in (gz, plain):
        every = list(Reader().raw_chunks(path))
        for rank in (0, 1):
            some: list[list[bytes]] = []
            want = functools.partial(_wanted, some, rank)
            for chunk in Reader().raw_chunks(path, want):
                some.append(chunk)
            assert len(some) == len(every)
            assert some == [c if k % 2 == rank else [] for k, c in enumerate(every)]


def _shared_load(path: Path) -> tuple[Trace, Trace, list[bool]]:
    """`Trace.load` by two readers sharing the work (`Peer`: threads here,
    the replay's two processes in `run_replay`), and whether each shared it."""
    import os
    import threading

    down, up = os.pipe(), os.pipe()
    peers = [trace_mod.Peer(0, up[0], down[1]), trace_mod.Peer(1, down[0], up[1])]
    out: list[Trace | None] = [None, None]

    def read(k: int) -> None:
        out[k] = Trace.load(path, peer=peers[k])

    readers = [threading.Thread(target=read, args=(k,)) for k in (0, 1)]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    a, b = out
    assert a is not None and b is not None
    return a, b, [not p._open for p in peers]


@pytest.mark.parametrize("chunk", [64, 300, 1 << 16])
def test_a_reading_shared_by_two_loads_the_same_in_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Two readers of one recording each parse every other chunk and
    exchange what they converted: both get the trace one reader gets —
    a recording in time order (shared), one with a later chunk holding an
    earlier record (both read it all at once), the drills' recordings."""
    monkeypatch.setattr(recording, "READ_CHUNK", chunk)
    shared: list[bool] = []
    real = trace_mod._shared

    def spy(*args: Any) -> object:
        out = real(*args)
        shared.append(out is not None)
        return out

    monkeypatch.setattr(trace_mod, "_shared", spy)
    lines = [orjson.dumps({"k": "seg", "t": T - 5, "v": 1, "pid": 1})]
    lines += [orjson.dumps({"k": "policy", "t": T, "hash": "h", "knobs": {}})]
    lines += [_req(0.1 * i, sid="s1" if i % 3 else None) for i in range(300)]
    lines.insert(50, b"not json")
    lines.insert(90, orjson.dumps({"k": "tick", "t": T + 3}))
    lines.insert(120, _req(5.0, s="200"))  # not readable
    lines.insert(130, _req(6.0, att=[]))
    lines.insert(140, _req(7.0, ttft=1, d=2))  # ints
    in_order = tmp_path / "t.jsonl.gz"
    in_order.write_bytes(_member(lines[:100]) + _member(lines[100:]))
    late = tmp_path / "rec"
    _recording(late)
    fixtures = Path(__file__).parents[1] / "fixtures" / "recordings"
    for path in [in_order, late, *sorted(fixtures.iterdir())]:
        shared.clear()
        alone = Trace.load(path)
        a, b, closed = _shared_load(path)
        assert repr(a) == repr(alone) and repr(b) == repr(alone), path.name
        assert closed == [True, True]
        if path is in_order and chunk < 1 << 16:
            assert shared == [True, True]
        if path is late:
            assert shared == [False, False]


def test_a_reader_whose_peer_is_gone_reads_alone(tmp_path: Path) -> None:
    import os

    lines = [_req(0.1 * i) for i in range(50)]
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(_member(lines))
    down, up = os.pipe(), os.pipe()
    os.close(down[0])  # the other's ends: closed (it failed, or died)
    os.close(up[1])
    tr = Trace.load(path, peer=trace_mod.Peer(0, up[0], down[1]))
    assert repr(tr) == repr(Trace.load(path))
