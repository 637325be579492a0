"""The seam of a rescue (`proxy.openai.seam`): examples, hostile text, properties."""

from __future__ import annotations

import json
import time

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from proxy.openai.seam import (
    MARGIN_CHARS,
    Seam,
    align,
    normalise,
    prepare,
    strip_events,
)

SENT = "The quick brown fox jumps over"


def decide(sent: str, cont: str, *, ended: bool = True, restart_only: bool = False) -> Seam:
    return align(prepare(sent), cont, ended=ended, restart_only=restart_only)


def client_text(sent: str, cont: str, **kw: bool) -> str:
    seam = decide(sent, cont, **kw)
    assert seam.kind != "misaligned"
    return sent + cont[seam.strip :]


def test_examples() -> None:
    assert client_text(SENT, " the lazy dog") == SENT + " the lazy dog"
    assert client_text(SENT, SENT + " the lazy dog") == SENT + " the lazy dog"
    assert client_text(SENT, "fox jumps over the lazy dog") == SENT + " the lazy dog"
    assert client_text(SENT, " jumps over the lazy dog") == SENT + " the lazy dog"
    # One repeated word may be prose: left alone.
    assert client_text(SENT, " over and over") == SENT + " over and over"
    # Case and whitespace at the seam do not hide a restart.
    assert client_text(SENT, "\n\nthe  QUICK brown\tfox jumps over, lazily") == SENT + ", lazily"
    # The tail is rewritten by the continuation: plural, punctuation.
    assert client_text("The quick brown fox", "brown foxes jump.") == "The quick brown foxes jump."
    # Restating the tail with other words is no repeat: relayed as is.
    assert client_text(SENT, "brown foxes jump.") == SENT + "brown foxes jump."
    # Nothing is inserted: a continuation mid-word stays mid-word.
    assert client_text("The qui", "ck brown") == "The quick brown"
    assert decide(SENT, "The quick brown cat sleeps").kind == "misaligned"
    # Two shared words are not yet a different restart.
    assert decide(SENT, "The quick answer is no").kind == "clean"


def test_undecided_until_it_can_tell() -> None:
    s = prepare(SENT)
    assert align(s, "The quick", ended=False).kind == "pending"
    assert align(s, "The quick brown fox jumps", ended=False).kind == "pending"
    assert align(s, "The quick brown fox jumps over", ended=False) == Seam("restart", len(SENT))
    assert align(s, "The dog", ended=False).kind == "clean"  # one mismatch decides
    assert align(s, "  ", ended=False).kind == "pending"
    assert align(s, "  ", ended=True).kind == "clean"
    # It ended while still repeating: it said nothing new.
    assert align(s, "The quick brown", ended=True) == Seam("restart", 15)
    assert align(s, " fox jumps", ended=True) == Seam("overlap", 10)
    assert align(s, " over", ended=True).kind == "clean"


def test_the_trusted_path_only_looks_for_a_whole_restart() -> None:
    assert decide(SENT, SENT + " more", restart_only=True) == Seam("restart", len(SENT))
    assert decide(SENT, "fox jumps over it", restart_only=True).kind == "clean"
    assert decide(SENT, "The quick brown cat", restart_only=True).kind == "clean"


def test_nothing_sent_nothing_to_align() -> None:
    assert decide("", "anything").kind == "clean"
    assert decide(" \n\t", "anything").kind == "clean"


def test_hostile_text() -> None:
    nul = "a\x00b c\x00d e"
    assert client_text(nul, nul + " f") == nul + " f"
    lone = "x \ud800 y \udfff z"
    assert client_text(lone, lone + " w") == lone + " w"
    # Case folding that changes lengths (ß → ss, İ → i̇) maps back to whole characters.
    s = "Straße İstanbul groß"
    assert client_text(s, "STRASSE i̇stanbul GROSS und mehr") == s + " und mehr"
    assert client_text(s, "İstanbul groß und") == s + " und"


