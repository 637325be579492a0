"""Where a rescue's continuation meets the answer the client already has.

A continuation requested by prompt is often answered from the start (models
and simple servers alike): the seam is checked, not trusted. `align` decides,
on text only, how many characters of the continuation's start the client
already has; the rescue buffers the continuation until it decides
(`proxy.pipeline.seamread`), and `strip_events` drops them from the
buffered events.

The rule (comparison on a normalised form: every run of whitespace is one
space, letters are case-folded, leading whitespace of either text is ignored):

- **restart**: the continuation starts with the whole sent text: that
  repeated prefix is dropped (the client's text becomes the continuation's).
- **overlap**: it starts with a tail of the sent text that begins at a word
  start and holds at least `MIN_OVERLAP_WORDS` words: that tail is dropped
  (the client's text becomes the sent text with its tail rewritten by the
  continuation). One repeated word is left alone: "that that" can be prose.
- **misaligned**: it starts like the sent text for at least
  `MIN_DIVERGE_WORDS` whole words, then says something else (it restarted
  with different words): no alignment is honest; the rescue ends in-band
  with an error rather than relay a second, different answer.
- **clean**: anything else is relayed as is. Nothing is ever inserted (a
  missing space at the seam stays missing: a prefill-style continuation may
  legitimately go on mid-word).

The longest repeated text wins; while a longer candidate is still possible
the decision waits (`pending`), so it needs at most the sent text's length of
continuation (plus whitespace). A continuation that ends while it still only
repeats the sent text said nothing new: all of it is dropped.
Decisions are monotone: once `align` decides on a prefix of the continuation,
it decides the same on any longer one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

MIN_OVERLAP_WORDS: Final = 2
MIN_DIVERGE_WORDS: Final = 3
# Continuation characters buffered beyond the sent text's length before the
# decision is forced (only whitespace runs can take it that far).
MARGIN_CHARS: Final = 1024
_NEEDLE: Final = 16

_WS: Final = re.compile(r"\s+")
_RUN: Final = re.compile(r"\s+|\S+")

SeamKind = Literal["pending", "clean", "overlap", "restart", "misaligned"]


@dataclass(frozen=True, slots=True)
class Seam:
    kind: SeamKind
    strip: int = 0  # characters (code points) of the continuation to drop

    @property
    def decided(self) -> bool:
        return self.kind != "pending"


PENDING: Final = Seam("pending")
CLEAN: Final = Seam("clean")


@dataclass(frozen=True, slots=True)
class Sent:
    """The sent text, normalised once per rescue."""

    norm: str
    starts: frozenset[int]  # where a repeat may begin: 0, or a word start with enough words after
    tail: tuple[int, ...]  # those of `starts` within `_NEEDLE` characters of the end
    raw_len: int


def normalise(text: str) -> str:
    return _WS.sub(" ", text).casefold()


def prepare(sent: str) -> Sent:
    norm = normalise(sent).lstrip(" ")
    words = [m.start() for m in re.finditer(r"(?<!\S)\S", norm)]
    starts = {0} if norm else set()
    starts.update(words[1 : len(words) - MIN_OVERLAP_WORDS + 1])
    tail = tuple(sorted(p for p in starts if len(norm) - p < _NEEDLE))
    return Sent(norm, frozenset(starts), tail, len(sent))


def align(sent: Sent, cont: str, *, ended: bool, restart_only: bool = False) -> Seam:
    """How `cont` (the continuation so far; all of it when `ended`) meets
    `sent`. `restart_only`: look for a whole restart only (a continuation by
    prefill is trusted; this is its cheap check)."""
    s = sent.norm
    if not s:
        return CLEAN
    full = normalise(cont)
    lead = 1 if full.startswith(" ") else 0
    c = full[lead:]
    if not c:
        return CLEAN if ended else PENDING
    p = _first_hit(sent, c, restart_only)
    if p is not None:
        repeated = len(s) - p
        if repeated <= len(c):
            kind: SeamKind = "restart" if p == 0 else "overlap"
            return Seam(kind, _raw_index(cont, lead + repeated))
        if not ended:
            return PENDING
        # It ended while still repeating: nothing new was said.
        if p == 0 or len(c.split()) >= MIN_OVERLAP_WORDS:
            return Seam("restart" if p == 0 else "overlap", len(cont))
        return CLEAN
    if not restart_only:
        same = _common_prefix(s, c)
        if c[:same].count(" ") >= MIN_DIVERGE_WORDS:
            return Seam("misaligned")
    return CLEAN


def _agrees(s: str, c: str, p: int) -> bool:
    n = min(len(c), len(s) - p)
    return s.startswith(c[:n], p)


def _first_hit(sent: Sent, c: str, restart_only: bool) -> int | None:
    """The first candidate start where the sent text and `c` agree so far."""
    s = sent.norm
    if restart_only:
        return 0 if _agrees(s, c, 0) else None
    k = min(len(c), _NEEDLE)
    needle = c[:k]
    last = len(s) - k
    i = s.find(needle)
    while 0 <= i <= last:
        if i in sent.starts and _agrees(s, c, i):
            return i
        i = s.find(needle, i + 1)
    for p in sent.tail:
        if p > last and _agrees(s, c, p):
            return p
    return None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on C-speed slice compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _raw_index(raw: str, m: int) -> int:
    """The index in `raw` where its normalised form reaches `m` characters
    (rounded up to a whole character)."""
    seen = 0
    for run in _RUN.finditer(raw):
        if seen >= m:
            return run.start()
        text = run.group()
        if text[0].isspace():
            seen += 1
            continue
        folded = len(text.casefold())
        if seen + folded <= m:
            seen += folded
            continue
        for j, ch in enumerate(text):
            if seen >= m:
                return run.start() + j
            seen += len(ch.casefold())
        return run.end()
    return len(raw)


# ---------------------------------------------------------------------- events


def event_text(data: bytes, endpoint: str) -> tuple[dict[str, Any] | None, str]:
    """A chunk's parsed object and choice 0's text ("" when none)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None, ""
    if not isinstance(obj, dict):
        return None, ""
    choice = _choice0(obj)
    if choice is None:
        return obj, ""
    if endpoint == "chat":
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return obj, text if isinstance(text, str) else ""


