"""The flight recorder's files: round trip, crash, rotation, retention, a
full disk and a stalled one (the writer is driven by hand: `flush_once`)."""

from __future__ import annotations

import base64
import gzip
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import orjson
import pytest

from proxy.policy import parse_policy
from proxy.policy.recorder import RecorderPolicy
from proxy.telemetry import recorder as recorder_mod
from proxy.telemetry.recorder import Recorder, fingerprint
from proxy.telemetry.recording import Reader, parse_when, read_trace, segments, window

POLICY = parse_policy("backends:\n  primary:\n    url: http://127.0.0.1:9\n")
OFFSET = float(int(time.time()))  # wall = clock + OFFSET (clock times: seconds from now)


def make(tmp_path: Path, **kw: Any) -> Recorder:
    pol = RecorderPolicy(enabled=True, dir=str(tmp_path / "rec"), **kw)
    return Recorder(pol, OFFSET)


def req(t: float, **over: Any) -> tuple[Any, ...]:
    base: dict[str, Any] = dict(
        ep="chat",
        pri="normal",
        st=True,
        session="session:abc",
        raw_len=40,
        mt=64,
        attempts=[("primary", "answered", 200, "", 0.12, t + 0.5, t + 0.1)],
        backend="primary",
        status=200,
        outcome="complete",
        ttft=0.13,
        elapsed=0.5,
        events=12,
        retries=0,
        rescued=False,
        who="ip:10.0.0.1",
        tier="normal",
        content=None,
    )
    base.update(over)
    return ("req", t, *base.values())


