"""The output guard: each validator, its edges, and untouched ordinary streams."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Literal

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.guard.compiled import Guard
from proxy.guard.stream import StreamGuard
from proxy.guard.verdicts import Trip, invalid_output_event
from proxy.openai.sse import SSEFramer, SSEParser
from proxy.policy import (
    ControlCharsRule,
    GuardPolicy,
    MalformedRule,
    PolicyError,
    RepetitionRule,
    ReplacementCharsRule,
    SpecialTokensRule,
    parse_policy,
)

Kind = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"
DEFAULT = Guard(GuardPolicy())


def chunk_obj(text: str | None, kind: Kind = "chat", index: int = 0) -> dict[str, Any]:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or ""}
        obj = "text_completion"
    choice |= {"logprobs": None, "finish_reason": None}
    return {
        "id": "chatcmpl-5f3c0a9b1e8d4b6f",
        "object": obj,
        "created": 1767225600,
        "model": "tiny",
        "choices": [choice],
    }


def event(obj: Any, *, ensure_ascii: bool = False, compact: bool = True) -> bytes:
    seps = (",", ":") if compact else (", ", ": ")
    return (
        b"data: " + json.dumps(obj, ensure_ascii=ensure_ascii, separators=seps).encode() + b"\n\n"
    )


def chunk(text: str, kind: Kind = "chat", index: int = 0, **kw: bool) -> bytes:
    return event(chunk_obj(text, kind, index), **kw)


def raw_chunk(literal: bytes) -> bytes:
    """A chat chunk whose content literal is written by hand (escapes as given)."""
    return (
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"' + literal + b'"},"logprobs":null,"finish_reason":null}]}\n\n'
    )


def feed_all(sg: StreamGuard, regions: list[bytes]) -> bytes | Trip:
    """Feed regions; the first non-identical verdict, or b"" when all passed as is."""
    for r in regions:
        v = sg.feed(r)
        if v is not r:
            return v
    return b""


def trip_of(verdict: bytes | Trip, rule: str) -> Trip:
    assert isinstance(verdict, Trip), verdict
    assert verdict.rule == rule
    assert len(verdict.excerpt) <= 40
    return verdict


def guard(**rules: Any) -> Guard:
    return Guard(GuardPolicy(**rules))


# --------------------------------------------------------------------------- happy path


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_ordinary_chunks_pass_as_the_same_object(kind: Kind, ensure_ascii: bool) -> None:
    sg = DEFAULT.stream()
    texts = ["Hello", ", wörld", "\n", "\tindent", "\r\n", "日本語", "😀👍🏽", " <b>bold</b>", ""]
    regions = [chunk(t, kind, ensure_ascii=ensure_ascii) for t in texts]
    regions.append(b"".join(regions))  # a multi-event region too
    for r in regions:
        assert sg.feed(r) is r
    assert sg.notes == []


def test_done_comments_errors_and_usage_pass() -> None:
    sg = DEFAULT.stream()
    usage = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": {"total": 3}}
    error = {"error": {"message": "EngineCore encountered an issue", "code": 500}}
    regions = [
        b": ping\n\n",
        event(usage),
        event(error),
        b'event: note\ndata: {"error": {"message": "x"}}\n\n',
        chunk("fine") + event(usage) + DONE,
        DONE,
        chunk("a") + b": ping\n\n" + chunk("b"),
    ]
    for r in regions:
        assert sg.feed(r) is r
    assert sg.notes == []


def test_ordinary_path_never_parses_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-shaped chunks, [DONE] included, stay on the byte-level fast path."""

    def no_slow(self: StreamGuard, region: bytes) -> bytes:
        raise AssertionError(f"slow path for {region[:60]!r}")

    monkeypatch.setattr(StreamGuard, "_slow", no_slow)
    sg = DEFAULT.stream()
    words = ["The", " answer", " is", " 42", ".\n\n", "```py\n", "x = '\\\\'", "\n```", " é"]
    regions = [chunk(w) for w in words]
    regions.append(b"".join(chunk(w) for w in words * 7))
    regions.append(chunk(" end") + DONE)
    regions.append(DONE)  # alone, as vLLM writes it
    for r in regions:
        assert sg.feed(r) is r


