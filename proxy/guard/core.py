"""The output guard: validators on every streamed event and non-streaming body.

A `Guard` is compiled once per policy; `Guard.stream()` gives a `StreamGuard`
per response, which the relay feeds every region `SSEFramer` returns (whole
events, LF line ends). `StreamGuard.feed` returns a `GuardVerdict`:

- the very same bytes object (`verdict is region`): forward it unchanged —
  the happy path, no copy;
- other bytes: the region without the malformed events the policy drops
  (possibly `b""`: nothing to write);
- a `Trip`: stop the stream; send `invalid_output_event(trip)`.

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
3. the rules on that decoded text plus what they remember of the previous
   text (the start of a token split across chunks; the last 1 KB for
   repetition): `str.isprintable`, `in`, and now and then a regex or `rfind`.

Anything else — `[DONE]`, comments, error events, usage chunks that arrive
with other shapes, several choices, undecodable literals — takes the slow
path: the region is parsed into events and each event's data is
`json.loads`-ed. On the 2-core dev box (bench/guard_bench.py) a single-event
region costs ≈2.3 µs and a 64-event region ≈0.6 µs per event, against
≈3.6 µs per event for `json.loads` alone.

Bursts: when the relay finds a run of chunks sharing one envelope
(`proxy.openai.chunkrun`), `feed(region, run)` takes the run's text literals as they
are and only decodes them; the events around the run take the paths above.
A 64 KB region of vLLM chunks then costs the guard ≈15 µs instead of ≈300 µs.
"""

from __future__ import annotations

import json
import json.decoder
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from proxy.openai.chunkrun import Run
from proxy.openai.chunks import CONTENT_RE, TEXT_RE, single_choice_events
from proxy.openai.sse import DONE, DONE_EVENT, SSEParser, error_events
from proxy.policy import GuardPolicy

RuleName = Literal[
    "control_chars", "replacement_chars", "special_tokens", "repetition", "malformed"
]


# --------------------------------------------------------------------------- policy


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True, slots=True)
class Trip:
    """A rule fired. `message` is for the client; `excerpt` (≤ 40 chars) for logs."""

    rule: RuleName
    message: str
    excerpt: str
    # Whole events of the region before the offending one: valid, to forward.
    prefix: bytes = b""


GuardVerdict: TypeAlias = bytes | Trip
"""`feed`'s answer: the region itself (unchanged), a new region, or a Trip."""


def invalid_output_event(trip: Trip) -> bytes:
    """The in-band error event (then `[DONE]`) that ends a stream the guard stopped."""
    return error_events(trip.message, "server_error", "invalid_output")


# --------------------------------------------------------------------------- compiled policy

# Rule bits: a stream mutes a `log` rule after noting it once.
_CTRL: Final = 1
_FFFD: Final = 2
_TOK: Final = 4
_REP: Final = 8

# Repetition is looked for at most once per this many new characters: a loop
# stays a loop, so a few characters' delay costs nothing and saves an rfind
# per token.
_REP_STRIDE: Final = 16
# Non-streaming bodies go through the stream checks in pieces of this size.
_BODY_STEP: Final = 64
_EXCERPT: Final = 40

# The content string literals of chat chunks and of completions. Inside a JSON
# string every `"` is escaped, so `"content":"` only matches a real key
# (`"reasoning_content"` has `_` before `content`; logprobs map to numbers).
_CONTENT_RE: Final = CONTENT_RE
_TEXT_RE: Final = TEXT_RE
# The C scanner behind json.loads for one string literal (not in typeshed).
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


