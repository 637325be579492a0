"""Property-based fuzzing (the short version of `make fuzz`): no input crashes
the request parser, the SSE parser/framer or the guard."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import RequestRejected
from proxy.guard.core import Guard, Trip
from proxy.ingress.validate import parse_body
from proxy.openai.sse import SSEFramer, SSEParser
from proxy.policy import GuardPolicy

GUARD = Guard(GuardPolicy())

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"messages": st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values))},
        optional={"stream": json_values, "model": json_values, "max_tokens": json_values},
    ).map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=400, deadline=None)
@given(body=bodies, chat=st.booleans())
def test_request_parser_rejects_cleanly(body: bytes, chat: bool) -> None:
    try:
        parsed = parse_body(body, "chat" if chat else "completions")
    except RequestRejected as rej:
        rejection = rej
    else:
        assert isinstance(parsed.body, dict)
        assert isinstance(parsed.stream, bool)
        return
    assert rejection.status in (400, 413)
    assert rejection.message


@settings(max_examples=400, deadline=None)
@given(
    stream=st.one_of(
        st.binary(max_size=2048),
        st.lists(
            st.sampled_from(
                [
                    b"data: ",
                    b"{",
                    b"}",
                    b'"content":"',
                    b"\\u0000",
                    b"\n",
                    b"\r",
                    b"\r\n",
                    b": ping",
                    b"[DONE]",
                    b'"choices":[{"index":0,',
                    b"\xff",
                    b"\xef\xbf\xbd",
                    b"<|im_start|>",
                    b"event: x",
                    b'"finish_reason":"stop"',
                ]
            ),
            max_size=60,
        ).map(b"".join),
    ),
    step=st.integers(min_value=1, max_value=64),
)
def test_sse_parser_framer_and_guard_never_crash(stream: bytes, step: int) -> None:
    parser, framer, guard = SSEParser(), SSEFramer(), GUARD.stream()
    forwarded = b""
    tripped = False
    for i in range(0, len(stream), step):
        piece = stream[i : i + step]
        parser.feed(piece)
        region = framer.feed(piece)
        if region and not tripped:
            assert region.endswith(b"\n\n")
            v = guard.feed(region)
            tripped = isinstance(v, Trip)
            forwarded += region
    parser.flush()
    tail = framer.flush()
    if tail and not tripped:
        guard.feed_final(tail)
    # Bounded memory: nothing is held beyond the incomplete last event.
    assert framer.pending == 0