def _choice0(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    return choice if isinstance(choice, dict) and choice.get("index", 0) == 0 else None


def strip_events(region: bytes, strip: int, endpoint: str) -> bytes:
    """`region` (whole SSE events, LF line ends) with the first `strip`
    characters of choice 0's text removed. An event left without text is
    dropped unless it says more (a role, a finish_reason); a cut one is
    re-serialised; everything after the seam is kept byte for byte."""
    if strip <= 0:
        return region
    out: list[bytes] = []
    pos = 0
    while strip > 0:
        end = region.find(b"\n\n", pos)
        if end < 0:
            break
        end += 2
        raw = region[pos:end]
        pos = end
        data = _data_of(raw)
        obj, text = event_text(data, endpoint) if data is not None else (None, "")
        if obj is None or not text:
            out.append(raw)
            continue
        choice = _choice0(obj)
        assert choice is not None
        field = choice["delta"] if endpoint == "chat" else choice
        if len(text) <= strip:
            strip -= len(text)
            field[_key(endpoint)] = ""
            if not _says_more(choice, endpoint):
                continue
        else:
            field[_key(endpoint)] = text[strip:]
            strip = 0
        out.append(_event(obj))
    out.append(region[pos:])
    return b"".join(out)


def _key(endpoint: str) -> str:
    return "content" if endpoint == "chat" else "text"


def _event(obj: dict[str, Any]) -> bytes:
    # ASCII escapes: a lone surrogate from the backend stays valid JSON.
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _says_more(choice: dict[str, Any], endpoint: str) -> bool:
    if choice.get("finish_reason"):
        return True
    if endpoint == "chat":
        delta = choice.get("delta")
        return isinstance(delta, dict) and any(k != "content" for k in delta)
    return False


def _data_of(raw: bytes) -> bytes | None:
    """The data of a single-`data:`-line event (every LLM server's shape), else None."""
    body = raw[:-2]
    if not body.startswith(b"data:") or b"\n" in body:
        return None
    value = body[5:]
    return value[1:] if value[:1] == b" " else value