class Guard:
    """The validators of one policy, compiled; share it between requests."""

    __slots__ = (
        "abort_mask",
        "active",
        "ctrl_re",
        "fffd_max",
        "fffd_window",
        "malformed_abort",
        "malformed_on",
        "needle_re",
        "policy",
        "rep_max_period",
        "rep_min_chars",
        "rep_min_repeats",
        "rep_min_span",
        "rep_probe",
        "strict_json",
        "tail_keep",
        "tok_first",
        "tok_first_re",
        "tok_keep",
    )

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self.active = policy.enabled
        cc, rc, tk, rp, mf = (
            policy.control_chars,
            policy.replacement_chars,
            policy.special_tokens,
            policy.repetition,
            policy.malformed,
        )
        mask = 0
        for bit, rule in ((_CTRL, cc), (_FFFD, rc), (_TOK, tk), (_REP, rp)):
            if rule.action == "abort":
                mask |= bit
        self.abort_mask = mask

        self.ctrl_re: re.Pattern[str] | None = None
        if cc.enabled:
            c1 = "\x80-\x9f" if cc.c1 else ""
            self.ctrl_re = re.compile(f"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f{c1}]")

        self.fffd_window = rc.window_chars if rc.enabled else 0
        self.fffd_max = rc.max_in_window

        self.needle_re: re.Pattern[str] | None = None
        self.tok_keep = 0
        self.tok_first = ""
        self.tok_first_re: re.Pattern[str] | None = None
        if tk.enabled and tk.tokens:
            # Longest first, so a token that is a prefix of another does not hide it.
            tokens = sorted(set(tk.tokens), key=len, reverse=True)
            self.needle_re = re.compile("|".join(re.escape(t) for t in tokens))
            # Enough previous text to complete any token that ends in the new text.
            self.tok_keep = len(tokens[0]) - 1
            # A token can only be there if its first character is: `in` (the
            # defaults all start with "<") or a one-class regex is far cheaper than
            # the alternation.
            firsts = sorted({t[0] for t in tokens})
            if len(firsts) == 1:
                self.tok_first = firsts[0]
            else:
                self.tok_first_re = re.compile("[" + "".join(map(re.escape, firsts)) + "]")

        self.rep_max_period = rp.max_period if rp.enabled else 0
        self.rep_min_repeats = rp.min_repeats
        self.rep_min_chars = rp.min_chars
        spans = [self.rep_span(p) for p in range(1, self.rep_max_period + 1)]
        # The probe (the text's last characters, searched for within max_period
        # before) must fit in every candidate span minus one period, so a real
        # repetition always yields its period as a candidate.
        self.rep_probe = max(1, min([16] + [s - p for p, s in enumerate(spans, 1)]))
        self.tail_keep = max(spans, default=0)
        self.rep_min_span = self.rep_span(1)  # the shortest (spans grow with the period)

        self.malformed_on = mf.enabled
        self.malformed_abort = mf.action == "abort"
        self.strict_json = mf.strict_json

    def has_token_start(self, text: str) -> bool:
        if self.tok_first:
            return self.tok_first in text
        return self.tok_first_re is not None and self.tok_first_re.search(text) is not None

    def rep_span(self, period: int) -> int:
        """Characters that must have period `period` for the repetition rule."""
        return max(self.rep_min_repeats * period, self.rep_min_chars)

    def stream(self) -> StreamGuard:
        return StreamGuard(self)

    def check_body(self, body: bytes, notes: list[Trip] | None = None) -> Trip | None:
        """The rules on a non-streaming `chat.completion` / `text_completion` body.

        Returns the first trip of an `abort` rule, or None; trips of `log` rules
        are appended to `notes` when given. Upstream error objects pass.
        """
        if not self.active:
            return None
        sg = StreamGuard(self)
        try:
            obj = json.loads(body)
        except ValueError:
            obj = _NOT_JSON
        texts = _choice_texts(obj)
        if isinstance(texts, str):
            if texts == _ERROR_OBJECT or not self.malformed_on:
                return None
            return _malformed(texts, body)
        for index, text in texts:
            st = sg.choice(index)
            # In pieces, so the tail rules (split tokens, repetition) see the text as
            # a stream would, and a loop that ended before the last token still counts.
            for i in range(0, len(text), _BODY_STEP):
                trip = sg.check_text(st, text[i : i + _BODY_STEP])
                if trip is not None:
                    return trip
        if notes is not None:
            notes.extend(sg.notes)
        return None


# --------------------------------------------------------------------------- per stream


class _Choice:
    """What the tail rules remember of one choice's text."""

    __slots__ = ("edge", "fffd", "next_rep", "pending", "tail", "total")

    def __init__(self) -> None:
        self.total = 0  # characters seen
        # The last Guard.tok_keep characters when they hold a token's first
        # character (the start of a token split across chunks), else "".
        self.edge = ""
        # Repetition: the last Guard.tail_keep characters as of the last look,
        # and the texts since; joined only when looking (copying a 1 KB tail per
        # token would cost more than all the rules).
        self.tail = ""
        self.pending: list[str] = []
        self.next_rep = 0  # `total` at which repetition is looked for next
        self.fffd: deque[int] | None = None  # positions of recent U+FFFD


def _copy_choice(c: _Choice) -> _Choice:
    n = _Choice.__new__(_Choice)
    n.total, n.edge, n.tail, n.next_rep = c.total, c.edge, c.tail, c.next_rep
    n.pending = list(c.pending)
    n.fffd = None if c.fffd is None else deque(c.fffd, maxlen=c.fffd.maxlen)
    return n


