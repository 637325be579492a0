"""structlog set-up: one JSON object per line on stderr, never written on the loop.

One log line per request is on the hot path, so: orjson renders (~4x cheaper
than json + print), the ISO timestamp reuses its formatted second, and lines
logged while the event loop runs are gathered per loop iteration and handed
over as one chunk.

Writing happens on a writer thread, never on the event loop: a stalled stderr
reader (a full pipe, a paused terminal, a wedged log shipper) must not freeze
serving. The hand-over queue is bounded (`max_bytes`); what does not fit is
dropped and counted (`LineWriter.dropped`, exported as
`brownout_log_lines_dropped_total`), and once the reader resumes the writer
says how many lines were lost (a `log_lines_dropped` line). What is queued is
flushed at exit (with a bound: a reader that never resumes cannot hold the
process). aiohttp's own stdlib loggers go through the same writer.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextvars
import logging
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import IO, Any

import orjson
import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
DEFAULT_MAX_BYTES = 4 << 20  # queued log output beyond this is dropped
EXIT_FLUSH_S = 2.0
# How long the writer lets lines gather after a wake-up: each wake-up makes
# the loop thread hand over the GIL (a few times: the wake, the write, the
# next wait), and on a busy machine the loop thread then waits to be
# scheduled again. 250 ms: at most 4 wake-ups a second (50 ms gave 20, 5 ms
# three times the futex calls per request again). A line logged off the loop
# waits for its write, so it cuts the wait short (`_hurry`).
COALESCE_S = 0.25
OFF_LOOP_WAIT_S = 1.0  # how long a line logged off the loop waits to be written


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class IsoStamper:
    """`timestamp` as `2026-11-30T16:59:00.123456Z` (structlog's iso/utc format)."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(
        self, _logger: Any, _name: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        t = time.time()
        second = int(t)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event["timestamp"] = f"{self._prefix}.{int((t - second) * 1e6):06d}Z"
        return event


_PREFIX = structlog.contextvars.STRUCTLOG_KEY_PREFIX
_PREFIX_LEN = len(_PREFIX)
_LEVEL_OF = {"warn": "warning", "exception": "error"}  # structlog's add_log_level


def _fallback(obj: Any) -> Any:
    """What structlog's JSONRenderer writes for a value JSON has no type for."""
    hook = getattr(obj, "__structlog__", None)
    return hook() if callable(hook) else repr(obj)


class JsonLine:
    """structlog's merge_contextvars → add_log_level → timestamp →
    format_exc_info → JSONRenderer(orjson), as one processor: the same line,
    for a third less of the cost of the five calls (one log line per request
    is on the hot path)."""

    __slots__ = ("_stamp",)

    def __init__(self) -> None:
        self._stamp = IsoStamper()

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> bytes:
        ctx = contextvars.copy_context()
        for var in ctx:
            if var.name.startswith(_PREFIX):
                value = ctx[var]
                if value is not Ellipsis:
                    event.setdefault(var.name[_PREFIX_LEN:], value)
        event["level"] = _LEVEL_OF.get(name, name)
        self._stamp(logger, name, event)
        if "exc_info" in event:
            event = structlog.processors.format_exc_info(logger, name, event)
        return orjson.dumps(event, default=_fallback)


def _wrapper_class(min_level: int) -> type[Any]:
    """structlog's filtering bound logger, with an `info` that runs the
    configured `JsonLine` chain itself (the access line, once per request):
    the same line, without the three generic calls around one processor.
    Any other chain (tests' `capture_logs` swap it in place) takes structlog's
    own path."""
    base: type[Any] = structlog.make_filtering_bound_logger(min_level)
    if min_level > logging.INFO:
        return base
    generic = base.info

    def info(self: Any, event: str, *args: Any, **kw: Any) -> Any:
        procs = self._processors
        if args or len(procs) != 1 or type(procs[0]) is not JsonLine:
            return generic(self, event, *args, **kw)
        event_dict = self._context.copy()
        event_dict.update(kw)
        event_dict["event"] = event
        return self._logger.info(procs[0](self._logger, "info", event_dict))

    return type("BoundLogger", (base,), {"info": info, "__slots__": ()})


class LineWriter:
    """A structlog logger: rendered lines → bounded queue → writer thread → file."""

    def __init__(self, file: IO[bytes], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._file = file
        self._max = max_bytes
        self._lines: list[bytes] = []  # this loop iteration's lines
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._drained = threading.Condition(self._lock)
        self._hurry = threading.Condition(self._lock)  # an off-loop line waits
        self._urgent = False
        self._queue: collections.deque[tuple[bytes, int]] = collections.deque()
        self._queued_bytes = 0
        self._writing = False
        self._closing = False
        self._stalled = False  # an off-loop wait timed out; cleared by the next write
        self.dropped = 0  # lines lost to a full queue, ever
        self._reported = 0  # of those, already announced in a log line
        self._thread = threading.Thread(target=self._run, name="brownout-log-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- producer side (any thread; the event loop's hot path) --------------------

    def msg(self, message: bytes) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # Off the loop (start-up, CLI, a worker thread): wait, briefly, for
            # the line to be written, so it keeps its place among other output.
            self._put(message + b"\n", 1, urgent=True)
            if not self._stalled:
                self._stalled = not self._wait(OFF_LOOP_WAIT_S)
            return
        lines = self._lines
        lines.append(message)
        if len(lines) == 1:
            loop.call_soon(self._hand_over)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg

    def _hand_over(self) -> None:
        lines = self._lines
        if lines:
            self._lines = []
            lines.append(b"")
            self._put(b"\n".join(lines), len(lines) - 1)

    def _put(self, data: bytes, n: int, urgent: bool = False) -> None:
        with self._lock:
            if self._queued_bytes + len(data) > self._max or self._closing:
                self.dropped += n
                return
            if not self._queue:
                self._work.notify()
            if urgent:
                self._urgent = True
                self._hurry.notify()
            self._queue.append((data, n))
            self._queued_bytes += len(data)

    # -- the writer thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._work.wait()
                if not self._queue:
                    return
                # Let lines gather: one wake-up and one write carry them
                # all, so the loop thread rarely yields the GIL (a flush or
                # a line logged off the loop does not wait).
                if not self._urgent:
                    self._hurry.wait(COALESCE_S)
                self._urgent = False
                chunks = [c for c, _ in self._queue]
                self._queue.clear()
                self._queued_bytes = 0
                self._writing = True
                lost, self._reported = self.dropped - self._reported, self.dropped
            if lost:
                chunks.append(self._drop_line(lost))
            try:
                self._file.write(b"".join(chunks))
                self._file.flush()
            except (OSError, ValueError):  # stderr closed: nowhere to write
                pass
            with self._lock:
                self._writing = False
                self._stalled = False
                self._drained.notify_all()

    @staticmethod
    def _drop_line(n: int) -> bytes:
        event = {"count": n, "event": "log_lines_dropped", "level": "warning"}
        event["timestamp"] = _iso(time.time())
        return orjson.dumps(event) + b"\n"

    # -- flush and close ----------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Hand over this iteration's lines and wait until all are written.
        False when the reader did not take them within `timeout`."""
        self._hand_over()
        with self._lock:
            if self._queue:
                self._urgent = True
                self._hurry.notify()
        return self._wait(timeout)

    def _wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._drained.wait(left)
        return True

    def close(self, timeout: float = EXIT_FLUSH_S) -> bool:
        """Flush (for at most `timeout`), then stop the thread; later lines are dropped."""
        done = self.flush(timeout)
        with self._lock:
            self._closing = True
            self._urgent = True
            self._work.notify()
            self._hurry.notify()
        if done:
            self._thread.join(timeout)
        atexit.unregister(self.close)
        return done


class _StdlibHandler(logging.Handler):
    """aiohttp's (stdlib) log records as JSON lines through the same writer."""

    def __init__(self, writer: LineWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        event: dict[str, Any] = {
            "event": record.getMessage(),
            "logger": record.name,
            "level": record.levelname.lower(),
            "timestamp": _iso(record.created),
        }
        if record.exc_info:
            event["exception"] = logging.Formatter().formatException(record.exc_info)
        self.writer.msg(orjson.dumps(event, default=str))


def current_writer() -> LineWriter | None:
    """The writer `configure_logging` installed (structlog's config is per process)."""
    factory = structlog.get_config().get("logger_factory")
    writer = getattr(factory, "writer", None)
    return writer if isinstance(writer, LineWriter) else None


def lines_dropped() -> int:
    writer = current_writer()
    return writer.dropped if writer is not None else 0


class _Factory:
    def __init__(self, writer: LineWriter) -> None:
        self.writer = writer

    def __call__(self, *_args: Any) -> LineWriter:
        return self.writer


def configure_logging(
    level: str = "info",
    file: IO[bytes] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    cache_loggers: bool = True,
) -> LineWriter:
    """Log JSON lines to `file` (stderr) through a new writer; the previous
    one is flushed and closed. `cache_loggers=False` lets a later
    configuration reach loggers already used (tests)."""
    previous = current_writer()
    if previous is not None:
        previous.close()
    writer = LineWriter(sys.stderr.buffer if file is None else file, max_bytes)
    structlog.configure(
        processors=[JsonLine()],
        wrapper_class=_wrapper_class(_LEVELS[level]),
        logger_factory=_Factory(writer),
        cache_logger_on_first_use=cache_loggers,
    )
    # aiohttp's own loggers (errors in handlers; the access log is off).
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _StdlibHandler)]:
        root.removeHandler(h)
    root.addHandler(_StdlibHandler(writer))
    root.setLevel(_LEVELS[level])
    return writer
