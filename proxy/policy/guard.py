"""`guard:` — the output validators' rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.policy.knobs import knob

Action = Literal["abort", "log"]


@dataclass(frozen=True, slots=True)
class ControlCharsRule:
    enabled: bool = knob(
        True,
        "Stop answers whose text contains a control character other than tab, "
        "newline and carriage return (U+0000–U+001F, U+007F).",
    )
    c1: bool = knob(
        True,
        "Count the C1 controls U+0080–U+009F too (in text they are mojibake or garbage, "
        "never language).",
    )
    action: Action = knob("abort", "`abort` stops the stream; `log` only counts and logs.")


@dataclass(frozen=True, slots=True)
class ReplacementCharsRule:
    enabled: bool = knob(
        True,
        "Stop answers dense in U+FFFD (undecodable bytes). Byte-level BPE models emit the "
        "odd one legitimately, so the rule counts per window rather than on the first.",
    )
    window_chars: int = knob(
        64, "Window of answer text, in characters.", ge=1, le=65536, unit="chars"
    )
    max_in_window: int = knob(
        24,
        "More U+FFFD than this within any `window_chars` characters trips the rule "
        "(< window_chars). A random-weight tiny model peaks at 15 per 64; mis-decoded "
        "output is mostly U+FFFD.",
        ge=0,
        unit="chars",
    )
    action: Action = knob("abort", "`abort` stops the stream; `log` only counts and logs.")


@dataclass(frozen=True, slots=True)
class SpecialTokensRule:
    enabled: bool = knob(
        True,
        "Stop answers that contain one of `tokens` as text (a leaked chat-template marker "
        "or stop string; found even when split across chunks).",
    )
    tokens: tuple[str, ...] = knob(
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<s>"),
        "Strings that must never appear in an answer (case-sensitive; each 1–256 characters).",
    )
    action: Action = knob("abort", "`abort` stops the stream; `log` only counts and logs.")


@dataclass(frozen=True, slots=True)
class RepetitionRule:
    enabled: bool = knob(
        True,
        "Stop degenerate loops: the answer's last characters repeat one unit of "
        "`1..max_period` characters at least `min_repeats` times and over at least "
        "`min_chars` characters (i.e. the last max(min_repeats × period, min_chars) "
        "characters have that period; a partial last unit counts). Checked every 16 new "
        "characters.",
    )
    max_period: int = knob(
        128, "Longest repeated unit looked for, in characters.", ge=1, le=4096, unit="chars"
    )
    min_repeats: int = knob(
        8,
        "Repeats of the unit needed; long units trip on this (8 × 100-char sentence).",
        ge=2,
    )
    min_chars: int = knob(
        512,
        "Characters the repetition must cover; short units trip on this, so runs of "
        "indentation, `-----` rules or `0, 0, 0` rows in ordinary answers do not.",
        ge=1,
        le=65536,
        unit="chars",
    )
    action: Action = knob("abort", "`abort` stops the stream; `log` only counts and logs.")


@dataclass(frozen=True, slots=True)
class MalformedRule:
    enabled: bool = knob(
        True,
        "Catch events that are not completion chunks: data that is not JSON, or a JSON "
        "object without a `choices` list (error objects, `[DONE]`, comments and usage-only "
        "chunks with `choices: []` are fine).",
    )
    action: Literal["drop", "abort"] = knob(
        "drop",
        "`drop` removes the event and keeps streaming (the client could not parse it "
        "anyway, and a cut-off last event stays the relay's truncation error); `abort` stops "
        "the stream. A malformed non-streaming body always trips.",
    )
    strict_json: bool = knob(
        False,
        "Parse every event as JSON (≈3 µs each) instead of checking its shape on bytes; "
        "only events that look odd are parsed otherwise.",
    )


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    enabled: bool = knob(True, "Output guard on answers (stream events and non-streaming bodies).")
    control_chars: ControlCharsRule = knob(ControlCharsRule, "")
    replacement_chars: ReplacementCharsRule = knob(ReplacementCharsRule, "")
    special_tokens: SpecialTokensRule = knob(SpecialTokensRule, "")
    repetition: RepetitionRule = knob(RepetitionRule, "")
    malformed: MalformedRule = knob(MalformedRule, "")