def test_disabled_guard_passes_everything() -> None:
    g = guard(enabled=False)
    sg = g.stream()
    for r in [chunk("a\x00b"), b"data: nope\n\n", chunk("<|im_end|>")]:
        assert sg.feed(r) is r
    assert g.check_body(b"not json") is None


# --------------------------------------------------------------------------- control characters


@pytest.mark.parametrize(
    "literal",
    [b"a\\u0000b", b"\\u0007", b"x\\u001F", b"\\u007f", b"\\b", b"ok\\f", b"\\\\\\u0000"],
)
def test_control_char_escapes_trip(literal: bytes) -> None:
    trip = trip_of(DEFAULT.stream().feed(raw_chunk(literal)), "control_chars")
    assert "control character" in trip.message


@pytest.mark.parametrize(
    "literal",
    [
        b"\\\\u0000",  # an escaped backslash, then the text "u0000"
        b"\\\\\\\\u001f",  # two escaped backslashes
        b"C:\\\\bin\\\\foo",  # "\b" and "\f" only as text
        b"\\\\begin{frac}",
        b"line\\nnext\\ttab\\r",
        b"\\u000a\\u0009\\u000D",  # newline, tab, CR written as \u escapes
        b"\\u00e9\\ud83d\\ude00",
    ],
)
def test_escapes_that_are_not_control_chars_pass(literal: bytes) -> None:
    r = raw_chunk(literal)
    assert DEFAULT.stream().feed(r) is r


@pytest.mark.parametrize("char", [*map(chr, range(0x20)), "\x7f", "\x85", "é"])
@pytest.mark.parametrize("at", [0, 150, 399])
def test_a_long_text_is_judged_as_a_short_one(char: str, at: int) -> None:
    """Issue 24: long ASCII text (a burst of chunks decoded at once) is
    checked on its bytes; a control character trips wherever it is, and
    nothing else does — in one chunk, or in a burst of 20 (a run)."""
    text = "".join(f"w{i:02d}ab " for i in range(80))  # 400 ASCII characters
    text = text[:at] + char + text[at + 1 :]
    control = (ord(char) < 0x20 and char not in "\t\n\r") or char in "\x7f\x85"
    burst = b"".join(chunk(text[i : i + 20]) for i in range(0, 400, 20))
    for region in (chunk(text), burst, burst * 2):
        v = DEFAULT.stream().feed(region)
        if control:
            trip_of(v, "control_chars")
        else:
            assert v is region


def test_c1_controls_are_configurable() -> None:
    for r in [chunk("x\u0085y"), chunk("x\u0092y", ensure_ascii=True)]:
        trip_of(DEFAULT.stream().feed(r), "control_chars")
        no_c1 = guard(control_chars=ControlCharsRule(c1=False))
        assert no_c1.stream().feed(r) is r


def test_raw_control_byte_in_json_is_a_control_char_not_just_malformed() -> None:
    r = raw_chunk(b"a\x01b")  # invalid JSON: raw control byte in a string
    trip_of(DEFAULT.stream().feed(r), "control_chars")


def test_control_chars_in_other_fields_are_not_content() -> None:
    obj = chunk_obj("fine")
    obj["choices"][0]["logprobs"] = {"content": [{"token": "\x00", "logprob": -1.0}]}
    obj["choices"][0]["delta"]["reasoning_content"] = "\x01"
    r = event(obj)
    assert DEFAULT.stream().feed(r) is r


def test_control_chars_disabled_or_logged() -> None:
    r = chunk("a\x00b")
    assert guard(control_chars=ControlCharsRule(enabled=False)).stream().feed(r) is r
    sg = guard(control_chars=ControlCharsRule(action="log")).stream()
    assert sg.feed(r) is r
    r = chunk("\x02")
    assert sg.feed(r) is r
    assert [t.rule for t in sg.notes] == ["control_chars"]  # noted once per stream


# --------------------------------------------------------------------------- U+FFFD


def fffd_guard(window: int = 10, limit: int = 3) -> Guard:
    return guard(replacement_chars=ReplacementCharsRule(window_chars=window, max_in_window=limit))