def test_every_kind_round_trips_with_wall_times(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.put(("policy", 10.0, POLICY, "start"))
    rec.put(req(11.0))
    rec.put(("probe", 11.2, "primary", False, True, "connection failed: refused", 1))
    rec.put(("breaker", 11.3, "primary", None, "closed", "open", "connect: refused"))
    rec.put(("engine", 11.4, 3.0, 8.0, 0.5, 0.0, None))
    sample = (
        "sample",
        12.0,
        "failover",
        8,
        1,
        0,
        0.2,
        0.1,
        False,
        "",
        {"primary": "open"},
        {"primary": False},
    )
    rec.put(sample)
    rec.put(("tier", 11.3, "normal", "failover", "primary_down", "primary breaker open"))
    rec.put(("limit", 12.5, 8, 6))
    rec.put(("reload", 13.0, True, POLICY, ["ladder.x: 1 -> 2"]))
    assert rec.flush_once() == 9
    recs = list(Reader().records(segments(tmp_path / "rec")[0]))  # as written
    kinds = [r["k"] for r in recs]
    assert kinds[:2] == ["seg", "policy"]  # the segment's head
    assert sorted(kinds[2:]) == sorted(
        ["policy", "req", "probe", "breaker", "engine", "sample", "tier", "limit", "reload"]
    )
    by = {r["k"]: r for r in recs[2:]}
    r = by["req"]
    assert r["t"] == pytest.approx(OFFSET + 11.0)
    assert r["att"] == [
        ["primary", "answered", 200, None, 0.12, pytest.approx(0.5), pytest.approx(0.1)]
    ]
    assert (r["s"], r["o"], r["ttft"], r["d"], r["n"], r["mt"]) == (
        200,
        "complete",
        0.13,
        0.5,
        12,
        64,
    )
    assert r["pt"] == 10  # 40 bytes ≈ 10 tokens
    # Hashed ids, no text by default.
    assert r["sid"] and "abc" not in r["sid"] and r["cl"] and "10.0.0" not in r["cl"]
    assert "prompt" not in r and "answer" not in r
    assert by["probe"] == {
        "k": "probe",
        "t": pytest.approx(OFFSET + 11.2),
        "b": "primary",
        "ok": False,
        "def": True,
        "err": "connection failed: refused",
        "cf": 1,
    }
    assert by["tier"]["to"] == "failover" and by["limit"] == {
        "k": "limit",
        "t": OFFSET + 12.5,
        "from": 8,
        "to": 6,
    }
    assert by["policy"]["hash"] == fingerprint(POLICY)[0]
    assert by["policy"]["knobs"]["ladder.breaker.fail_max"] == POLICY.ladder.breaker.fail_max
    assert by["reload"]["hash"] == fingerprint(POLICY)[0]


def test_content_only_when_asked(tmp_path: Path) -> None:
    rec = make(tmp_path, content=True)
    rec.put(req(1.0, content=([{"role": "user", "content": "x" * 40}], "hi")))
    rec.flush_once()
    (r,) = [r for r in read_trace(tmp_path / "rec") if r["k"] == "req"]
    assert r["prompt"] == [{"role": "user", "content": "x" * 40}] and r["answer"] == "hi"


def test_secrets_never_reach_the_recording(tmp_path: Path) -> None:
    pol = parse_policy(
        "server:\n  admin_token: s3cret-token\nbackends:\n  primary:\n"
        "    url: http://user:pa55word@127.0.0.1:9\n    api_key: sk-live-123\n"
    )
    rec = make(tmp_path)
    rec.put(("policy", 1.0, pol, "start"))
    rec.flush_once()
    text = b"".join(Reader().raw_lines(segments(tmp_path / "rec")[0]))
    for secret in (b"s3cret-token", b"pa55word", b"sk-live-123"):
        assert secret not in text


def test_a_crash_loses_at_most_the_unflushed_second(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.put(req(1.0))
    rec.flush_once()
    rec.put(req(2.0))
    rec.flush_once()
    path = segments(tmp_path / "rec")[0]
    whole = path.read_bytes()
    # The process dies while writing its third second: half a member on disk.
    rec.put(req(3.0))
    rec.flush_once()
    third = path.read_bytes()[len(whole) :]
    path.write_bytes(whole + third[: len(third) // 2])
    reader = Reader()
    reqs = [r for r in read_trace(path, reader) if r["k"] == "req"]
    assert [r["t"] - OFFSET for r in reqs] == [1.0, 2.0]
    assert reader.truncated == 1
    # Python's own gzip agrees that the first two seconds are whole members.
    assert gzip.decompress(whole).count(b'"k":"req"') == 2


def test_segments_rotate_and_the_oldest_go_beyond_max_mb(tmp_path: Path) -> None:
    rec = Recorder(
        RecorderPolicy(enabled=True, dir=str(tmp_path / "rec"), max_mb=1.0), OFFSET, segment_s=0.0
    )
    noise = base64.b64encode(os.urandom(45_000)).decode()  # barely compressible
    for i in range(40):
        rec.put(req(float(i), content=(None, noise), outcome=f"o{i}"))
        rec.policy = RecorderPolicy(enabled=True, dir=rec.policy.dir, max_mb=1.0, content=True)
        rec.flush_once()
    files = segments(tmp_path / "rec")
    total = sum(p.stat().st_size for p in files)
    assert total <= 1 << 20
    assert 1 < len(files) < 40
    assert rec.bytes_on_disk == total and rec.segment_count == len(files)
    # What is left is the newest, each segment readable on its own.
    outcomes = [r["o"] for r in read_trace(tmp_path / "rec") if r["k"] == "req"]
    assert outcomes == [f"o{i}" for i in range(40 - len(outcomes), 40)]


def test_segments_older_than_keep_hours_are_deleted(tmp_path: Path) -> None:
    rec = Recorder(
        RecorderPolicy(enabled=True, dir=str(tmp_path / "rec"), keep_hours=1.0),
        OFFSET,
        segment_s=0.0,
    )
    rec.put(req(1.0))
    rec.flush_once()
    old = segments(tmp_path / "rec")[0]
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    rec.put(req(2.0))
    rec.flush_once()  # a new segment: retention runs
    assert old not in segments(tmp_path / "rec") and len(segments(tmp_path / "rec")) == 1


def test_a_full_disk_stops_recording_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full")
    monkeypatch.setattr(recorder_mod, "RETRY_S", 0.0)
    good: list[bool] = [False]

    def opener(p: Path) -> IO[bytes]:
        return p.open("ab") if good[0] else full.open("wb")

    rec = Recorder(RecorderPolicy(enabled=True, dir=str(tmp_path / "rec")), OFFSET, opener=opener)
    rec.put(req(1.0))
    rec.put(req(1.5))
    assert rec.flush_once() == 0
    snap = rec.snapshot()
    assert snap["disk_full"] is True and "No space left" in (snap["last_error"] or "")
    assert rec.lost == 2
    # Space again: recording resumes by itself.
    good[0] = True
    rec.put(req(2.0))
    assert rec.flush_once() == 1
    assert rec.snapshot()["disk_full"] is False and rec.last_error is None
    assert [r["t"] - OFFSET for r in read_trace(tmp_path / "rec") if r["k"] == "req"] == [2.0]


class StalledFile:
    """A file whose writes block until released (an NFS mount gone away)."""

    def __init__(self, real: IO[bytes], gate: threading.Event) -> None:
        self.real, self.gate = real, gate

    def write(self, data: bytes) -> int:
        self.gate.wait()
        return self.real.write(data)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def test_a_stalled_disk_never_blocks_the_producer(tmp_path: Path) -> None:
    gate = threading.Event()
    rec = Recorder(
        RecorderPolicy(enabled=True, dir=str(tmp_path / "rec")),
        OFFSET,
        flush_s=0.01,
        queue_max=1000,
        opener=lambda p: StalledFile(p.open("ab"), gate),
    )  # type: ignore[arg-type,return-value]
    rec.start()
    try:
        item = req(1.0)
        rec.put(item)
        time.sleep(0.1)  # the writer took it and is now stuck in write()
        t0 = time.perf_counter()
        for _ in range(20_000):
            rec.put(item)
        per_put = (time.perf_counter() - t0) / 20_000
        assert per_put < 20e-6, f"{per_put * 1e6:.1f} µs per record with the disk stalled"
        assert rec.queued == 1000 and rec.dropped == 19_000
    finally:
        gate.set()
        rec.close()
    recs = read_trace(tmp_path / "rec")
    gaps = [r for r in recs if r["k"] == "gap"]
    assert sum(g["dropped"] for g in gaps) == 19_000  # the hole is marked in the recording
    assert sum(1 for r in recs if r["k"] == "req") == 1001


def test_a_window_carries_the_policy_in_force(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.put(("policy", 0.0, POLICY, "start"))
    for i in range(1, 10):
        rec.put(req(float(i), outcome=f"o{i}"))
    rec.flush_once()
    lines = list(window(tmp_path / "rec", OFFSET + 4.0, OFFSET + 6.0))
    recs = [orjson.loads(x) for x in lines]
    assert recs[0]["k"] == "policy"
    assert [r["o"] for r in recs[1:]] == ["o4", "o5", "o6"]


def test_parse_when() -> None:
    assert parse_when("1767225600") == 1767225600.0
    assert parse_when("2026-01-01T00:00:00Z") == 1767225600.0
    assert parse_when("2026-01-01T00:00:00") == 1767225600.0
    assert parse_when("-15m", now=1000.0) == 100.0
    with pytest.raises(ValueError, match="isoformat"):
        parse_when("yesterday")
