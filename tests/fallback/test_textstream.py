"""Incremental detokenization and stop strings, on a toy byte-level "tokenizer"."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from proxy.fallback.engines.textstream import IncrementalDecoder, StopMatcher


def _decode(ids: Sequence[int]) -> str:
    # Each id is one byte, as in byte-level BPE vocabularies before merges.
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    decoder = IncrementalDecoder(_decode, list(b"prompt: "))
    matcher = StopMatcher(stops)
    out = ""
    for byte in text.encode():
        out += matcher.push(decoder.push(byte))
        if matcher.matched is not None:
            return out, matcher.matched
    out += matcher.push(decoder.flush()) + matcher.flush()
    return out, matcher.matched


def test_multibyte_characters_are_emitted_whole() -> None:
    decoder = IncrementalDecoder(_decode, [])
    pieces = [decoder.push(b) for b in "日本".encode()]
    assert pieces == ["", "", "日", "", "", "本"]
    assert decoder.flush() == ""


def test_incomplete_character_at_the_end_is_flushed() -> None:
    decoder = IncrementalDecoder(_decode, [])
    assert decoder.push("é".encode()[0]) == ""
    assert decoder.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("text", "stops", "expected", "matched"),
    [
        ("Hello world. Bye", ["."], "Hello world", "."),
        ("Hello world. Bye", ["world", "Hello"], "", "Hello"),
        ("abcabd", ["abd"], "abc", "abd"),  # a false start is released, not lost
        ("ab", ["abc"], "ab", None),  # a partial match at the end is released
        ("x<|end|>y", ["<|end|>"], "x", "<|end|>"),
        ("no stop here", [], "no stop here", None),
        ("日本語です", ["語"], "日本", "語"),
    ],
)
def test_stop_strings(text: str, stops: list[str], expected: str, matched: str | None) -> None:
    assert _stream(text, stops) == (expected, matched)


def test_text_that_may_start_a_stop_is_held_back() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("O") == ""
    assert matcher.push("RY") == "STORY"


def test_the_rust_decode_gives_the_wrappers_text(tiny_model_dir: Path) -> None:
    """The engine decodes with the Rust tokenizer directly (twice a token, 6x
    cheaper than the Python wrapper): on the tiny model's tokenizer it must
    give exactly the wrapper's text for any ids, special tokens included."""
    from transformers import AutoTokenizer

    from proxy.fallback.engines.engine import _backend_decode

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    fast = _backend_decode(tokenizer)
    assert fast is not None
    rng = random.Random(7)
    for _ in range(2000):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
        assert fast(ids, skip_special_tokens=True) == tokenizer.decode(
            ids, skip_special_tokens=True
        ), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper() -> None:
    from proxy.fallback.engines.engine import _backend_decode

    class Tok:
        backend_tokenizer = object()
        clean_up_tokenization_spaces = True

    assert _backend_decode(Tok()) is None