_Snapshot: TypeAlias = tuple[
    _Choice, "dict[int, _Choice] | None", int, int, int, "re.Pattern[bytes] | None"
]


class StreamGuard:
    """The guard's state for one streamed response; feed it every region."""

    __slots__ = ("_c0", "_choices", "_content_re", "_g", "_muted", "dropped", "notes")

    def __init__(self, guard: Guard) -> None:
        self._g = guard
        self._c0 = _Choice()
        self._choices: dict[int, _Choice] | None = None
        self._content_re: re.Pattern[bytes] | None = None
        self._muted = 0
        self.notes: list[Trip] = []
        """Trips that did not stop the stream (`log` rules, the first dropped
        event); the relay drains it."""
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
            _copy_choice(self._c0),
            None if choices is None else {k: _copy_choice(c) for k, c in choices.items()},
            self._muted,
            len(self.notes),
            self.dropped,
            self._content_re,
        )

    def _restore(self, snap: _Snapshot) -> None:
        self._c0, self._choices, self._muted, n, self.dropped, self._content_re = snap
        del self.notes[n:]

    def _feed(self, region: bytes) -> GuardVerdict:
        verdict = self._fast(region)
        if verdict is not None:
            return verdict
        if region.endswith(DONE_EVENT) and len(region) > len(DONE_EVENT):
            # The last region: chunks then [DONE]. Keep the chunks on the fast path.
            head = region[: -len(DONE_EVENT)]
            verdict = self._fast(head)
            if verdict is head:
                return region
            if verdict is not None:
                return verdict  # a Trip: _fast never drops events
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
            if b'"text":' in region:
                cre = self._content_re = _TEXT_RE
            elif b'"content":' in region:
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
            text = raw.decode() if b"\\" not in raw else _scanstring(raw.decode() + '"', 0)[0]
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
        parts = run.literals
        raw = b"".join(parts)
        if b"\\" in raw or b'"' in raw:
            # Each piece must be a whole string literal: decode them as a list.
            try:
                texts = json.loads(b'["' + b'","'.join(parts) + b'"]')
            except ValueError:
                return None
            if len(texts) != len(parts):
                return None
            text = "".join(texts)
        else:
            try:
                text = raw.decode()
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
                    obj = _NOT_JSON
            texts = _choice_texts(obj)
            if isinstance(texts, list):
                for index, text in texts:
                    trip = self.check_text(self.choice(index), text)
                    if trip is not None:
                        return trip
                if bad_json:
                    texts = "not valid JSON"
            if isinstance(texts, str) and texts != _ERROR_OBJECT and g.malformed_on:
                if g.malformed_abort:
                    return _malformed(texts, data)
                if not self.dropped:
                    self.notes.append(_malformed(texts, data, dropped=True))
                self.dropped += 1
                dropped = True
                continue
            kept.append(ev.raw)
        return b"".join(kept) if dropped else region

    # -- the content rules ----------------------------------------------------------

    def choice(self, index: int) -> _Choice:
        if index == 0:
            return self._c0
        if self._choices is None:
            self._choices = {}
        st = self._choices.get(index)
        if st is None:
            st = self._choices[index] = _Choice()
        return st

    def check_text(self, st: _Choice, text: str) -> Trip | None:
        """Run the content rules on a choice's new text; remember what they need."""
        g = self._g
        muted = self._muted

        # Most tokens are printable, which rules out control characters at once.
        if g.ctrl_re is not None and not muted & _CTRL and not text.isprintable():
            m = g.ctrl_re.search(text)
            if m is not None:
                i = m.start()
                trip = self._rule(
                    _CTRL,
                    Trip(
                        "control_chars",
                        f"The model's answer contained a control character "
                        f"(U+{ord(text[i]):04X}), so it was stopped.",
                        _around(text, i, i + 1),
                    ),
                )
                if trip is not None:
                    return trip

        if g.fffd_window and not muted & _FFFD and "\ufffd" in text:
            trip = self._fffd(st, text)
            if trip is not None:
                return trip

        if g.needle_re is not None and not muted & _TOK:
            m = None
            if st.edge or g.has_token_start(text):
                window = st.edge + text
                edge = window[-g.tok_keep :] if g.tok_keep else ""
                st.edge = edge if g.has_token_start(edge) else ""
                m = g.needle_re.search(window)
            if m is not None:
                trip = self._rule(
                    _TOK,
                    Trip(
                        "special_tokens",
                        f"The model's answer contained the special token {m.group()!r}, "
                        "so it was stopped.",
                        repr(m.group())[:_EXCERPT],
                    ),
                )
                if trip is not None:
                    return trip

        st.total += len(text)
        if not g.rep_max_period or muted & _REP:
            return None
        st.pending.append(text)
        if st.total >= st.next_rep:
            st.next_rep = st.total + _REP_STRIDE
            tail = st.tail + "".join(st.pending)
            st.pending.clear()
            if len(tail) > 2 * g.tail_keep:  # trim now and then, not at every look
                tail = tail[-g.tail_keep :]
            st.tail = tail
            found = self._repetition(tail)
            if found is not None:
                period, span = found
                unit = tail[-period:]
                excerpt = f"{unit[:24]!r} x{span // period}+"
                return self._rule(
                    _REP,
                    Trip(
                        "repetition",
                        "The model's answer degenerated into a repetition loop, so it was stopped.",
                        excerpt[:_EXCERPT],
                    ),
                )
        return None

    def _rule(self, bit: int, trip: Trip) -> Trip | None:
        """An `abort` rule's trip stops the stream; a `log` rule's is noted once."""
        if self._g.abort_mask & bit:
            return trip
        self._muted |= bit
        self.notes.append(trip)
        return None

    def _fffd(self, st: _Choice, text: str) -> Trip | None:
        g = self._g
        window, limit = g.fffd_window, g.fffd_max
        seen = st.fffd
        if seen is None:
            seen = st.fffd = deque(maxlen=limit + 1)
        i = text.find("\ufffd")
        while i >= 0:
            pos = st.total + i
            seen.append(pos)
            # The window ending at this U+FFFD holds every remembered one within
            # `window` characters; a denser window would end at a U+FFFD too.
            if len(seen) > limit and pos - seen[0] < window:
                return self._rule(
                    _FFFD,
                    Trip(
                        "replacement_chars",
                        f"The model's answer contained more than {limit} undecodable "
                        f"characters (U+FFFD) within {window} characters, so it was stopped.",
                        _around(text, i, i + 1),
                    ),
                )
            i = text.find("\ufffd", i + 1)
        return None

    def _repetition(self, t: str) -> tuple[int, int] | None:
        """(period, span) when the end of `t` is a degenerate loop, else None.

        Candidates are the distances at which the last `rep_probe` characters
        occur again within `max_period` before: one `rfind` for ordinary text,
        which almost never repeats 16 characters that closely.
        """
        g = self._g
        n = len(t)
        if n < g.rep_min_span:
            return None
        m = g.rep_probe
        probe = t[n - m :]
        lo = n - m - g.rep_max_period
        if lo < 0:
            lo = 0
        end = n - 1
        while True:
            j = t.rfind(probe, lo, end)
            if j < 0:
                return None
            period = n - m - j
            span = g.rep_span(period)
            # t[-span:] has period p ⇔ it starts with its own last span-p chars.
            if span <= n and t.startswith(t[n - span + period :], n - span):
                return period, span
            end = j + m - 1


