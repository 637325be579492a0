"""The incremental SSE parser on split, merged and odd inputs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.openai.sse import SSEFramer, SSEParser, error_events, find_line

STREAM = (
    b": hello\n\n"
    b'data: {"a":1}\n\n'
    b"event: note\ndata: line1\ndata: line2\n\n"
    b"id: 7\nretry: 10\ndata:nospace\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [None, b'{"a":1}', b"line1\nline2", b"nospace", b"[DONE]"]


def feed_all(parser: SSEParser, pieces: list[bytes]) -> list[bytes | None]:
    out = []
    for p in pieces:
        out.extend(e.data for e in parser.feed(p))
    out.extend(e.data for e in parser.flush())
    return out


def test_whole_stream() -> None:
    p = SSEParser()
    events = p.feed(STREAM)
    assert [e.data for e in events] == EXPECTED
    assert b"".join(e.raw for e in events) == STREAM
    assert events[2].event == b"note"
    assert p.pending == 0


@pytest.mark.parametrize("offset", range(1, len(STREAM)))
def test_split_at_every_byte_offset(offset: int) -> None:
    assert feed_all(SSEParser(), [STREAM[:offset], STREAM[offset:]]) == EXPECTED


def test_byte_by_byte() -> None:
    assert feed_all(SSEParser(), [bytes([b]) for b in STREAM]) == EXPECTED


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"])
def test_crlf_and_cr_line_endings(eol: bytes) -> None:
    stream = STREAM.replace(b"\n", eol)
    assert feed_all(SSEParser(), [stream]) == EXPECTED
    # A CRLF split between two reads is one line ending, not two.
    for offset in range(1, len(stream)):
        assert feed_all(SSEParser(), [stream[:offset], stream[offset:]]) == EXPECTED


def test_final_event_without_blank_line_is_flushed() -> None:
    p = SSEParser()
    assert p.feed(b"data: a\n\ndata: tail") and p.pending == len(b"data: tail")
    assert [e.data for e in p.flush()] == [b"tail"]


def test_leading_blank_lines_are_ignored() -> None:
    assert [e.data for e in SSEParser().feed(b"\n\n\ndata: x\n\n\n\ndata: y\n\n")] == [b"x", b"y"]


def test_error_events_shape() -> None:
    events = SSEParser().feed(error_events("boom", "server_error", "invalid_output"))
    assert events[0].data == (
        b'{"error":{"message":"boom","type":"server_error","param":null,"code":"invalid_output"}}'
    )
    assert events[1].is_done


line_text = st.text(
    alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), max_size=30
)
event_st = st.one_of(
    st.lists(line_text, min_size=1, max_size=3).map(lambda ls: ("data", ls)),
    line_text.map(lambda t: ("comment", [t])),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(event_st, max_size=8),
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
)
def test_any_framing_yields_the_same_events(
    events: list[tuple[str, list[str]]], eol: str, cuts: list[int]
) -> None:
    wire = ""
    expected: list[bytes | None] = []
    for kind, lines in events:
        if kind == "data":
            wire += "".join(f"data: {ln}{eol}" for ln in lines)
            expected.append("\n".join(lines).encode())
        else:
            wire += f":{lines[0]}{eol}"
            expected.append(None)
        wire += eol
    raw = wire.encode()
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    assert feed_all(SSEParser(), pieces) == expected


def frame_all(pieces: list[bytes]) -> list[bytes]:
    f = SSEFramer()
    regions = [r for r in (f.feed(p) for p in pieces) if r]
    tail = f.flush()
    return [*regions, tail] if tail else regions


@pytest.mark.parametrize("offset", range(1, len(STREAM)))
def test_framer_regions_end_at_event_boundaries(offset: int) -> None:
    regions = frame_all([STREAM[:offset], STREAM[offset:]])
    assert b"".join(regions) == STREAM
    for r in regions:
        assert r.endswith(b"\n\n")
        # Every region parses into whole events on its own.
        p = SSEParser()
        p.feed(r)
        assert p.pending == 0


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(event_st, max_size=8),
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
)
def test_framer_preserves_events_under_any_framing(
    events: list[tuple[str, list[str]]], eol: str, cuts: list[int]
) -> None:
    wire = ""
    for kind, lines in events:
        wire += (
            "".join(f"data: {ln}{eol}" for ln in lines) if kind == "data" else f":{lines[0]}{eol}"
        )
        wire += eol
    raw = wire.encode()
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    regions = frame_all(pieces)
    normalised = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    assert b"".join(regions) == normalised
    assert feed_all(SSEParser(), regions) == feed_all(SSEParser(), [raw])


def test_framer_completes_a_final_event_without_blank_line() -> None:
    f = SSEFramer()
    assert f.feed(b"data: a\n\ndata: b") == b"data: a\n\n"
    assert f.pending == len(b"data: b")
    assert f.flush() == b"data: b\n\n"


def test_find_line_only_matches_at_line_starts() -> None:
    region = b'data: {"c":"data: [DONE]"}\n\ndata: [DONE]\n\n'
    assert find_line(region, b"data: [DONE]") == region.index(b"\ndata: [DONE]") + 1
    assert find_line(b"data: [DONE]\n\n", b"data: [DONE]") == 0
    assert find_line(b'data: {"x": "data: [DONE]"}\n\n', b"data: [DONE]") == -1
