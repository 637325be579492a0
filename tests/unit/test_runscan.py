"""Issue 24: the C scanner of runs (`proxy.openai._runscan`) and the
pure-Python cut give the same run for any region: generated literals with
every kind of escape (whole, cut off, invalid), bare quotes, control bytes
and invalid UTF-8, and regions mutated byte by byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.openai.chunkrun import MAX_LEARN_FAILURES, NATIVE, ChunkRuns, Run, Scan

built = pytest.mark.skipif(NATIVE is None, reason="the C scanner is not built")

PREFIX = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
    b'"model":"m","choices":[{"index":0,"delta":{"content":"'
)
SUFFIX = b'"},"logprobs":null,"finish_reason":null}]}\n\n'


def teacher() -> bytes:
    return b"".join(PREFIX + f"w{i} ".encode() + SUFFIX for i in range(40))


def pair() -> tuple[ChunkRuns, ChunkRuns]:
    native, pure = ChunkRuns(NATIVE), ChunkRuns(None)
    native.cut(teacher())
    pure.cut(teacher())
    return native, pure


def fields(run: Run | None) -> tuple[int, int, int, bytes, int, bool] | None:
    return None if run is None else (*run,)


LITERAL = st.lists(
    st.sampled_from(
        [
            b"a",
            b"word ",
            b"\\n",
            b'\\"',
            b"\\\\",
            b"\\u00e9",
            b"\\uD83D",
            b"\\u12",
            b"\\x",
            b"\\",
            b'"',
            b"\x00",
            b"\x1f",
            b"\xff",
            b"\xc3",
            "é日".encode(),
            b"/",
            b"\\/",
            b"\\b",
            b"",
        ]
    ),
    max_size=5,
).map(b"".join)


@built
@settings(max_examples=500, deadline=None)
@given(st.lists(LITERAL, min_size=1, max_size=120))
def test_both_scanners_find_the_same_run(literals: list[bytes]) -> None:
    region = b"".join(PREFIX + lit + SUFFIX for lit in literals)
    native, pure = pair()
    got, want = native.cut(region), pure.cut(region)
    assert fields(got) == fields(want)
    if len(region) >= 2048 and want is not None:
        assert want.events == len(literals) and want.raw == b"".join(literals)
        assert want.empties == literals.count(b"")


@built
@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from([b"tok ", b"x", b"\\n", b""]), min_size=20, max_size=80),
    st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)), min_size=1, max_size=4),
)
def test_a_mutated_region_gets_the_same_verdict(
    literals: list[bytes], edits: list[tuple[int, bytes]]
) -> None:
    region = bytearray(b"".join(PREFIX + lit + SUFFIX for lit in literals))
    for at, new in edits:
        at %= len(region)
        region[at : at + len(new) or at + 1] = new
    native, pure = pair()
    assert fields(native.cut(bytes(region))) == fields(pure.cut(bytes(region)))


@built
def test_a_real_burst_decodes_to_its_text() -> None:
    words = ["a ", 'say "hi"', "new\nline", "é🚀", "", "back\\slash", "\x01"] * 200
    region = b"".join(
        PREFIX + json.dumps(w, ensure_ascii=False).encode()[1:-1] + SUFFIX for w in words
    )
    run = pair()[0].cut(region)
    assert run is not None
    assert json.loads(b'"' + run.raw + b'"', strict=False) == "".join(words)
    assert (run.events, run.empties, run.start, run.end) == (len(words), 200, 0, len(region))


@built
def test_the_scanner_refuses_what_it_cannot_judge() -> None:
    assert NATIVE is not None
    region = PREFIX + b"x" + SUFFIX
    assert NATIVE(region, 0, len(region), PREFIX, SUFFIX) == (1, b"x", 0)
    for bad in (
        (region, 0, len(region) + 1, PREFIX, SUFFIX),  # past the end
        (region, 5, 4, PREFIX, SUFFIX),
        (region, 0, len(region), PREFIX, b'"}\n'),  # no blank line
        (region, 0, len(region), PREFIX + b"\n", SUFFIX),  # two lines
    ):
        with pytest.raises(ValueError, match="scan:"):
            NATIVE(*bad)
    with pytest.raises(TypeError, match="scan:"):
        NATIVE(bytearray(region), 0, len(region), PREFIX, SUFFIX)  # type: ignore[arg-type]


def test_the_scanner_is_built_where_a_compiler_exists() -> None:
    """A failed build falls back to pure Python silently (setup.py's optional
    extension): here, with a compiler, that would be a defect."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    pure = os.environ.get("BROWNOUT_PURE") == "1"
    assert shutil.which(cc) is None or NATIVE is not None or pure


