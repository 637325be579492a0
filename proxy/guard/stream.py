"""`StreamGuard`: the output guard on one streamed response, and its cost model.

A `Guard` (`proxy.guard.compiled`) is compiled once per policy;
`Guard.stream()` gives a `StreamGuard` per response, which the relay feeds
every region `SSEFramer` returns (whole events, LF line ends).
`StreamGuard.feed` returns a `GuardVerdict`:

- the very same bytes object (`verdict is region`): forward it unchanged —
  the happy path, no copy;
- other bytes: the region without the malformed events the policy drops
  (possibly `b""`: nothing to write);
- a `Trip` (`proxy.guard.verdicts`): stop the stream; send
  `invalid_output_event(trip)`.

The region `SSEFramer.flush()` returns at EOF (a last event without its blank
line, possibly cut off) goes to `StreamGuard.feed_final` instead.

Trips of rules whose action is `log` do not stop anything: they are appended
to `StreamGuard.notes` (once per rule and stream) for the relay to count and
log; dropped malformed events are noted there too.

Cost. The content rules need the answer text, so every region pays for
extracting it, but never for a full JSON parse. The fast path:

1. a shape check with `bytes.count` (every event one `data: {...}` line with a
   `"choices"` list, all choices index 0);
2. one regex `findall` extracting the `"content"` / `"text"` string literals,
   joined and decoded at once (`bytes.decode`, or the C JSON string scanner
   when there are escapes) — so escapes are judged exactly as a client
   decodes them (`\\u0000` is a backslash and text, not a control char);
3. the rules (`proxy.guard.rules`) on that decoded text plus what they remember of the previous
   text (the start of a token split across chunks; the last 1 KB for
   repetition): `str.isprintable`, `in`, and now and then a regex or `rfind`.

Anything else — `[DONE]`, comments, error events, usage chunks that arrive
with other shapes, several choices, undecodable literals — takes the slow
path: the region is parsed into events and each event's data is
`json.loads`-ed. On the 2-core dev box (bench/guard_bench.py) a single-event
region costs ≈2.3 µs and a 64-event region ≈0.6 µs per event, against
≈3.6 µs per event for `json.loads` alone.

Bursts: when the relay finds a run of chunks sharing one envelope
(`proxy.openai.chunkrun`), `feed(region, run)` takes the run's joined text literals
as they are and only decodes them; the events around the run take the paths above.
A 64 KB region of vLLM chunks then costs the guard ≈15 µs instead of ≈300 µs.
"""

from __future__ import annotations

import json
import json.decoder
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, TypeAlias

from proxy.guard.rules import ChoiceState, ContentRules, copy_choice
from proxy.guard.verdicts import (
    ERROR_OBJECT,
    NOT_JSON,
    GuardVerdict,
    Trip,
    choice_texts,
    malformed_trip,
)
from proxy.openai.chunkrun import Run
from proxy.openai.chunks import CONTENT_RE, TEXT_RE, single_choice_events
from proxy.openai.sse import DONE, DONE_EVENT, SSEParser

if TYPE_CHECKING:
    from proxy.guard.compiled import Guard

# The content string literals of chat chunks and of completions. Inside a JSON
# string every `"` is escaped, so `"content":"` only matches a real key
# (`"reasoning_content"` has `_` before `content`; logprobs map to numbers).
_CONTENT_RE: Final = CONTENT_RE
_TEXT_RE: Final = TEXT_RE
# The C scanner behind json.loads for one string literal (not in typeshed).
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


_Snapshot: TypeAlias = tuple[
    ChoiceState, "dict[int, ChoiceState] | None", int, int, int, "re.Pattern[bytes] | None"
]