@pytest.mark.parametrize(
    "make",
    [
        lambda t: chunk(t),  # raw UTF-8 bytes EF BF BD
        lambda t: chunk(t, ensure_ascii=True),  # \ufffd
        lambda t: raw_chunk(
            json.dumps(t, ensure_ascii=True)[1:-1].replace("fffd", "FFFD").encode()
        ),
    ],
)
def test_replacement_chars_threshold_per_window(make: Any) -> None:
    g = fffd_guard()
    at_limit = make("ab\ufffd\ufffdcd\ufffdefgh")  # 3 in 10 chars: allowed
    assert g.stream().feed(at_limit) is at_limit
    trip = trip_of(g.stream().feed(make("ab\ufffd\ufffdcd\ufffdef\ufffd")), "replacement_chars")
    assert "U+FFFD" in trip.message


def test_replacement_chars_window_spans_chunks_and_slides() -> None:
    g = fffd_guard()
    # 4 within 10 characters, one per chunk: trips.
    parts = ["\ufffd", "ab", "\ufffd", "cd\ufffd", "e\ufffd"]
    trip_of(feed_all(g.stream(), [chunk(p) for p in parts]), "replacement_chars")
    # 4 but the first and last are 10 apart: never more than 3 in any 10.
    parts = ["\ufffd", "abc", "\ufffd", "de\ufffd", "fgh", "\ufffd"]
    assert feed_all(g.stream(), [chunk(p) for p in parts]) == b""


def test_replacement_chars_default_tolerates_partial_characters() -> None:
    text = ("caf\ufffd ok " * 40)[:300]  # one U+FFFD every 8 characters
    r = chunk(text)
    assert DEFAULT.stream().feed(r) is r
    trip_of(DEFAULT.stream().feed(chunk("\ufffd" * 25)), "replacement_chars")
    r = chunk("\ufffd" * 24)
    assert DEFAULT.stream().feed(r) is r


# --------------------------------------------------------------------------- special tokens


