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
