"""The flight recorder: what the control code saw and did, written off the loop.

The event loop only appends a tuple to a bounded deque (`put`: no lock, no
wake-up, no encoding); a writer thread wakes once a second, turns what is
queued into JSON lines (`proxy.telemetry.recording` has the format),
compresses them into one gzip member, appends it to the current segment and
flushes it, so a crash loses at most the last second. So:

- serving never waits for the disk: a stalled disk stalls the writer, the
  queue fills up to `QUEUE_MAX` and further records are dropped and counted
  (`dropped`; `brownout_recorder_dropped_total{reason="queue_full"}`; a `gap`
  record marks the hole once the writer gets going again);
- a full disk (or any write error) stops recording, never serving: the
  records of that second are counted as lost (`reason="write_error"`), the
  error is shown in `/brownout/status`, and writing is tried again every
  `RETRY_S` (after deleting what the retention allows);
- segments rotate every `SEGMENT_S` or `segment_bytes`; the oldest are
  deleted beyond `recorder.max_mb` or `recorder.keep_hours`.

Session ids and client identities are hashed with a key drawn per process
(linkable within one run of the proxy, not to the ids themselves).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

from proxy.policy.recorder import RecorderPolicy
from proxy.telemetry.recording import FORMAT_VERSION, gzip_member, segment_name, segments

log = structlog.get_logger("brownout.recorder")

FLUSH_S = 1.0  # one gzip member per second: what a crash can lose
QUEUE_MAX = 200_000  # records waiting for the writer; beyond, dropped and counted
SEGMENT_S = 600.0  # a segment is closed after this long...
MAX_SEGMENT_BYTES = 64 << 20  # ...or this large (or max_mb / 16, if smaller)
MIN_SEGMENT_BYTES = 256 << 10
RETRY_S = 10.0  # after a write error, writing is tried again after this long
PRUNE_S = 60.0  # retention is applied at least this often
MIB = 1 << 20
HASHES_KEPT = 100_000
# zlib level 3: a quarter of level 6's CPU for about a fifth more bytes (the
# writer's CPU is the recorder's cost to serving; the disk is bounded anyway).
LEVEL = 3


class Recorder:
    """One per process (kept across reloads while `recorder.dir` stays)."""

    def __init__(
        self,
        policy: RecorderPolicy,
        wall_offset: float,
        *,
        flush_s: float = FLUSH_S,
        queue_max: int = QUEUE_MAX,
        segment_s: float = SEGMENT_S,
        opener: Callable[[Path], IO[bytes]] | None = None,
    ) -> None:
        self.policy = policy
        self.dir = Path(policy.dir)
        self.wall_offset = wall_offset  # wall time = clock time + this
        self.flush_s = flush_s
        self.queue_max = queue_max
        self.segment_s = segment_s
        self._open = opener or (lambda p: p.open("ab"))
        self._q: collections.deque[tuple[Any, ...]] = collections.deque()
        self._key = os.urandom(16)
        self._hashes: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brownout-recorder", daemon=True)
        # Counters (written by one thread each, read anywhere).
        self.dropped = 0  # queue full: the loop thread
        self.lost = 0  # encoded but not written (write error, disk full): the writer
        self.written = 0  # records written
        self.bytes_on_disk = 0
        self.segment_count = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.disk_full = False
        self.flushes = 0
        # The writer's own state.
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._size = 0
        self._n = 0
        self._blocked_until = 0.0
        self._reported_drops = 0
        self._last_prune = 0.0
        self._policy_line: bytes | None = None
        self._encoders: dict[str, Callable[..., dict[str, Any]]] = {
            "req": self._req,
            "probe": _probe,
            "breaker": _breaker,
            "engine": _engine,
            "sample": _sample,
            "tier": _tier,
            "limit": _limit,
            "force": _force,
            "tick": _tick,
            "policy": self._policy,
            "reload": _reload,
        }

    # -- the loop's side (cheap) -----------------------------------------------------

    def put(self, item: tuple[Any, ...]) -> None:
        """Queue one record (a tuple: kind, clock time, fields); never blocks."""
        q = self._q
        if len(q) >= self.queue_max:
            self.dropped += 1
            return
        q.append(item)

    @property
    def queued(self) -> int:
        return len(self._q)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop without waiting: the writer flushes what is queued and ends."""
        self._stop.set()

    def close(self, timeout: float = 2.0) -> None:
        """Flush what is queued (for at most `timeout`) and stop the writer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def retune(self, policy: RecorderPolicy) -> None:
        """Same directory, new limits (max_mb, keep_hours, content)."""
        self.policy = policy

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "dir": str(self.dir),
            "segments": self.segment_count,
            "bytes": self.bytes_on_disk,
            "written": self.written,
            "queued": len(self._q),
            "dropped": self.dropped,
            "lost": self.lost,
            "writing": self._blocked_until <= time.monotonic(),
            "disk_full": self.disk_full,
            "last_error": self.last_error,
        }

    def hash(self, value: str) -> str:
        """The keyed hash of a session id or client identity (they repeat:
        remembered, up to HASHES_KEPT of them)."""
        h = self._hashes.get(value)
        if h is None:
            if len(self._hashes) >= HASHES_KEPT:
                self._hashes.clear()
            h = self._hashes[value] = hashlib.blake2b(
                value.encode("utf-8", "surrogateescape"), key=self._key, digest_size=8
            ).hexdigest()
        return h

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        deadline = time.monotonic() + self.flush_s
        while True:
            stopping = self._stop.wait(max(0.0, deadline - time.monotonic()))
            now = time.monotonic()
            deadline = max(deadline + self.flush_s, now + self.flush_s / 4)
            try:
                self.flush_once()
            except Exception as exc:  # never let the thread die: report it
                self._error(f"{type(exc).__name__}: {exc}", blocked=False)
            if stopping:
                break
        self._close_segment()

    def flush_once(self) -> int:
        """Write what is queued as one member of the current segment; returns
        the number of records written. (The writer thread's step; tests call
        it directly.)"""
        q = self._q
        lines: list[bytes] = []
        n = len(q)
        for _ in range(n):
            item = q.popleft()
            try:
                rec = self._encoders[item[0]](*item[1:])
            except Exception:  # a record the encoder cannot take: lost, counted
                self.lost += 1
                continue
            # Full precision (no rounding: it costs more than the bytes): the
            # order of near events (a scrape and a window) is the replay's.
            rec["t"] = item[1] + self.wall_offset
            if item[0] == "policy":
                self._policy_line = orjson.dumps(rec)
                lines.append(self._policy_line)
            else:
                lines.append(orjson.dumps(rec, default=str))
        drops = self.dropped - self._reported_drops
        if drops:
            self._reported_drops = self.dropped
            lines.append(orjson.dumps({"k": "gap", "t": round(time.time(), 3), "dropped": drops}))
        now = time.monotonic()
        if now - self._last_prune >= PRUNE_S:
            self._prune(now)
        if not lines:
            return 0
        if now < self._blocked_until:
            self.lost += len(lines)
            return 0
        try:
            head = self._rotate(now)
            data = gzip_member(b"\n".join([*head, *lines]) + b"\n", LEVEL)
            f = self._file
            assert f is not None
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            self.lost += len(lines)
            self.disk_full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._error(f"{type(exc).__name__}: {exc.strerror or exc}", blocked=True)
            self._close_segment()
            return 0
        self._size += len(data)
        self.bytes_on_disk += len(data)
        self.written += len(lines)
        self.flushes += 1
        if self.disk_full or self.last_error:
            log.info("recorder_writing_again", dir=str(self.dir))
            self.disk_full = False
            self.last_error = None
        return len(lines)

    def _error(self, text: str, *, blocked: bool) -> None:
        first = self.last_error is None
        self.last_error = text
        self.last_error_at = time.time()
        if blocked:
            self._blocked_until = time.monotonic() + RETRY_S
        if first:
            log.error(
                "recorder_write_failed",
                dir=str(self.dir),
                error=text,
                disk_full=self.disk_full,
                retry_s=RETRY_S,
            )

    def _segment_bytes(self) -> int:
        cap = int(self.policy.max_mb * MIB / 16)
        return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, cap))

    def _rotate(self, now: float) -> list[bytes]:
        """Open a segment if none is open or the current one is full or old;
        returns the lines a new segment starts with."""
        if self._file is not None and (
            now - self._opened_at < self.segment_s and self._size < self._segment_bytes()
        ):
            return []
        self._close_segment()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._n += 1
        wall = time.time()
        path = self.dir / segment_name(wall, os.getpid(), self._n)
        self._file = self._open(path)
        self._path = path
        self._opened_at = now
        self._size = 0
        self._prune(now)
        head = [
            orjson.dumps({"k": "seg", "t": round(wall, 3), "v": FORMAT_VERSION, "pid": os.getpid()})
        ]
        if self._policy_line is not None:
            # Each segment carries the policy in force: a window of it replays alone.
            rec = orjson.loads(self._policy_line)
            rec["t"], rec["reason"] = round(wall, 3), "segment"
            head.append(orjson.dumps(rec))
        return head

    def _close_segment(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def _prune(self, now: float) -> None:
        """Delete the oldest segments beyond max_mb (keeping room for the
        current one to fill up) or older than keep_hours (never the one being
        written); recount what is on disk."""
        self._last_prune = now
        files = segments(self.dir)
        sizes: list[tuple[Path, int, float]] = []
        for p in files:
            try:
                st = p.stat()
            except OSError:
                continue
            sizes.append((p, st.st_size, st.st_mtime))
        total = sum(s for _, s, _ in sizes)
        # Room for the segment being written to grow to its full size.
        budget = self.policy.max_mb * MIB - max(0, self._segment_bytes() - self._size)
        horizon = time.time() - self.policy.keep_hours * 3600
        kept = len(sizes)
        for p, size, mtime in sizes:
            if p == self._path:
                continue
            if total > budget or mtime < horizon:
                try:
                    p.unlink()
                except OSError:
                    continue
                total -= size
                kept -= 1
        self.bytes_on_disk = total
        self.segment_count = kept

    # -- encoders (writer thread) ------------------------------------------------------

    def _req(
        self,
        _t: float,
        ep: str,
        pri: str,
        stream: bool,
        session: str | None,
        raw_len: int,
        mt: object,
        attempts: list[tuple[Any, ...]] | None,
        backend: str,
        status: int,
        outcome: str,
        ttft: float | None,
        elapsed: float,
        events: int | None,
        retries: int,
        rescued: bool,
        who: str | None,
        tier: str,
        content: tuple[Any, str | None] | None,
    ) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "k": "req",
            "ep": ep,
            "pri": pri,
            "st": stream,
            "sid": self.hash(session) if session else None,
            "cl": self.hash(who) if who else None,
            "pt": max(1, raw_len // 4),
            "mt": mt if isinstance(mt, int) else None,
            "att": [
                [
                    b,
                    kind,
                    st,
                    fault or None,
                    tt,
                    end - _t,
                    None if start is None else start - _t,
                ]
                for b, kind, st, fault, tt, end, start in attempts or ()
            ],
            "be": backend,
            "s": status,
            "o": outcome,
            "ttft": ttft,
            "d": elapsed,
            "n": events,
            "rt": retries,
            "res": rescued,
            "tier": tier,
        }
        if content is not None:
            rec["prompt"], rec["answer"] = content
        return rec

    def _policy(self, _t: float, policy: Any, reason: str) -> dict[str, Any]:
        digest, knobs = fingerprint(policy)
        return {"k": "policy", "hash": digest, "reason": reason, "knobs": knobs}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _probe(
    _t: float, b: str, ok: bool, definitive: bool, err: str | None, cf: int
) -> dict[str, Any]:
    return {"k": "probe", "b": b, "ok": ok, "def": definitive, "err": err, "cf": cf}


def _breaker(_t: float, b: str, model: str | None, old: str, new: str, why: str) -> dict[str, Any]:
    return {"k": "breaker", "b": b, "m": model, "from": old, "to": new, "why": why[:200]}


def _engine(
    _t: float, w: float, r: float, kv: float, rej: float, err: str | None
) -> dict[str, Any]:
    return {"k": "engine", "w": w, "r": r, "kv": round(kv, 4), "rej": rej, "err": err}


def _sample(
    _t: float,
    tier: str,
    lim: int,
    inf: int,
    q: int,
    p95: float | None,
    base: float | None,
    pres: bool,
    why: str,
    br: dict[str, str],
    up: dict[str, bool],
) -> dict[str, Any]:
    return {
        "k": "sample",
        "tier": tier,
        "lim": lim,
        "inf": inf,
        "q": q,
        "ttft_p95": _r(p95),
        "ttft_base": _r(base),
        "pres": pres,
        "why": why,
        "br": br,
        "up": up,
    }


def _tier(_t: float, old: str, new: str, why: str, detail: str) -> dict[str, Any]:
    return {"k": "tier", "from": old, "to": new, "why": why, "detail": detail[:200]}


def _tick(_t: float) -> dict[str, Any]:
    return {"k": "tick"}


def _force(_t: float, tier: str | None) -> dict[str, Any]:
    return {"k": "force", "tier": tier}


def _limit(_t: float, old: int, new: int) -> dict[str, Any]:
    return {"k": "limit", "from": old, "to": new}


def _reload(_t: float, ok: bool, policy: Any, changes: list[str]) -> dict[str, Any]:
    digest = fingerprint(policy)[0] if policy is not None else None
    return {"k": "reload", "ok": ok, "hash": digest, "changes": changes[:100]}


# Knobs a recording leaves out: FAQ text is content, and the shared-state URL
# and backend keys say nothing a replay uses.
_LEFT_OUT = ("faq.entries",)


def fingerprint(policy: Any) -> tuple[str, dict[str, Any]]:
    """(hash, knobs): the policy as dotted path → value with secrets redacted,
    and a short hash of that (what a reload record and `brownout replay` name)."""
    from proxy.policy import flatten, redact

    knobs = {
        path: redact(path, value)
        for path, value in flatten(policy).items()
        if not path.startswith(_LEFT_OUT)
    }
    blob = orjson.dumps(knobs, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.sha256(blob).hexdigest()[:16], orjson.loads(blob)
