"""Runs of stream chunks that differ only in their text.

vLLM wraps every token in the same envelope — `data: {"id":…,"object":…,
"created":…,"model":…,"choices":[{"index":0,"delta":{"content":"` + text +
`"},"logprobs":null,"finish_reason":null}]}` and a blank line. When a read
returns many events at once (a fast engine, a slow client catching up), the
relay's marker searches and the guard's shape checks would scan all those
envelope bytes. Once a stream's envelope is known, the region's lines (cut at
memchr speed by `BytesIO.readlines`), a slice per event and one comparison of
the rebuilt bytes with the original, in place, prove that a run of events
holds nothing but text chunks — no error, no finish, no `[DONE]` — and hand
over the text literals. (`bytes.split` on a newline walks the bytes one by
one: on a 1,024-chunk burst it cost more than the rest of the relay's work
on it.)

Sound because a JSON string cannot hold a raw newline: cutting at `\\n`
finds every event, and byte equality with `prefix + literal + suffix` for
each leaves nothing unchecked. Each literal must also be a whole JSON string
body (no bare `"`, no escape cut off), so the joined literals decode to the
joined texts.

Two implementations, one verdict: the C scanner `proxy.openai._runscan`
(built by setup.py where a compiler exists: one pass of memcmp/memchr, no
object per event) and the pure-Python cut below (`BytesIO.readlines`, a slice
per event, the rebuilt envelope compared in place). `BROWNOUT_PURE=1` forces
the pure one; `tests/unit/test_runscan.py` holds the two to the same answers.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable
from io import BytesIO
from typing import Final, NamedTuple, cast

from proxy.openai.chunks import CONTENT_RE, TEXT_RE, single_choice_events

# Below this a region is a few events: the plain searches are as cheap.
MIN_RUN_BYTES: Final = 2048
# Envelopes that vary per chunk (e.g. usage on every chunk) never form runs;
# stop trying after this many failed attempts to learn one.
MAX_LEARN_FAILURES: Final = 4
# Envelope bytes rebuilt per comparison (`ChunkRuns.cut`): half of glibc's
# mmap threshold (128 KB), whatever the envelope's size.
JOIN_BYTES: Final = 64 << 10
# A whole JSON string body (what the C scanner checks byte by byte).
_WHOLE: Final = re.compile(rb'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')

Scan = Callable[[bytes, int, int, bytes, bytes], "tuple[int, bytes, int] | None"]
# The C scanner's interface version this module speaks (`_runscan.ABI`).
NATIVE_ABI: Final = 1


def native_scan() -> Scan | None:
    """The C scanner, or None: not built (no compiler), built from another
    version of its source, or `BROWNOUT_PURE=1`."""
    if os.environ.get("BROWNOUT_PURE") == "1":
        return None
    try:
        from proxy.openai import _runscan  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None
    if getattr(_runscan, "ABI", None) != NATIVE_ABI:
        return None
    return cast("Scan", _runscan.scan)


# Chosen once, at import.
NATIVE: Final = native_scan()


class Run(NamedTuple):
    """`region[start:end]` is `len(literals)` text chunks of one envelope.
    (A NamedTuple: one per region, made at C speed; a frozen dataclass sets
    each field through object.__setattr__.)"""

    start: int
    end: int
    events: int  # events in the run
    raw: bytes  # their JSON string contents (escapes kept), joined: whole literals
    empties: int  # events whose literal is empty
    chat: bool = True  # the literals are `"content"` (chat), else `"text"` (completions)


class ChunkRuns:
    """Per stream: learns the envelope, then finds runs of it in regions."""

    __slots__ = (
        "_batch",
        "_chat",
        "_failures",
        "_junction",
        "_last",
        "_literal",
        "_prefix",
        "_scan",
        "_suffix",
    )

    def __init__(self, scan: Scan | None = NATIVE) -> None:
        self._scan = scan
        self._prefix = b""
        self._suffix = b""
        self._junction = b""
        self._batch = 1
        self._literal: Callable[[bytes], bytes] | None = None
        self._chat = True
        self._last: bytes | None = None
        self._failures = 0

    def cut(self, region: bytes) -> Run | None:
        """The run of envelope chunks in `region` (whole events, LF line
        ends), if one is there and the region is big enough to be worth it.

        The envelope is learnt from the last event of the previous region, or
        from the middle of a big first region; small single-read answers never
        pay for learning.
        """
        literal = self._literal
        big = len(region) >= MIN_RUN_BYTES
        if literal is None:
            last, self._last = self._last, region
            if self._failures >= MAX_LEARN_FAILURES:
                return None
            if last is not None:
                # Its last event; all of it when it holds one (rfind's -1
                # would cut its first byte: a stream read one event at a time
                # never learnt, and gave up after MAX_LEARN_FAILURES reads).
                at = last.rfind(b"\n\n", 0, len(last) - 2)
                event = last[at + 2 :] if at >= 0 else last
            elif big:  # from its middle: the first and last chunks are special
                at = region.find(b"\n\n", len(region) // 2) + 2
                event = region[at : region.find(b"\n\n", at) + 2]
            else:
                return None
            if not self._learn(event):
                return None
            literal = self._literal
            assert literal is not None
        if not big:
            return None
        prefix, suffix = self._prefix, self._suffix
        if region.startswith(prefix):
            i = 0
        else:
            i = region.find(b"\n\n" + prefix)
            if i < 0:
                # The envelope changed (or never was the common one): relearn.
                self._literal = None
                self._last = region
                return None
            i += 2
        n = len(region)
        if region.endswith(suffix):
            j = n
        else:
            j = region.rfind(suffix)
            if j < i:
                return None
            j += len(suffix)
        lp, ls = len(prefix), len(suffix)
        if j - i < lp + ls:
            return None
        scan = self._scan
        if scan is not None:
            found = scan(region, i, j, prefix, suffix)
            if found is None:
                return None
            return Run(i, j, found[0], found[1], found[2], self._chat)
        return self._cut_pure(region, i, j)

    def _cut_pure(self, region: bytes, i: int, j: int) -> Run | None:
        """`cut`'s run in pure Python: region[i:j] starts with the prefix
        and ends with the suffix."""
        literal = self._literal
        assert literal is not None
        n = len(region)
        lp, ls = len(self._prefix), len(self._suffix)
        # region[:i] and region[i:j] both end with a newline, so the lines of
        # region[i:j] are lines[h:t] of the region's: e1, "", e2, "", …, ek, ""
        # (each with its newline), after the h lines of region[:i] and before
        # those of region[j:] (a few events each: counted on their own).
        lines = BytesIO(region).readlines()
        h = region.count(b"\n", 0, i) if i else 0
        t = len(lines) - (region.count(b"\n", j) + (not region.endswith(b"\n")) if j < n else 0)
        literals = list(map(literal, lines[h : t - 1 : 2]))
        # region[i:j] == prefix + junction.join(literals) + suffix, compared
        # in place (it starts with prefix and ends with suffix already), one
        # batch of literals (JOIN_BYTES of envelope) at a time: one join of a
        # 1,024-chunk burst is a ~180 KB block, which glibc may map fresh and
        # fault in page by page on every request (~70 us in a loop on the dev
        # box, invisible to callgrind). Same bytes compared, same verdict.
        junction, batch = self._junction, self._batch
        at, end = i + lp, j - ls
        if len(literals) <= batch:  # one batch (a short answer): no slicing
            body = junction.join(literals)
            if len(body) != end - at or not region.startswith(body, at):
                return None
            return self._whole(i, j, literals)
        for b in range(0, len(literals), batch):
            if b:
                if not region.startswith(junction, at):
                    return None
                at += len(junction)
            piece = junction.join(literals[b : b + batch])
            if not region.startswith(piece, at):
                return None
            at += len(piece)
        if at != end:
            return None
        return self._whole(i, j, literals)

    def _whole(self, i: int, j: int, literals: list[bytes]) -> Run | None:
        """The run, if every literal is a whole JSON string body."""
        raw = b"".join(literals)
        if (raw.find(b"\\") >= 0 or raw.find(b'"') >= 0) and not all(
            map(_WHOLE.fullmatch, literals)
        ):
            return None
        return Run(i, j, len(literals), raw, literals.count(b""), self._chat)

    def _learn(self, event: bytes) -> bool:
        # One data line: the scanners cut events at newlines, and the C one
        # refuses (ValueError) an envelope with a newline anywhere but the
        # suffix's last two bytes. SSE lets an upstream send one event as
        # several `data:` lines (single_choice_events counts 2k newlines for
        # k choices markers: two markers, two lines).
        ok = (
            event.startswith(b"data: {")
            and event.endswith(b"}\n\n")
            and event.find(b"\n") == len(event) - 2
            and single_choice_events(event)
        )
        m = None
        if ok:
            found = [*CONTENT_RE.finditer(event), *TEXT_RE.finditer(event)]
            m = found[0] if len(found) == 1 else None
        if m is None:
            self._failures += 1
            return False
        prefix, suffix = event[: m.start(1)], event[m.end(1) :]
        if (
            prefix.find(b'"choices"') < 0
            or prefix.find(b'"role"') >= 0  # the first chunk of a chat answer
            or (
                suffix.find(b'"finish_reason":null') < 0
                and suffix.find(b'"finish_reason": null') < 0
            )
        ):
            self._failures += 1
            return False
        self._prefix, self._suffix, self._junction = prefix, suffix, suffix + prefix
        self._batch = max(16, JOIN_BYTES // len(self._junction))
        self._chat = m.re is CONTENT_RE
        # A C-level slice per event line (the line ends with one newline of the
        # suffix's two).
        self._literal = cast(
            "Callable[[bytes], bytes]", operator.itemgetter(slice(len(prefix), 1 - len(suffix)))
        )
        return True