def event(content: str, finish: str | None = None, **delta: str) -> bytes:
    obj = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {**delta, "content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def contents(region: bytes) -> list[str]:
    out = []
    for ev in region.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            out.append(json.loads(ev[6:])["choices"][0]["delta"]["content"])
    return out


def test_strip_events_keeps_the_chunk_structure() -> None:
    region = event("", role="assistant") + event("The q") + event("uick") + event(" brown")
    region += event("", "stop") + b"data: [DONE]\n\n"
    out = strip_events(region, 7, "chat")
    assert contents(out) == ["", "ck", " brown", ""]
    assert out.endswith(event(" brown") + event("", "stop") + b"data: [DONE]\n\n")  # as is
    # A stripped event that says more (its finish_reason) stays, emptied.
    out = strip_events(event("ab") + event("cd", "length"), 4, "chat")
    assert contents(out) == [""]
    assert json.loads(out[6:-2])["choices"][0]["finish_reason"] == "length"
    # A lone surrogate from the backend stays valid JSON once re-encoded.
    lone = b'data: {"choices":[{"index":0,"delta":{"content":"a\\ud800b"}}]}\n\n'
    out = strip_events(lone, 1, "chat")
    assert json.loads(out[6:-2])["choices"][0]["delta"]["content"] == "\ud800b"
    # Completions carry `text`.
    comp = b'data: {"choices":[{"index":0,"text":"hello"}]}\n\n'
    assert json.loads(strip_events(comp, 2, "completions")[6:-2])["choices"][0]["text"] == "llo"


def test_a_long_restart_costs_linear_time() -> None:
    """The rescue aligns again only as the held text grows by an eighth."""
    sent = " ".join(f"word{i}" for i in range(20_000))  # ≈ 190 kB
    s = prepare(sent)
    t0 = time.perf_counter()
    held, check_at, calls = "", 1, 0
    for tok in (" " + w if i else w for i, w in enumerate(sent.split(" "))):
        held += tok
        if len(held) >= check_at:
            check_at = len(held) + max(1, len(held) // 8)
            calls += 1
            if align(s, held, ended=len(held) > len(sent) + MARGIN_CHARS).decided:
                break
    assert align(s, held + " more", ended=False) == Seam("restart", len(sent))
    assert calls < 120 and time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------------- properties

TEXT = st.text(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(" \n\tAaßİΣς"))
WORDS = st.lists(st.text("abcAB", min_size=1, max_size=4), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(TEXT, TEXT)
@example("a ", " b")
@example("ΣΑΣ", "x")
def test_a_restart_is_never_relayed_twice(sent: str, rest: str) -> None:
    assume(sent.strip())
    cont = sent + rest
    seam = decide(sent, cont)
    assert seam.kind == "restart"
    out = cont[seam.strip :]
    assert rest.endswith(out)  # only the repeat (and whitespace at the seam) goes
    assert normalise(sent + out) == normalise(cont)


@settings(max_examples=300, deadline=None)
@given(WORDS, st.integers(min_value=2), WORDS)
def test_an_overlap_of_whole_words_is_stripped(words: list[str], k: int, more: list[str]) -> None:
    k = min(k, len(words))
    assume(k >= 2)
    sent = " ".join(words)
    rest = " " + " ".join(f"z{w}" for w in more)  # no word of the sent text starts with z
    cont = " ".join(words[-k:]) + rest
    seam = decide(sent, cont)
    assert seam.kind in ("overlap", "restart")
    out = cont[seam.strip :]
    assert out == rest


@settings(max_examples=300, deadline=None)
@given(TEXT, TEXT)
def test_a_clean_continuation_is_untouched(sent: str, cont: str) -> None:
    first = normalise(cont).lstrip(" ")[:1]
    assume(first and first not in normalise(sent))
    assert decide(sent, cont) == Seam("clean")
    assert decide(sent, cont, ended=False) == Seam("clean")


@settings(max_examples=300, deadline=None)
@given(WORDS, st.integers(min_value=0), TEXT, st.data())
def test_a_decision_on_a_prefix_is_the_decision(
    words: list[str], k: int, tail: str, data: st.DataObject
) -> None:
    """What the rescue decides while holding a prefix back is what it would
    decide on the whole continuation (up to whitespace at the seam)."""
    sent = " ".join(words)
    k = k % (len(words) + 1)
    cont = " ".join(words[len(words) - k :]) + tail
    cut = data.draw(st.integers(min_value=0, max_value=len(cont)))
    early = decide(sent, cont[:cut], ended=False)
    final = decide(sent, cont)
    if early.decided:
        assert early.kind == final.kind
        assert cont[early.strip : final.strip].isspace() or early.strip == final.strip
