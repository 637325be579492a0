"""Runs of envelope chunks: found exactly, and never change what the relay or
the guard decide about a region."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.guard.compiled import Guard
from proxy.openai.chunkrun import JOIN_BYTES, NATIVE, ChunkRuns, Run, Scan
from proxy.openai.chunks import markers
from proxy.policy import GuardPolicy

DONE = b"data: [DONE]\n\n"
GUARD = Guard(GuardPolicy())


def chunk(text: str, finish: str | None = None, role: bool = False, **extra: Any) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
    obj = {
        "id": "chatcmpl-7e1d",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def answer(words: list[str]) -> bytes:
    return b"".join(
        [chunk("", role=True), *(chunk(w) for w in words), chunk("", finish="stop"), DONE]
    )


WORDS = [f"word{i} " for i in range(40)] + ['say "hi"\n', "back\\slash", "é 日本", "\t"]


# Both scanners, held to the same answers (the C one where it is built:
# test_runscan.py fails if a compiler exists and it is not).
SCANS = [
    pytest.param(None, id="pure"),
    pytest.param(NATIVE, id="native", marks=pytest.mark.skipif(NATIVE is None, reason="not built")),
]
both = pytest.mark.parametrize("scan", SCANS)


def learnt(region: bytes, scan: Scan | None = NATIVE) -> ChunkRuns:
    runs = ChunkRuns(scan)
    runs.cut(region)
    return runs


def texts(run: Run) -> str:
    return str(json.loads(b'"' + run.raw + b'"'))


@both
def test_a_burst_is_one_run_between_the_first_and_last_chunks(scan: Scan | None) -> None:
    region = answer(WORDS)
    run = ChunkRuns(scan).cut(region)  # learnt from the middle of a big first region
    assert run is not None
    first, last = chunk("", role=True), chunk("", finish="stop") + DONE
    assert (run.start, run.end) == (len(first), len(region) - len(last))
    assert texts(run) == "".join(WORDS)
    assert (run.events, run.empties) == (len(WORDS), 0)


@both
def test_small_regions_and_other_envelopes_are_not_runs(scan: Scan | None) -> None:
    runs = learnt(answer(WORDS), scan)
    assert runs.cut(chunk("one")) is None  # below MIN_RUN_BYTES: plain searches
    usage = b"".join(chunk(w, usage={"completion_tokens": i}) for i, w in enumerate(WORDS))
    assert runs.cut(usage) is None  # the envelope changes per chunk


def test_an_envelope_that_varies_per_chunk_is_given_up_on() -> None:
    runs = ChunkRuns()
    for i in range(10):
        region = b"".join(chunk(w, usage={"n": i * 100 + j}) for j, w in enumerate(WORDS))
        assert runs.cut(region) is None
    assert runs._failures <= 4


# --------------------------------------------------------------------------- soundness

TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from('"\\\n<|\x00\ufffd'),
    max_size=12,
)
EVENT = st.one_of(
    TEXT.map(chunk),
    TEXT.map(chunk),
    TEXT.map(chunk),
    TEXT.map(lambda t: chunk(t, finish="stop")),
    TEXT.map(lambda t: chunk(t, role=True)),
    st.just(DONE),
    st.just(b'data: {"error":{"message":"boom","code":500}}\n\n'),
    st.just(b": ping\n\n"),
    st.just(b"data: not json\n\n"),
    TEXT.map(lambda t: chunk(t)[:-3] + b',"x":1}\n\n'),  # same start, other end
    TEXT.map(lambda t: chunk(t).replace(b'"content":"', b'"content":"\n', 1)),  # raw newline
)


@both
@settings(max_examples=300, deadline=None)
@given(
    teach=st.lists(st.sampled_from(WORDS), min_size=30, max_size=30),
    events=st.lists(EVENT, min_size=1, max_size=60),
    pad=st.integers(0, 40),
)
def test_a_run_never_changes_the_relays_or_the_guards_verdict(
    scan: Scan | None, teach: list[str], events: list[bytes], pad: int
) -> None:
    """Any region, after any learnt envelope: the relay's markers and the
    guard's verdict with the run equal those without it."""
    runs = learnt(answer(teach), scan)
    region = b"".join([chunk("x") for _ in range(pad)] + events)
    run = runs.cut(region)
    assert markers(region, run) == markers(region)
    with_run = GUARD.stream().feed(region, run)
    without = GUARD.stream().feed(region)
    assert with_run == without
    if run is not None:
        assert b"\n" not in run.raw


