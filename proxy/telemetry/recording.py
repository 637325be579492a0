"""The flight recorder's files: naming, reading, time windows.

A recording is a directory of segments, `rec-<start>-<pid>-<n>.jsonl.gz`
(`<start>`: the wall-clock second the segment was opened, zero-padded, so
names sort by time). A segment is a series of gzip members, one per second
of recording, each holding whole JSON lines: a process that dies loses at
most the second it had not flushed, and a member cut short by the crash is
read up to its last whole line (`read_segment`). One record per line, its
kind in `k` and its wall-clock time in `t` (Unix seconds):

    seg      a segment's first line: format version `v`, `pid`
    policy   the policy in force: `hash`, `knobs` (dotted path → value, secrets
             redacted); at start, after each reload and at the top of each segment
    reload   a reload: `ok`, `hash`, `changes`
    req      one request, at its arrival time: endpoint `ep`, priority `pri`,
             stream `st`, hashed session `sid` and client `cl`, prompt tokens
             `pt` (estimated: the client's body bytes / 4; a session's history
             is not in it), `mt` max_tokens, the attempts `att`
             ([backend, kind, status, fault, ttft, end offset s, offset s of the
             backend call, after admission: null if it never called] each), what the
             client got (`be` backend, `s` status, `o` outcome, `ttft` client
             TTFT, `d` duration, `n` events out), retries `rt`, rescued `res`,
             tier `tier` at its end; prompt and answer text only with
             `recorder.content`
    probe    a health probe: backend `b`, `ok`, `def` (definitive: refused / 503),
             `err`, `cf` consecutive failures
    breaker  a breaker transition: `b`, `m` model, `from`, `to`, `why`
    engine   a vLLM /metrics scrape: waiting `w`, running `r`, KV cache `kv`,
             queue-full rejections `rej`
    sample   once a second: tier, admission `lim`/`inf`/`q`, TTFT p95 of the short
             window and of the baseline, pressure, breakers `br`, backends up `up`
    tier     a tier transition: `from`, `to`, `why`, `detail`
    limit    an admission limit change: `from`, `to`
    force    an operator forced a tier (`tier`) or released it (`tier` null)
    tick     the ladder's evaluation window ran (its instants: a replay keeps them)
    gap      records lost to a full queue or a write error since the last flush

The reader never trusts a file: a line that is not a JSON object, or a
segment that is not gzip, is skipped and counted (`Reader.skipped`).
"""

from __future__ import annotations

import gzip
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

FORMAT_VERSION = 1
SEGMENT_RE = re.compile(r"^rec-(\d{10})-(\d+)-(\d+)\.jsonl\.gz$")
READ_CHUNK = 1 << 16


def segment_name(start: float, pid: int, n: int) -> str:
    return f"rec-{int(start):010d}-{pid}-{n:05d}.jsonl.gz"


def segment_start(path: Path) -> float | None:
    m = SEGMENT_RE.match(path.name)
    return float(m.group(1)) if m else None


def segments(directory: Path) -> list[Path]:
    """The recording's segments, oldest first (by start second, pid, number)."""
    try:
        names = [e.name for e in os.scandir(directory) if e.is_file()]
    except OSError:
        return []
    found = []
    for name in names:
        m = SEGMENT_RE.match(name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2)), int(m.group(3))), name))
    return [directory / name for _, name in sorted(found)]