def test_brownout_pure_selects_the_python_scanner() -> None:
    code = "from proxy.openai.chunkrun import NATIVE; print(NATIVE is None)"
    env = {**os.environ, "BROWNOUT_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    assert out.stdout.strip() == b"True"


def test_brownout_version_says_which_scanner_runs() -> None:
    for pure, said in (("0", b"(C run scanner)"), ("1", b"(pure-Python run scanner)")):
        env = {**os.environ, "BROWNOUT_PURE": pure}
        out = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "--version"], env=env, capture_output=True
        )
        if pure == "0" and NATIVE is None:
            said = b"(pure-Python run scanner)"
        assert said in out.stdout, out


# Valid SSE events of several `data:` lines, two of them chunks of one choice:
# they pass single_choice_events (two markers, four newlines), and the one
# content literal gives an envelope with a newline in its prefix or suffix.
OTHER_LINE = b'data: {"choices":[{"index":0,"x":1}]}\n'
FINISH_LINE = b'data: {"finish_reason":null}\n\n'
LEAD = b'"}}]}\n'  # the content chunk's end, its line's newline


@pytest.mark.parametrize(
    "event",
    [
        OTHER_LINE + PREFIX + b"tok" + LEAD + FINISH_LINE,  # one in each
        OTHER_LINE + b'data: {"z":1}\n' + PREFIX + b"tok" + SUFFIX,  # two in the prefix
        PREFIX + b"tok" + LEAD + OTHER_LINE + FINISH_LINE,  # two in the suffix
    ],
    ids=["both", "prefix", "suffix"],
)
def test_an_envelope_of_several_data_lines_is_not_learnt(event: bytes) -> None:
    """The upstream chooses the events: such an envelope was learnt, and the
    C scanner then raised ValueError ("not a one-line envelope") out of
    ChunkRuns.cut into the relay, where the pure cut answered None."""
    region = event * 60
    for scan in {NATIVE, None}:
        runs = ChunkRuns(scan)
        assert runs.cut(region) is None
        assert runs._literal is None
        runs.cut(teacher())  # the plain envelope is still learnt afterwards
        assert runs.cut(teacher()) is not None


@pytest.mark.parametrize("scan", sorted({NATIVE, None}, key=lambda s: s is None))
def test_a_stream_read_one_event_at_a_time_learns_its_envelope(scan: Scan | None) -> None:
    """The envelope is learnt from the previous region's last event: a region
    of one event lost its first byte to `rfind`'s -1 (`ata: {`), failed to
    teach, and after MAX_LEARN_FAILURES such reads (the role chunk, then
    tokens one by one: the usual slow start) the stream never cut a run, not
    even the later burst of a client catching up."""
    runs = ChunkRuns(scan)
    first = PREFIX.replace(b'"delta":{', b'"delta":{"role":"assistant",') + SUFFIX
    assert runs.cut(first) is None
    for i in range(MAX_LEARN_FAILURES + 2):
        assert runs.cut(PREFIX + f"w{i} ".encode() + SUFFIX) is None  # small: no run
    assert runs._failures == 1  # the role chunk only
    burst = teacher()
    run = runs.cut(burst)
    assert run is not None and run.events == 40


# --------------------------------------------------------------- the scanner, attacked


def whole(literal: bytes) -> bool:
    """A whole JSON string body, by the json module (any bytes, as latin-1)."""
    try:
        json.loads('"' + literal.decode("latin-1") + '"', strict=False)
    except ValueError:
        return False
    return True