@pytest.mark.parametrize("token", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<s>"])
def test_special_token_in_one_chunk(token: str) -> None:
    trip = trip_of(DEFAULT.stream().feed(chunk(f"Sure{token}user")), "special_tokens")
    assert token in trip.message


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("cut", range(1, len("<|im_end|>")))
def test_special_token_split_across_two_chunks(kind: Kind, cut: int) -> None:
    token = "<|im_end|>"
    sg = DEFAULT.stream()
    first = chunk("Done." + token[:cut], kind)
    assert sg.feed(first) is first
    trip_of(sg.feed(chunk(token[cut:] + "\n", kind)), "special_tokens")


def test_special_token_one_char_per_chunk_and_escaped() -> None:
    pieces = ["x", *"<|endoftext|>"]
    trip_of(feed_all(DEFAULT.stream(), [chunk(p) for p in pieces]), "special_tokens")
    trip_of(DEFAULT.stream().feed(raw_chunk(b"\\u003c|im_end|\\u003e")), "special_tokens")


def test_near_misses_and_other_choices_do_not_make_a_token() -> None:
    pieces = ["<|im_", "start", " |>", "<", "/", "S>"]
    assert feed_all(DEFAULT.stream(), [chunk(p) for p in pieces]) == b""
    # Halves of a token in two different choices are two unrelated texts.
    r = chunk("a <|im_", index=0) + chunk("end|> b", index=1)
    assert DEFAULT.stream().feed(r) is r


def test_special_tokens_custom_list_and_disabled() -> None:
    g = guard(special_tokens=SpecialTokensRule(tokens=("[STOP]",)))
    r = chunk("<|im_end|>")
    assert g.stream().feed(r) is r
    trip_of(feed_all(g.stream(), [chunk("a[ST"), chunk("OP]")]), "special_tokens")
    off = guard(special_tokens=SpecialTokensRule(enabled=False))
    assert off.stream().feed(r) is r


TOKEN_SETS: list[tuple[str, ...]] = [
    ("<|im_end|>", "</s>", "<s>"),  # one first character: the `in` pre-check
    ("<|im_end|>", "</s>", "[STOP]", "x\u00e9\U0001f600", "a"),  # the one-class regex
]


@settings(max_examples=200, deadline=None)
@given(
    before=st.text("ab<|/s>_ \n", max_size=30),
    after=st.text("ab<|/s>_ \n", max_size=10),
    tokens=st.sampled_from(TOKEN_SETS),
    pick=st.integers(0, 4),
    cuts=st.lists(st.integers(0, 60), max_size=12),
)
def test_a_token_is_found_however_the_text_is_cut(
    before: str, after: str, tokens: tuple[str, ...], pick: int, cuts: list[int]
) -> None:
    g = guard(special_tokens=SpecialTokensRule(tokens=tokens))
    text = before + tokens[pick % len(tokens)] + after
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    trip_of(feed_all(g.stream(), [chunk(p) for p in pieces]), "special_tokens")


# --------------------------------------------------------------------------- repetition

SMALL_REP = RepetitionRule(max_period=10, min_repeats=4, min_chars=12)


@pytest.mark.parametrize(
    ("text", "trips"),
    [
        ("intro " + "abc" * 4, True),  # period 3 × 4 = 12 chars: exactly at the limit
        ("intro " + "bc" + "abc" * 3, False),  # 11 periodic characters
        ("intro " + "abc" * 4 + "ab", True),  # a partial last unit still counts
        ("x" * 12, True),
        ("x" * 11, False),
        ("0123456789" * 4, True),  # period 10 = max_period
        ("0123456789A" * 5, False),  # period 11 > max_period
        ("abcd" * 3 + "abce", False),  # broken at the end
    ],
)
def test_repetition_thresholds(text: str, trips: bool) -> None:
    g = guard(repetition=SMALL_REP)
    v = g.stream().feed(chunk(text))
    if trips:
        trip = trip_of(v, "repetition")
        assert "repetition" in trip.message
    else:
        assert not isinstance(v, Trip)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("ab ", min_size=1, max_size=80),
    max_period=st.integers(1, 12),
    min_repeats=st.integers(2, 5),
    min_chars=st.integers(1, 30),
)
def test_repetition_matches_its_definition(
    text: str, max_period: int, min_repeats: int, min_chars: int
) -> None:
    """Trips iff for some period p <= max_period the last max(min_repeats * p,
    min_chars) characters have period p (brute force)."""
    n = len(text)

    def periodic(p: int) -> bool:
        span = max(min_repeats * p, min_chars)
        return span <= n and all(text[i] == text[i + p] for i in range(n - span, n - p))

    rule = RepetitionRule(max_period=max_period, min_repeats=min_repeats, min_chars=min_chars)
    v = guard(repetition=rule).stream().feed(chunk(text))
    assert isinstance(v, Trip) == any(periodic(p) for p in range(1, max_period + 1))


def test_repetition_defaults_need_512_periodic_characters() -> None:
    def run(text: str) -> bytes | Trip:
        return feed_all(DEFAULT.stream(), [chunk(text[i : i + 3]) for i in range(0, len(text), 3)])

    assert run("Sure! " + "br" * 255) == b""  # 510 characters
    # Looked for every 16 new characters: found by 16 characters past the limit.
    trip = trip_of(run("Sure! " + "br" * 264), "repetition")
    assert trip.excerpt in ("'br' x256+", "'rb' x256+")
    sentence = "I am sorry, I cannot help with that request today. "  # 51 chars
    assert run(sentence * 10) == b""  # 510 characters
    trip_of(run(sentence * 10 + sentence[:18]), "repetition")
    assert run("    " * 100 + "x") == b""  # 400 spaces of indentation


def test_repetition_spares_ordinary_long_text() -> None:
    text = " ".join(
        f"Paragraph {i}: the quick brown fox jumps over the lazy dog, then rests."
        for i in range(80)
    )
    code = "".join(f"    value_{i} = compute({i}, 0, 0, 0)\n" for i in range(80))
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(60))
    for t in (text, code, table, "-" * 400, "=" * 80 + "\n" + "." * 300):
        assert feed_all(DEFAULT.stream(), [chunk(t[i : i + 4]) for i in range(0, len(t), 4)]) == b""


def test_repetition_log_action() -> None:
    g = guard(repetition=RepetitionRule(min_chars=20, action="log"))
    sg = g.stream()
    assert feed_all(sg, [chunk("ha" * 50), chunk("ha" * 50)]) == b""
    [note] = sg.notes
    assert note.rule == "repetition"


