"""The content rules: control characters, U+FFFD bursts, special tokens and
repetition, run on the decoded text of each choice as it streams, with what
they remember of the previous text (`ChoiceState`).

`ContentRules` is the part of a `StreamGuard` (`proxy.guard.stream`) that
judges text; the stream guard extracts that text from the regions it is fed.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from proxy.guard.verdicts import EXCERPT, Trip, excerpt_around

if TYPE_CHECKING:
    from proxy.guard.compiled import Guard

# Rule bits (`Guard.abort_mask`): a stream mutes a `log` rule after noting it once.
CTRL: Final = 1
FFFD: Final = 2
TOK: Final = 4
REP: Final = 8

# Repetition is looked for at most once per this many new characters: a loop
# stays a loop, so a few characters' delay costs nothing and saves an rfind
# per token.
_REP_STRIDE: Final = 16

# From this length on, ASCII text is checked for control characters on its
# bytes: one C-level table pass (`bytes.translate`, every control character
# mapped to "?") instead of `str.isprintable`'s lookup per character, ~3x the
# cost (a burst of 1,024 chunks is ~8,000 characters at once). Shorter texts:
# `isprintable` is as cheap as the extra calls.
_BYTES_CHECK_FROM: Final = 256
_CONTROLS_MARKED: Final = bytes(0x3F if c < 0x20 or c == 0x7F else c for c in range(256))


def _long_printable(text: str) -> bool:
    """`text.isprintable()` for a long text, faster when it is ASCII (where
    the printable characters are exactly 0x20-0x7E)."""
    if text.isascii():
        raw = text.encode("ascii")
        return raw.translate(_CONTROLS_MARKED) == raw
    return text.isprintable()


class ChoiceState:
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


def copy_choice(c: ChoiceState) -> ChoiceState:
    n = ChoiceState.__new__(ChoiceState)
    n.total, n.edge, n.tail, n.next_rep = c.total, c.edge, c.tail, c.next_rep
    n.pending = list(c.pending)
    n.fffd = None if c.fffd is None else deque(c.fffd, maxlen=c.fffd.maxlen)
    return n


class ContentRules:
    """The rules' state for one response: per choice, and which `log` rules are muted."""

    __slots__ = ("_c0", "_choices", "_g", "_muted", "notes")

    def __init__(self, guard: Guard) -> None:
        self._g = guard
        self._c0 = ChoiceState()
        self._choices: dict[int, ChoiceState] | None = None
        self._muted = 0
        self.notes: list[Trip] = []
        """Trips that did not stop the stream (`log` rules, the first dropped
        event); the relay drains it."""

    def choice(self, index: int) -> ChoiceState:
        if index == 0:
            return self._c0
        if self._choices is None:
            self._choices = {}
        st = self._choices.get(index)
        if st is None:
            st = self._choices[index] = ChoiceState()
        return st

    def check_text(self, st: ChoiceState, text: str) -> Trip | None:
        """Run the content rules on a choice's new text; remember what they need."""
        g = self._g
        muted = self._muted

        # Most tokens are printable, which rules out control characters at once.
        if (
            g.ctrl_re is not None
            and not muted & CTRL
            and not (text.isprintable() if len(text) < _BYTES_CHECK_FROM else _long_printable(text))
        ):
            m = g.ctrl_re.search(text)
            if m is not None:
                i = m.start()
                trip = self._rule(
                    CTRL,
                    Trip(
                        "control_chars",
                        f"The model's answer contained a control character "
                        f"(U+{ord(text[i]):04X}), so it was stopped.",
                        excerpt_around(text, i, i + 1),
                    ),
                )
                if trip is not None:
                    return trip

        if g.fffd_window and not muted & FFFD and "\ufffd" in text:
            trip = self._fffd(st, text)
            if trip is not None:
                return trip

        if g.needle_re is not None and not muted & TOK:
            m = None
            if st.edge or g.has_token_start(text):
                window = st.edge + text
                edge = window[-g.tok_keep :] if g.tok_keep else ""
                st.edge = edge if g.has_token_start(edge) else ""
                m = g.needle_re.search(window)
            if m is not None:
                trip = self._rule(
                    TOK,
                    Trip(
                        "special_tokens",
                        f"The model's answer contained the special token {m.group()!r}, "
                        "so it was stopped.",
                        repr(m.group())[:EXCERPT],
                    ),
                )
                if trip is not None:
                    return trip

        st.total += len(text)
        if not g.rep_max_period or muted & REP:
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
                    REP,
                    Trip(
                        "repetition",
                        "The model's answer degenerated into a repetition loop, so it was stopped.",
                        excerpt[:EXCERPT],
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

    def _fffd(self, st: ChoiceState, text: str) -> Trip | None:
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
                    FFFD,
                    Trip(
                        "replacement_chars",
                        f"The model's answer contained more than {limit} undecodable "
                        f"characters (U+FFFD) within {window} characters, so it was stopped.",
                        excerpt_around(text, i, i + 1),
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
