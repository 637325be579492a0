"""The log writer: a bounded queue drained by a thread, drops counted."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import threading

import structlog

from proxy.telemetry.logs import LineWriter, configure_logging, current_writer, lines_dropped


class Recorder(io.RawIOBase):
    """A file that records each write; `gate` (when set) holds writes back."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.gate: threading.Event | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        if self.gate is not None:
            self.gate.wait()
        data = bytes(b)  # type: ignore[call-overload]
        self.writes.append(data)
        return len(data)

    def lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in b"".join(self.writes).splitlines()]


def test_lines_outside_a_loop_are_written_in_order() -> None:
    rec = Recorder()
    w = LineWriter(rec)  # type: ignore[arg-type]
    for i in range(50):
        w.msg(json.dumps({"event": "x", "i": i}).encode())
    assert w.flush(5)
    assert [e["i"] for e in rec.lines()] == list(range(50))
    assert w.close()


def test_one_loop_iteration_is_handed_over_as_one_chunk() -> None:
    rec = Recorder()
    w = LineWriter(rec)  # type: ignore[arg-type]

    async def burst() -> None:
        for i in range(100):
            w.msg(b'{"event":"x","i":%d}' % i)
        await asyncio.sleep(0)

    asyncio.run(burst())
    assert w.flush(5)
    assert len(rec.writes) == 1
    assert len(rec.lines()) == 100
    w.close()


def test_a_full_queue_drops_and_counts_then_says_so() -> None:
    rec = Recorder()
    rec.gate = threading.Event()  # the reader stalls
    w = LineWriter(rec, max_bytes=1000)  # type: ignore[arg-type]
    line = b'{"event":"x","pad":"' + b"p" * 80 + b'"}'
    for _ in range(100):
        w.msg(line)  # never blocks
    assert 0 < w.dropped < 100
    assert not w.flush(0.05)  # the reader is still stalled
    rec.gate.set()
    assert w.flush(5)
    w.msg(b'{"event":"after"}')
    assert w.flush(5)
    events = [e["event"] for e in rec.lines()]
    assert events.count("x") + w.dropped == 100
    assert {"event": "log_lines_dropped", "count": w.dropped} in [
        {k: e[k] for k in ("event", "count")} for e in rec.lines() if "count" in e
    ]
    assert events[-1] == "after"
    w.close()


def test_close_is_bounded_when_the_reader_never_comes_back() -> None:
    r, wfd = os.pipe()
    os.set_blocking(wfd, False)
    try:
        while True:
            os.write(wfd, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(wfd, True)
    f = open(wfd, "wb", buffering=0)  # noqa: SIM115
    w = LineWriter(f)
    w.msg(b'{"event":"stuck"}')
    assert w.close(timeout=0.1) is False  # gave up instead of hanging
    w.msg(b'{"event":"late"}')
    assert w.dropped == 1
    os.close(r)  # the blocked write fails (EPIPE) and the thread ends
    f.close()


def test_configure_logging_routes_structlog_and_stdlib_and_exports_drops() -> None:
    rec = Recorder()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        w = configure_logging("info", rec, cache_loggers=False)  # type: ignore[arg-type]
        assert current_writer() is w
        structlog.get_logger("brownout").info("hello", n=1)
        logging.getLogger("aiohttp.server").error("Error handling request")
        assert w.flush(5)
        lines = rec.lines()
        assert lines[0]["event"] == "hello" and lines[0]["n"] == 1
        assert {k: lines[1][k] for k in ("event", "logger", "level")} == {
            "event": "Error handling request",
            "logger": "aiohttp.server",
            "level": "error",
        }
        w.dropped = 7
        assert lines_dropped() == 7
        again = configure_logging("info", rec, cache_loggers=False)  # type: ignore[arg-type]
        assert current_writer() is again
        assert sum(isinstance(h, type(root.handlers[-1])) for h in root.handlers) == 1
    finally:
        writer = current_writer()
        if writer is not None:
            writer.close()
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)


def test_json_line_renders_what_structlogs_chain_renders() -> None:
    # JsonLine is merge_contextvars → add_log_level → timestamp →
    # format_exc_info → JSONRenderer(orjson) as one processor: same keys,
    # same order, same values (the timestamp aside).
    import orjson

    from proxy.telemetry.logs import IsoStamper, JsonLine

    chain = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        IsoStamper(),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(serializer=orjson.dumps),
    ]

    def old(name: str, event: dict[str, object]) -> bytes:
        out: object = dict(event)
        for proc in chain:
            out = proc(None, name, out)  # type: ignore[arg-type]
        assert isinstance(out, bytes)
        return out

    def strip(line: bytes) -> list[tuple[str, object]]:
        return [(k, v) for k, v in json.loads(line).items() if k != "timestamp"]

    structlog.contextvars.bind_contextvars(request_id="r1")
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            events = [
                ("info", {"event": "request", "status": 200, "x": {1, 2}, "e": ValueError("v")}),
                ("warn", {"event": "w", "request_id": "own"}),
                ("exception", {"event": "x", "exc_info": True}),
            ]
            for name, event in events:
                assert strip(JsonLine()(None, name, dict(event))) == strip(old(name, event))
    finally:
        structlog.contextvars.clear_contextvars()