# --------------------------------------------------------------------------- helpers

_ERROR_OBJECT: Final = "error object"
_NOT_JSON: Final = object()


def _choice_texts(obj: Any) -> list[tuple[int, str]] | str:
    """(choice index, text) of a chunk or body, or why it is not one.

    Text is `delta.content` / `message.content` (chat) or `text` (completions).
    """
    if obj is _NOT_JSON:
        return "not JSON"
    if not isinstance(obj, dict):
        return "not a JSON object"
    if "error" in obj:
        return _ERROR_OBJECT
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return "no choices list"
    out: list[tuple[int, str]] = []
    for ch in choices:
        if not isinstance(ch, dict):
            return "a choice is not an object"
        index = ch.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return "a choice has a bad index"
        holder = ch.get("delta")
        if holder is None:
            holder = ch.get("message")
        if holder is None:
            text = ch.get("text")
        elif isinstance(holder, dict):
            text = holder.get("content")
        else:
            return "a choice's delta is not an object"
        if isinstance(text, str):
            out.append((index, text))
        elif text is not None:
            return "a choice's text is not a string"
    return out


def _malformed(reason: str, data: bytes, dropped: bool = False) -> Trip:
    message = (
        "The backend sent a malformed event; it was dropped."
        if dropped
        else "The backend sent a malformed answer, so it was stopped."
    )
    return Trip("malformed", message, f"{reason}: {data[:16]!r}"[:_EXCERPT])


def _around(text: str, start: int, end: int) -> str:
    """repr of text[start:end] with a few characters either side, ≤ 40 chars."""
    r = repr(text[max(0, start - 6) : end + 6])
    return r if len(r) <= _EXCERPT else r[: _EXCERPT - 1] + "…"