# --------------------------------------------------------------------------- malformed events


@pytest.mark.parametrize(
    "bad",
    [
        b"data: not json\n\n",
        b'data: {"id":"x","object":"chat.completion.chunk"}\n\n',  # no choices
        b'data: {"choices":"nope"}\n\n',
        b"data: [1, 2]\n\n",
    ],
)
def test_malformed_events_are_dropped_by_default(bad: bytes) -> None:
    good1, good2 = chunk("one"), chunk("two")
    sg = DEFAULT.stream()
    out = sg.feed(good1 + bad + good2)
    assert out == good1 + good2
    [note] = sg.notes
    assert note.rule == "malformed"
    assert "dropped" in note.message
    assert sg.feed(bad) == b""


@pytest.mark.parametrize("cut", [40, 120, 156, 194])  # 156, 194: just after a "}"
def test_cut_off_last_event_is_dropped(cut: int) -> None:
    """What SSEFramer.flush returns when the upstream closed mid-event."""
    framer = SSEFramer()
    first = framer.feed(chunk("one") + chunk("two")[:cut])
    last = framer.flush()
    assert last.endswith(b"\n\n")
    sg = DEFAULT.stream()
    assert sg.feed(first) is first
    assert sg.feed_final(last) == b""
    assert [n.rule for n in sg.notes] == ["malformed"]
    whole = chunk("three")
    assert sg.feed_final(whole) is whole


def test_malformed_abort_and_disabled() -> None:
    bad = b"data: garbage\n\n"
    trip = trip_of(
        guard(malformed=MalformedRule(action="abort")).stream().feed(chunk("a") + bad),
        "malformed",
    )
    assert "garbage" in trip.excerpt
    assert guard(malformed=MalformedRule(enabled=False)).stream().feed(bad) is bad


@pytest.mark.parametrize(
    "shaped",
    [
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],}\n\n',  # trailing comma
        b'data: {"choices":[{"index":0,"delta":{"content":5}}]}\n\n',
    ],
)
def test_strict_json_catches_what_the_shape_check_lets_through(shaped: bytes) -> None:
    assert DEFAULT.stream().feed(shaped) is shaped
    strict = guard(malformed=MalformedRule(strict_json=True))
    assert strict.stream().feed(shaped) == b""
    ok = chunk("fine")
    assert strict.stream().feed(ok) is ok


def test_invalid_utf8_is_malformed() -> None:
    bad = raw_chunk(b"caf\xe9")
    assert DEFAULT.stream().feed(chunk("x") + bad) == chunk("x")


# --------------------------------------------------------------------------- several choices


def test_choices_are_checked_separately() -> None:
    g = guard(repetition=SMALL_REP)
    # Interleaved, the two choices' texts would look like "abababab...".
    regions = [chunk("a", index=0) + chunk("b", index=1) for _ in range(8)]
    assert feed_all(g.stream(), regions) == b""
    trip_of(feed_all(g.stream(), [chunk("ab", index=1)] * 16), "repetition")
    sg = DEFAULT.stream()
    r = chunk("x <|im", index=2)
    assert sg.feed(r) is r
    trip_of(sg.feed(chunk("_end|>", index=2)), "special_tokens")


# --------------------------------------------------------------------------- error event, bodies


def test_invalid_output_event_is_an_openai_error_then_done() -> None:
    trip = Trip("control_chars", "Stopped: control character.", "'\\x00'")
    events = SSEParser().feed(invalid_output_event(trip))
    assert [e.data for e in events][1] == b"[DONE]"
    assert json.loads(events[0].data or b"") == {
        "error": {
            "message": "Stopped: control character.",
            "type": "server_error",
            "param": None,
            "code": "invalid_output",
        }
    }


def chat_body(text: str) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    return json.dumps(
        {"object": "chat.completion", "choices": [choice | {"finish_reason": "stop"}]}
    ).encode()