def gzip_member(data: bytes, level: int = 6) -> bytes:
    """`data` as one complete gzip member (members concatenate into a valid file)."""
    c = zlib.compressobj(level, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


@dataclass
class Reader:
    """Reads segments leniently, counting what it had to skip."""

    skipped: int = 0  # lines that were not JSON objects
    truncated: int = 0  # segments cut short (a crash mid-member): read up to it
    unreadable: list[str] = field(default_factory=list)

    def raw_lines(self, path: Path) -> Iterator[bytes]:
        """Whole lines of a segment, member by member; a member cut short
        yields its whole lines and ends the segment."""
        for lines in self.raw_chunks(path):
            yield from lines

    def raw_chunks(
        self, path: Path, want: Callable[[], bool] | None = None
    ) -> Iterator[list[bytes]]:
        """`raw_lines`, a list of them at a time (a chunk of the file): a
        reader of millions of lines need not resume a generator for each.
        `want`: asked before each chunk is split into lines; a chunk it
        does not want is yielded as no lines (`[]`) without the split (the
        same chunks, one for one: a reader that takes every other one)."""
        if path.suffix != ".gz":
            with path.open("rb") as f:
                data = f.read()
            yield [ln for ln in data.splitlines() if ln] if want is None or want() else []
            return
        try:
            f = path.open("rb")
        except OSError as exc:
            self.unreadable.append(f"{path.name}: {exc.strerror or exc}")
            return
        with f:
            d = zlib.decompressobj(31)
            fed = False  # `d` has taken bytes of a member not yet complete
            tail = b""
            while chunk := f.read(READ_CHUNK):
                data = chunk
                while data:
                    try:
                        out = d.decompress(data)
                    except zlib.error:
                        self.unreadable.append(f"{path.name}: not a gzip stream")
                        return
                    fed = True
                    if out:
                        if want is None or want():
                            lines = (tail + out).split(b"\n")
                            tail = lines.pop()
                            yield lines if all(lines) else [ln for ln in lines if ln]
                        else:  # (its lines not wanted: only the last one's start)
                            cut = out.rfind(b"\n")
                            tail = tail + out if cut < 0 else out[cut + 1 :]
                            yield []
                    if d.eof:
                        data = d.unused_data
                        d = zlib.decompressobj(31)
                        fed = False
                    else:
                        data = b""
            if fed or tail:
                # Cut short by a crash: its whole lines were read; the rest
                # (`tail`, a line without its newline) is dropped.
                self.truncated += 1

    def records(self, path: Path) -> Iterator[dict[str, Any]]:
        for line in self.raw_lines(path):
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.skipped += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("t"), int | float):
                yield rec
            else:
                self.skipped += 1


def read_trace(path: Path, reader: Reader | None = None) -> list[dict[str, Any]]:
    """Every record of a recording (a directory of segments, one segment, or a
    plain or gzipped JSON-lines file as `GET /brownout/recording` streams it),
    in time order (stable: records of one instant keep their written order)."""
    reader = reader or Reader()
    files = segments(path) if path.is_dir() else [path]
    out: list[dict[str, Any]] = []
    for f in files:
        out.extend(reader.records(f))
    out.sort(key=lambda r: r["t"])
    return out


# A request is written when it ends, stamped with its arrival: a segment can
# hold records this much older than its own start.
LATE_S = 1800.0


def window(
    directory: Path, since: float, until: float, reader: Reader | None = None
) -> Iterator[bytes]:
    """JSON lines of the records with `since <= t <= until`, in written order
    (oldest segment first), preceded by the last `policy` record written
    before `since`, stamped with the window's first time (so a window can be
    replayed on its own). Blocking: run it off the event loop."""
    reader = reader or Reader()
    files = segments(directory)
    starts = [segment_start(f) or 0.0 for f in files]
    chosen: list[Path] = []
    for i, f in enumerate(files):
        nxt = starts[i + 1] if i + 1 < len(files) else float("inf")
        if starts[i] - LATE_S <= until and nxt >= since - 1:
            chosen.append(f)
    policy: bytes | None = None
    started = False
    for f in chosen:
        for line in reader.raw_lines(f):
            t = _time_of(line)
            if t is None:
                continue
            if t < since:
                if b'"k":"policy"' in line:
                    policy = line
                continue
            if t > until:
                continue
            if not started:
                started = True
                if policy is not None and b'"k":"policy"' not in line:
                    # In force from before the window: stamped with its start.
                    rec = orjson.loads(policy)
                    rec["t"] = t
                    yield orjson.dumps(rec) + b"\n"
            yield line + b"\n"


def _time_of(line: bytes) -> float | None:
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    t = rec.get("t") if isinstance(rec, dict) else None
    return float(t) if isinstance(t, int | float) else None


_REL_RE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_when(text: str, now: float | None = None) -> float:
    """A time as Unix seconds from `1767225600`, `-15m` (before now: s, m, h,
    d) or ISO 8601 (`2026-01-01T00:00:00Z`; no zone = UTC). ValueError if none."""
    now = time.time() if now is None else now
    text = text.strip()
    m = _REL_RE.match(text)
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    from datetime import UTC, datetime

    iso = text[:-1] + "+00:00" if text.endswith("Z") else text
    dt = datetime.fromisoformat(iso)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def write_lines(path: Path, lines: Iterable[bytes]) -> int:
    """Write `lines` to `path`, gzipped when it ends in .gz; returns the count."""
    n = 0
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        for ln in lines:
            f.write(ln)
            n += 1
    return n