def reference(
    region: bytes, start: int, end: int, prefix: bytes, suffix: bytes
) -> tuple[int, bytes, int] | str | None:
    """scan()'s contract, spelt out with slices and the json module."""
    n, lp, ls = len(region), len(prefix), len(suffix)
    if (
        not 0 <= start <= end <= n
        or lp < 1
        or ls < 2
        or suffix[-2:] != b"\n\n"
        or b"\n" in prefix + suffix[:-2]
    ):
        return "ValueError"
    p, literals = start, []
    while p < end:
        if region[p : p + lp] != prefix or end - p < lp + ls:
            return None
        nl = region.find(b"\n", p + lp, end)
        a, b = p + lp, nl - (ls - 2)
        if nl < 0 or b < a or region[b : b + ls] != suffix or b + ls > end:
            return None
        if not whole(region[a:b]):
            return None
        literals.append(region[a:b])
        p = b + ls
    return len(literals), b"".join(literals), literals.count(b"")


def scanned(*args: object) -> tuple[int, bytes, int] | str | None:
    assert NATIVE is not None
    try:
        return NATIVE(*args)  # type: ignore[arg-type]
    except ValueError:
        return "ValueError"


WHOLE_ATOMS = [
    *(b"a", b"\\n", b'\\"', b"\\\\", b"\\/", b"\\b", b"\\f", b"\\r", b"\\t", b"\\u00e9"),
    *(b"\\uFFFF", b"\x00", b"\xff", b"\r", b"", b"0"),
    b'\\"},"logprobs":null,"finish_reason":null}]}',  # the suffix's line, escaped
]
BROKEN_ATOMS = [
    *(b"\\U0041", b"\\u", b"\\u0", b"\\u00", b"\\u000", b"\\uzzzz", b"\\x"),
    *(b"\\", b"\\\\\\", b'"', b"\n", b"\n\n"),
    SUFFIX[:-2],  # the suffix's line inside a literal, bare
    PREFIX,
    SUFFIX,
]
# Mostly whole literals (a bad one ends the run), one bad atom at a time.
ATTACK = st.lists(st.sampled_from(WHOLE_ATOMS) | st.sampled_from(BROKEN_ATOMS), max_size=5).map(
    b"".join
)
WHOLE_LITERAL = st.lists(st.sampled_from(WHOLE_ATOMS), max_size=5).map(b"".join)
ENVELOPES = [
    (PREFIX, SUFFIX),
    (b"d", b"\n\n"),  # the shortest suffix: the literal runs to the newline
    (b'"', b'"\n\n'),  # a quote for prefix and suffix
    (b"ab", b"b\n\n"),  # the suffix begins as the prefix ends
    (b"x", b"0123456789\n\n"),  # longer than the prefix, and hex: an escape cut
    (b"x", b"a\n\n"),  # by the suffix reads as whole if the scanner reads into it
]


@built
@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(ENVELOPES),
    st.lists(WHOLE_LITERAL, max_size=12),
    ATTACK,
    st.lists(WHOLE_LITERAL, max_size=3),
    st.binary(max_size=6),
    st.binary(max_size=6),
    st.integers(-2, 10**6),
    st.integers(-2, 10**6),
    st.booleans(),
)
def test_the_scanner_keeps_its_contract_on_any_bounds(
    envelope: tuple[bytes, bytes],
    before: list[bytes],
    attack: bytes,
    after: list[bytes],
    head: bytes,
    tail: bytes,
    start: int,
    end: int,
    clip: bool,
) -> None:
    """Any envelope, any literals (an escape cut at the suffix, the suffix's
    own bytes, raw newlines), any bounds (clipped: the region ends at `end`,
    where a read past it is one past the buffer)."""
    prefix, suffix = envelope
    body = b"".join(prefix + lit + suffix for lit in [*before, attack, *after])
    region = head + body + tail
    # The events' own span, then any bounds.
    assert scanned(region, len(head), len(head) + len(body), prefix, suffix) == reference(
        region, len(head), len(head) + len(body), prefix, suffix
    )
    n = len(region)
    start = start if start < 2 else start % (n + 3)
    end = end if end < 2 else end % (n + 3)
    if clip and 0 <= end <= n:
        region = region[:end]
    assert scanned(region, start, end, prefix, suffix) == reference(
        region, start, end, prefix, suffix
    )