def test_check_body() -> None:
    assert DEFAULT.check_body(chat_body("Hello there!\n\tBye.")) is None
    assert DEFAULT.check_body(chat_body("")) is None
    trip_of(DEFAULT.check_body(chat_body("bad \x1b[31m")) or b"", "control_chars")
    completion = {"object": "text_completion", "choices": [{"index": 0, "text": "hi</s>"}]}
    trip_of(DEFAULT.check_body(json.dumps(completion).encode()) or b"", "special_tokens")
    # A loop that stopped before the end of the answer still counts.
    trip_of(DEFAULT.check_body(chat_body("na" * 400 + " Batman!" * 3)) or b"", "repetition")
    assert DEFAULT.check_body(b'{"error": {"message": "x", "code": 500}}') is None
    trip_of(DEFAULT.check_body(b"<html>502</html>") or b"", "malformed")
    trip_of(DEFAULT.check_body(b'{"object": "chat.completion"}') or b"", "malformed")


def test_check_body_notes_log_rules() -> None:
    g = guard(special_tokens=SpecialTokensRule(action="log"))
    notes: list[Trip] = []
    assert g.check_body(chat_body("ok <|im_end|>"), notes) is None
    assert [n.rule for n in notes] == ["special_tokens"]


# --------------------------------------------------------------------------- policy


def test_rule_thresholds_are_validated() -> None:
    base = 'backends:\n  primary: {url: "http://127.0.0.1:8000"}\nguard:\n'
    cases = {
        "  repetition: {min_repeats: 1}\n": "guard.repetition.min_repeats: must be >= 2",
        "  replacement_chars: {window_chars: 8, max_in_window: 8}\n": (
            "guard.replacement_chars.max_in_window: must be < window_chars (8)"
        ),
        "  special_tokens: {tokens: ['']}\n": "guard.special_tokens.tokens: item 0 must be",
    }
    for section, message in cases.items():
        with pytest.raises(PolicyError, match=re.escape(f"<string>:4: {message}")):
            parse_policy(base + section, env={})


def test_guard_section_from_yaml() -> None:
    text = """
backends:
  primary: {url: "http://127.0.0.1:8000"}
guard:
  control_chars: {action: log}
  special_tokens:
    tokens: ["<|eot_id|>"]
  repetition: {min_chars: 1024}
  malformed: {action: abort}
"""
    g = parse_policy(text).guard
    assert g.control_chars.action == "log"
    assert g.special_tokens.tokens == ("<|eot_id|>",)
    assert g.repetition.min_chars == 1024
    assert g.malformed.action == "abort"
    bad = text.replace("min_chars: 1024", "min_repeats: 1")
    with pytest.raises(
        PolicyError, match=r"<string>:8: guard.repetition.min_repeats: must be >= 2"
    ):
        parse_policy(bad)


# --------------------------------------------------------------------------- property

_TEXT = st.text(
    st.characters(exclude_categories=("Cc", "Cs"), exclude_characters="\ufffd")
    | st.sampled_from("\n\t\r 😀🙂🏽\u200d"),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(_TEXT, min_size=1, max_size=40),
    kind=st.sampled_from(["chat", "completion"]),
    ensure_ascii=st.booleans(),
    compact=st.booleans(),
    cuts=st.lists(st.integers(0, 45), max_size=10),
)
def test_ordinary_streams_pass_untouched(
    tokens: list[str], kind: Kind, ensure_ascii: bool, compact: bool, cuts: list[int]
) -> None:
    # Under 512 characters, so no repetition can reach the default limit.
    assume(not any(t in "".join(tokens) for t in SpecialTokensRule().tokens))
    kw = {"ensure_ascii": ensure_ascii, "compact": compact}
    events = [event(chunk_obj("", kind), **kw)] if kind == "chat" else []
    events += [chunk(t, kind, **kw) for t in tokens]
    final = chunk_obj(None, kind)
    final["choices"][0]["finish_reason"] = "stop"
    usage = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": {"a": 1}}
    events += [event(final, **kw), event(usage, **kw), DONE]
    bounds = sorted({0, len(events), *(c for c in cuts if c < len(events))})
    regions = [b"".join(events[a:b]) for a, b in itertools.pairwise(bounds)]
    sg = DEFAULT.stream()
    for r in regions:
        assert sg.feed(r) is r
    assert sg.notes == []