def whole(literal: bytes) -> bool:
    """A whole JSON string body, by the json module (any bytes, as latin-1)."""
    try:
        json.loads('"' + literal.decode("latin-1") + '"', strict=False)
    except ValueError:
        return False
    return True


def _cut_by_splitting(runs: ChunkRuns, region: bytes) -> tuple[int, int, int, bytes, int] | None:
    """The run `ChunkRuns.cut` finds, the plain way: the run's bytes split on
    newlines, each event line sliced, the envelope rebuilt and compared, each
    literal checked by the json module."""
    prefix, suffix = runs._prefix, runs._suffix
    if region.startswith(prefix):
        i = 0
    else:
        i = region.find(b"\n\n" + prefix)
        if i < 0:
            return None
        i += 2
    j = len(region) if region.endswith(suffix) else region.rfind(suffix)
    if j < i:
        return None
    if j < len(region):
        j += len(suffix)
    mid = region[i:j]
    lines = mid.split(b"\n")  # e1, "", e2, "", …, ek, "", ""
    literals = [line[len(prefix) : 2 - len(suffix)] for line in lines[0:-2:2]]
    if prefix + (suffix + prefix).join(literals) + suffix != mid:
        return None
    if not all(map(whole, literals)):
        return None
    return i, j, len(literals), b"".join(literals), literals.count(b"")


def found(run: Run | None) -> tuple[int, int, int, bytes, int] | None:
    return None if run is None else (run.start, run.end, run.events, run.raw, run.empties)


@both
@settings(max_examples=300, deadline=None)
@given(
    head=st.lists(EVENT, max_size=3),
    body=st.lists(st.one_of(TEXT.map(chunk), EVENT), min_size=1, max_size=40),
    tail=st.lists(EVENT, max_size=3),
    end=st.sampled_from([b"", b"\n", b"data: {", b"\n\n\n", b'"}', b"\r\n"]),
)
def test_a_run_is_exactly_what_splitting_the_region_finds(
    scan: Scan | None, head: list[bytes], body: list[bytes], tail: list[bytes], end: bytes
) -> None:
    """Issue 24: the run is cut without splitting the region on every byte;
    it is the same run, with the same literals, as the plain way finds."""
    runs = learnt(answer(WORDS), scan)
    region = b"".join(head + [chunk("x")] * 12 + body + tail) + end
    assert found(runs.cut(region)) == _cut_by_splitting(runs, region)


@both
def test_a_burst_longer_than_one_batch_is_compared_whole(scan: Scan | None) -> None:
    """The rebuilt envelope is compared a batch of literals (JOIN_BYTES of
    envelope) at a time: a change anywhere (inside a batch, in the junction
    between two batches, at the very end) is still found, and a burst of
    several batches is one run."""
    runs = learnt(answer(WORDS), scan)
    batch = runs._batch
    assert 16 <= batch <= JOIN_BYTES // len(runs._junction)
    words = [f"w{i} " for i in range(3 * batch + 5)]
    region = answer(words)
    run = runs.cut(region)
    assert run is not None and texts(run) == "".join(words) and run.events == len(words)
    assert _cut_by_splitting(runs, region) == found(run)
    events = [chunk(w) for w in words]
    # The first chunk of the second batch (its junction), one inside the
    # third batch and the last chunk of the run become other events.
    for at in (batch, batch + 1, 2 * batch + 7, len(words) - 1):
        for other in (
            chunk(words[at], finish="stop"),
            chunk(words[at])[:-3] + b',"x":1}\n\n',
            chunk(words[at]).replace(b'"tiny"', b'"tinY"'),
        ):
            changed = [*events[:at], other, *events[at + 1 :]]
            region = b"".join([chunk("", role=True), *changed, chunk("", finish="stop"), DONE])
            want = _cut_by_splitting(runs, region)
            run = runs.cut(region)
            assert found(run) == want
            assert markers(region, run) == markers(region)