@built
def test_the_scanners_arguments_are_checked() -> None:
    assert NATIVE is not None
    region = PREFIX + b"x" + SUFFIX
    n = len(region)

    class Bytes(bytes):
        pass

    for args, error in (
        ((region, 0, 2**63, PREFIX, SUFFIX), OverflowError),
        ((region, -(2**63) - 1, n, PREFIX, SUFFIX), OverflowError),
        ((region, 0, 2**63 - 1, PREFIX, SUFFIX), ValueError),
        ((region, -(2**63), n, PREFIX, SUFFIX), ValueError),
        ((region, -1, n, PREFIX, SUFFIX), ValueError),
        ((region, 0.0, n, PREFIX, SUFFIX), TypeError),
        ((region, None, n, PREFIX, SUFFIX), TypeError),
        ((Bytes(region), 0, n, PREFIX, SUFFIX), TypeError),
        ((region, 0, n, Bytes(PREFIX), SUFFIX), TypeError),
        ((region, 0, n, PREFIX, Bytes(SUFFIX)), TypeError),
        ((memoryview(region), 0, n, PREFIX, SUFFIX), TypeError),
        ((region.decode(), 0, n, PREFIX, SUFFIX), TypeError),
        ((region, 0, n, b"", SUFFIX), ValueError),  # an empty prefix
        ((region, 0, n, PREFIX, b""), ValueError),  # an empty suffix
        ((region, 0, n, PREFIX, b"\n"), ValueError),
        ((region, 0, n, PREFIX, b"\nx\n\n"), ValueError),
        ((region, 0, n, PREFIX), TypeError),
        ((region, 0, n, PREFIX, SUFFIX, 0), TypeError),
    ):
        with pytest.raises(error):
            NATIVE(*args)
    assert NATIVE(region, n, n, PREFIX, SUFFIX) == (0, b"", 0)  # a run of no events
    assert NATIVE(b"", 0, 0, PREFIX, SUFFIX) == (0, b"", 0)
    assert NATIVE(region, 0, n, PREFIX, SUFFIX[-2:]) is None  # `x"}…`: a bare quote
    assert NATIVE(b"d:x}\n\n", 0, 6, b"d:", b"\n\n") == (1, b"x}", 0)  # the least suffix
    assert NATIVE(region, True, n, PREFIX, SUFFIX) is None  # a bool is an int


