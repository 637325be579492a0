"""`Guard`: the validators of one `GuardPolicy`, compiled once and shared
between requests; `Guard.stream()` gives each streamed response its
`StreamGuard`, `Guard.check_body` judges a non-streaming body."""

from __future__ import annotations

import json
import re
from typing import Final

from proxy.guard.rules import CTRL, FFFD, REP, TOK
from proxy.guard.stream import StreamGuard
from proxy.guard.verdicts import ERROR_OBJECT, NOT_JSON, Trip, choice_texts, malformed_trip
from proxy.policy import GuardPolicy

# Non-streaming bodies go through the stream checks in pieces of this size.
_BODY_STEP: Final = 64


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
        for bit, rule in ((CTRL, cc), (FFFD, rc), (TOK, tk), (REP, rp)):
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
            obj = NOT_JSON
        texts = choice_texts(obj)
        if isinstance(texts, str):
            if texts == ERROR_OBJECT or not self.malformed_on:
                return None
            return malformed_trip(texts, body)
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
