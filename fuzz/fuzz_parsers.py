"""Coverage-guided fuzzing of the request parser and the SSE framing/parsing
(`make fuzz`; atheris). Any exception other than the documented rejections is
a crash. Run: .venv/bin/python fuzz/fuzz_parsers.py -max_total_time=60"""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from proxy.errors import RequestRejected
    from proxy.guard.core import Guard, GuardPolicy, Trip
    from proxy.openai.sse import SSEFramer, SSEParser
    from proxy.ingress.validate import parse_body

GUARD = Guard(GuardPolicy())


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    endpoint = "chat" if fdp.ConsumeBool() else "completions"
    body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
    with contextlib.suppress(RequestRejected):
        parse_body(body, endpoint)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    parser, framer, guard = SSEParser(), SSEFramer(), GUARD.stream()
    step = 1 + (len(stream) % 7)
    for i in range(0, len(stream), step):
        parser.feed(stream[i : i + step])
        region = framer.feed(stream[i : i + step])
        if region and isinstance(guard.feed(region), Trip):
            break
    parser.flush()
    tail = framer.flush()
    if tail:
        guard.feed_final(tail)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