@built
@pytest.mark.parametrize("atom", [b"x", b"\\u00e9", b"\\n", b"\\\\", b'\\"', "日".encode(), b"\\"])
def test_long_literals_grow_the_copy_several_times(atom: bytes) -> None:
    """The joined literals start in 4 KiB and double (`_PyBytes_Resize`): a
    few literals of ~100 KiB and one past 1 MiB, both scanners the same."""
    literals = [atom * (100_000 // len(atom)), b"", atom * 7, atom * (1_100_000 // len(atom))]
    region = b"".join(PREFIX + lit + SUFFIX for lit in literals)
    native, pure = pair()
    got, want = native.cut(region), pure.cut(region)
    assert fields(got) == fields(want)
    if atom != b"\\":
        assert want is not None and want.raw == b"".join(literals) and want.empties == 1
    else:
        assert want is None  # an escape cut off by the suffix


CUT_EVENT = st.one_of(
    ATTACK.map(lambda lit: PREFIX + lit + SUFFIX),
    ATTACK.map(lambda lit: PREFIX + lit + SUFFIX),
    ATTACK.map(lambda lit: PREFIX + PREFIX + lit + SUFFIX),  # the prefix twice
    ATTACK.map(lambda lit: PREFIX + lit + SUFFIX[:-1]),  # no blank line
    ATTACK.map(lambda lit: PREFIX + lit + SUFFIX[:-2] + b"\r\n\r\n"),  # CRLF
    ATTACK.map(lambda lit: PREFIX + lit + SUFFIX + b"\n"),  # an extra blank line
    st.just(PREFIX + SUFFIX),
    st.just(b"data: [DONE]\n\n"),
)


@built
@settings(max_examples=200, deadline=None)
@given(
    st.lists(CUT_EVENT, max_size=40),
    st.binary(max_size=12),
    st.binary(max_size=12),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
def test_both_scanners_agree_on_regions_cut_anywhere(
    events: list[bytes], head: bytes, tail: bytes, a: int, b: int
) -> None:
    """CRLF, bare CR, a repeated prefix, the suffix inside a literal, extra
    blank lines, events split at any byte (the region a slice of a burst)."""
    region = head + b"".join([PREFIX + b"pad" + SUFFIX] * 12 + events) + tail
    a, b = sorted((a % (len(region) + 1), b % (len(region) + 1)))
    for piece in (region, region[a:], region[:b], region[a:b]):
        native, pure = pair()
        got, want = native.cut(piece), pure.cut(piece)
        assert fields(got) == fields(want)
        if want is not None:
            assert b"\n" not in want.raw


@built
@pytest.mark.parametrize("envelope", ENVELOPES, ids=range(len(ENVELOPES)))
def test_the_scanner_keeps_its_contract_at_every_edge(envelope: tuple[bytes, bytes]) -> None:
    """Every end (and every start, or each event's edges ±1), the region
    clipped at the end or not: a suffix read one byte past `end`, an event
    whose suffix overlaps its prefix (no room for the literal), an escape cut
    by a suffix that reads as its hex digits."""
    prefix, suffix = envelope
    events = [
        prefix + b"q" + suffix,
        prefix + suffix,
        *(prefix + suffix[k:] for k in range(1, len(suffix) - 1)),  # overlapping
        prefix + b"\\u000" + suffix,
        prefix + b"\\" + suffix,
    ]
    region = b"".join(events)
    n = len(region)
    edges, at = {-1, 0, 1}, 0
    for event in events:
        at += len(event)
        edges |= {at - 1, at, at + 1}
    every = range(-1, n + 2) if n <= 120 else sorted(edges)  # the long envelope: its edges
    for start in every:
        for end in every:
            want = reference(region, start, end, prefix, suffix)
            assert scanned(region, start, end, prefix, suffix) == want, (start, end)
            if 0 <= end < n:
                clipped = region[:end]
                want = reference(clipped, start, end, prefix, suffix)
                assert scanned(clipped, start, end, prefix, suffix) == want, (start, end)


# Upstream events of any shape, for the envelope the scanners learn: content
# chunks behind or before other `data:`/comment/field lines, pieces of them.
LINES = [
    b'data: {"choices":[{"index":0,"x":1}]}\n',
    b'data: {"z":1}\n',
    b": c\n",
    b"event: e\n",
    b"\n",
]
UPSTREAM_EVENT = st.one_of(
    st.builds(
        lambda before, lit, end: before + PREFIX + lit + SUFFIX[:-2] + end,
        st.lists(st.sampled_from(LINES), max_size=2).map(b"".join),
        st.sampled_from([b"a", b"", b"\\u00e9", b'"']),
        st.sampled_from([b"\n\n", b"\n" + LINES[0] + b"\n", b"\n" + LINES[1] + b"\n", b"\n"]),
    ),
    st.lists(
        st.sampled_from([PREFIX, SUFFIX, b"tok", b'"}', b"\n", *LINES, b"data: {", b"}\n\n"]),
        max_size=8,
    ).map(b"".join),
    st.just(PREFIX + b"x" + SUFFIX),
)


@built
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(UPSTREAM_EVENT, max_size=12), st.integers(1, 40)),
        min_size=1,
        max_size=4,
    )
)
def test_both_scanners_learn_and_cut_any_stream_alike(reads: list[tuple[list[bytes], int]]) -> None:
    """Reads of any upstream events, repeated into bursts: the same envelope
    learnt (or none), the same runs, and no exception from either."""
    native, pure = ChunkRuns(NATIVE), ChunkRuns(None)
    for events, times in reads:
        region = b"".join(events) * times
        assert fields(native.cut(region)) == fields(pure.cut(region))
        assert (native._prefix, native._suffix) == (pure._prefix, pure._suffix)