class StreamGuard(ContentRules):
    """The guard's state for one streamed response; feed it every region.

    The content rules and their state are `ContentRules`'; this class turns
    regions into the texts they judge."""

    __slots__ = ("_content_re", "dropped")

    def __init__(self, guard: Guard) -> None:
        super().__init__(guard)
        self._content_re: re.Pattern[bytes] | None = None
        self.dropped = 0
        """Malformed events dropped (noted once, counted here: a stream of bad
        events costs a counter, not a note and a log line each)."""

    def feed(self, region: bytes, run: Run | None = None) -> GuardVerdict:
        """Check one region of whole events; see the module docstring.

        A region of several events that trips is checked again event by event
        from the state before it, so the valid events ahead of the offending
        one still reach the client (`Trip.prefix`).
        """
        if not self._g.active:
            return region
        first = region.find(b"\n\n")
        if region.find(b"\n\n", first + 2) < 0:  # one event: no replay needed
            return self._feed(region)
        snap = self._snapshot()
        verdict = None
        if run is not None and not self._g.strict_json:
            verdict = self._run(region, run)
        if verdict is None:
            verdict = self._feed(region)
        if not isinstance(verdict, Trip):
            return verdict
        self._restore(snap)
        kept: list[bytes] = []
        parser = SSEParser()
        for ev in parser.feed(region) + parser.flush():
            v = self._feed(ev.raw)
            if isinstance(v, Trip):
                return Trip(v.rule, v.message, v.excerpt, b"".join(kept))
            kept.append(v)
        return verdict

    def _snapshot(self) -> _Snapshot:
        # Strings are immutable; only the list and deque need copies.
        choices = self._choices
        return (
            copy_choice(self._c0),
            None if choices is None else {k: copy_choice(c) for k, c in choices.items()},
            self._muted,
            len(self.notes),
            self.dropped,
            self._content_re,
        )

    def _restore(self, snap: _Snapshot) -> None:
        self._c0, self._choices, self._muted, n, self.dropped, self._content_re = snap
        del self.notes[n:]

    def _feed(self, region: bytes) -> GuardVerdict:
        if region.endswith(DONE_EVENT):  # never on the fast path itself
            if region == DONE_EVENT:
                # [DONE] alone (vLLM writes it on its own): what the slow path
                # would return, without parsing it (~3 us a stream).
                return region
            if len(region) > len(DONE_EVENT):
                # The last region: chunks then [DONE]. Keep the chunks on the fast path.
                head = region[: -len(DONE_EVENT)]
                verdict = self._fast(head)
                if verdict is head:
                    return region
                if verdict is not None:
                    return verdict  # a Trip: _fast never drops events
            return self._slow(region)
        verdict = self._fast(region)
        if verdict is not None:
            return verdict
        return self._slow(region)

    def feed_final(self, region: bytes) -> GuardVerdict:
        """`feed` for the region `SSEFramer.flush()` returns at the end of the stream.

        That event lacked its blank line, so it may be cut off anywhere — even
        just after a `}` — and is always parsed rather than shape-checked.
        """
        if not self._g.active:
            return region
        return self._slow(region)

    # -- fast path ----------------------------------------------------------------

    def _fast(self, region: bytes) -> GuardVerdict | None:
        """None when the region needs the slow path (before any state changed).

        The shape check costs three scans of the region. Every event must be one
        `data: {...}` line whose object has `"choices":[{"index":0,` and no other
        `"index"` key: k such events need k of each marker and 2k newlines (a
        data line and the blank line). Error events, comments, `[DONE]`, usage
        chunks, several choices or tool calls, other key orders all miss and
        take the slow path.
        """
        if not (
            region.startswith(b"data: {") and region.endswith(b"}\n\n") and not self._g.strict_json
        ):
            return None
        if not single_choice_events(region):
            return None
        cre = self._content_re
        if cre is None:
            # Decided once per stream: completions carry `"text":`, chat chunks never do.
            if region.find(b'"text":') >= 0:
                cre = self._content_re = _TEXT_RE
            elif region.find(b'"content":') >= 0:
                cre = self._content_re = _CONTENT_RE
            else:
                return region  # e.g. a role-only first chunk: no text yet
        literals = cre.findall(region)
        if not literals:
            return region
        # Concatenated literals decode to the concatenated texts: a literal never
        # ends inside an escape.
        raw = literals[0] if len(literals) == 1 else b"".join(literals)
        try:
            text = raw.decode() if raw.find(b"\\") < 0 else _scanstring(raw.decode() + '"', 0)[0]
        except ValueError:
            return None
        if text:
            trip = self.check_text(self._c0, text)
            if trip is not None:
                return trip
        return region

    # -- runs ---------------------------------------------------------------------

    def _run(self, region: bytes, run: Run) -> GuardVerdict | None:
        """A region holding a run of envelope chunks (`proxy.openai.chunkrun`): the
        events around the run take the usual paths, the run only costs the
        decoding of its text. None when its literals do not decode."""
        raw = run.raw
        # The run's literals are whole JSON string bodies (the cut checks): joined,
        # they decode to the joined texts.
        try:
            text = raw.decode() if raw.find(b"\\") < 0 else _scanstring(raw.decode() + '"', 0)[0]
        except ValueError:
            return None
        i, j, n = run.start, run.end, len(region)
        changed = False
        head = tail = b""
        if i:
            head = region[:i]
            verdict = self._feed(head)
            if isinstance(verdict, Trip):
                return verdict
            changed = verdict is not head
            head = verdict
        if text:
            trip = self.check_text(self._c0, text)
            if trip is not None:
                return trip
        if j < n:
            tail = region[j:]
            verdict = self._feed(tail)
            if isinstance(verdict, Trip):
                return verdict
            changed = changed or verdict is not tail
            tail = verdict
        if changed:  # malformed events around the run were dropped
            return head + region[i:j] + tail
        return region

    # -- slow path ----------------------------------------------------------------

    def _slow(self, region: bytes) -> GuardVerdict:
        g = self._g
        parser = SSEParser()
        events = parser.feed(region) + parser.flush()
        kept: list[bytes] = []
        dropped = False
        for ev in events:
            data = ev.data
            if data is None or data == DONE:
                kept.append(ev.raw)
                continue
            bad_json = False
            try:
                obj = json.loads(data)
            except ValueError:
                # Raw control characters inside strings are invalid JSON, but the
                # control-character rule should still name them.
                bad_json = True
                try:
                    obj = json.loads(data, strict=False)
                except ValueError:
                    obj = NOT_JSON
            texts = choice_texts(obj)
            if isinstance(texts, list):
                for index, text in texts:
                    trip = self.check_text(self.choice(index), text)
                    if trip is not None:
                        return trip
                if bad_json:
                    texts = "not valid JSON"
            if isinstance(texts, str) and texts != ERROR_OBJECT and g.malformed_on:
                if g.malformed_abort:
                    return malformed_trip(texts, data)
                if not self.dropped:
                    self.notes.append(malformed_trip(texts, data, dropped=True))
                self.dropped += 1
                dropped = True
                continue
            kept.append(ev.raw)
        return b"".join(kept) if dropped else region
