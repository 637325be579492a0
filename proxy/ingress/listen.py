"""The listening socket, with a deadline on request headers (slow-loris).

aiohttp has no header-read timeout: a client sending a header byte every few
seconds holds its connection (and a file descriptor) until the keep-alive
timer, 75 s, however many connections it opens. Here each connection's
protocol is wrapped: the headers of a request must be complete within
`server.header_timeout_s` of the request's first byte (hyper's rule), or the
connection is closed. An idle keep-alive connection (no byte of a next
request yet) is left to aiohttp's keep-alive timeout, so nginx's upstream
keep-alive pool is not cut.

"Headers complete" is observed where it is certain: the request reached the
app (`request_started`, called by the request-context middleware); bytes
that arrive while a request is being handled, or until its body has been
read to the end, are its body.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.errors import error_response
from proxy.runtime.generation import request_id

log = structlog.get_logger("brownout.request")

TimeoutSource = Callable[[], float]


class HeaderDeadline(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection; forwards every event."""

    __slots__ = ("_busy", "_handle", "_inner", "_loop", "_on_timeout", "_timeout", "_transport")

    def __init__(
        self,
        inner: RequestHandler,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        on_timeout: Callable[[], None],
    ) -> None:
        self._inner = inner
        self._loop = loop
        self._timeout = timeout_s
        self._on_timeout = on_timeout
        self._handle: asyncio.TimerHandle | None = None
        self._busy = False
        self._transport: asyncio.BaseTransport | None = None

    # -- asyncio.Protocol, forwarded -------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if (
            not self._busy
            and self._handle is None
            and self._timeout > 0
            and data.find(b"\r\n\r\n") < 0  # `find`: see proxy.openai.chunks
        ):
            # The first bytes of a request's head, and not all of it (the
            # common case, a whole head in one read, needs no timer): its
            # deadline starts.
            self._handle = self._loop.call_later(self._timeout, self._expire)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        self._inner.eof_received()
        return None  # aiohttp's protocol never keeps a half-closed connection open

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- the deadline ----------------------------------------------------------

    def started(self) -> None:
        self._busy = True
        self._cancel()

    def finished(self) -> None:
        self._busy = False

    def _cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        if self._busy or self._transport is None:
            return
        self._on_timeout()
        self._transport.close()


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's protocol, answering what it refuses before the app runs (a
    request line over 8 KiB, a `Content-Encoding` its parser cannot undo, a
    malformed head) with an OpenAI error object instead of plain text.

    A refused head is the client's fault, not a bug: it gets one
    warning-level line (`request_rejected`, with the parser's `error` and
    the first line of its message), not aiohttp's `Error handling request`
    with a traceback on the `aiohttp.server` logger. A 500 (a handler that
    raised around the middleware: a bug) keeps aiohttp's logging."""

    __slots__ = ()
    # Set on the per-site subclass (see `GuardedSite.start`): counts the refusal.
    on_refused: Callable[[int, str], None] = staticmethod(lambda status, code: None)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # aiohttp's own: logs with the traceback, and raises when a
            # response was already begun.
            super().handle_error(request, status, exc, message)
            text, type_, code = "internal error", "server_error", "internal_error"
        else:
            if request.writer.output_size > 0:
                # Some of a response went out: only closing the connection says so.
                raise ConnectionError("a response was already begun")
            text = message or HTTPStatus(status).phrase
            type_, code = "invalid_request_error", "bad_request"
        self.on_refused(status, code)
        rid = request_id(request.headers.get("X-Request-Id"))
        # The one line of a request the app never saw (its middlewares
        # log `request_rejected` for everything they refuse).
        fields = refusal_fields(exc, message) if status < 500 else {}
        (log.warning if status < 500 else log.info)(
            "request_rejected",
            request_id=rid,
            status=status,
            reason=code,
            method=request.method,
            **fields,
        )
        resp = error_response(status, text, type_=type_, code=code, headers={"X-Request-Id": rid})
        resp.force_close()
        return resp


# How much of the parser's message a log line keeps.
_DETAIL_CHARS = 200


def refusal_fields(exc: BaseException | None, message: str | None) -> dict[str, str]:
    """The log fields of a head the parser refused: the exception's class and
    the first line of its message (which names the problem; the lines after
    it quote the client's bytes, escaped by aiohttp), at most 200 characters."""
    text = message or getattr(exc, "message", None) or (str(exc) if exc is not None else "")
    first = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    detail = first.rstrip(":")
    out = {"detail": ascii(detail[:_DETAIL_CHARS])[1:-1]}
    if exc is not None:
        out["error"] = type(exc).__name__
    return out


def _deadline_of(request: web.BaseRequest) -> HeaderDeadline | None:
    transport = request.transport
    if transport is None:
        return None
    protocol = transport.get_protocol()
    return protocol if isinstance(protocol, HeaderDeadline) else None


def request_started(request: web.BaseRequest) -> HeaderDeadline | None:
    """The request reached the app: its head is complete. Returns the
    connection's deadline, for `request_finished`."""
    d = _deadline_of(request)
    if d is not None:
        d.started()
    return d


def request_finished(request: web.BaseRequest, d: HeaderDeadline | None) -> None:
    if d is None:
        return
    if request.content.is_eof():
        d.finished()
    else:
        # Answered before its body was read (a 405, a 413): the rest of the
        # body still arrives (aiohttp drains it) and is no next request's head.
        request.content.on_eof(d.finished)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections have the header deadline. The timeout is
    read per connection, so a policy reload changes it for new connections."""

    __slots__ = ("_handler", "_host", "_on_timeout", "_port", "_timeout")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        header_timeout_s: TimeoutSource,
        on_timeout: Callable[[], None] = lambda: None,
        on_refused: Callable[[int, str], None] = lambda status, code: None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._timeout = header_timeout_s
        self._on_timeout = on_timeout
        # The protocol class of this site's connections: aiohttp's, answering
        # its parser's refusals with an OpenAI error and counting them.
        self._handler = type(
            "OpenAIErrorHandler",
            (OpenAIErrorHandler,),
            {"__slots__": (), "on_refused": staticmethod(on_refused)},
        )

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        handler = self._handler

        def protocol() -> asyncio.Protocol:
            inner = server()
            inner.__class__ = handler  # same layout: no slots added
            return HeaderDeadline(inner, loop, self._timeout(), self._on_timeout)

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
        sock: socket.socket = self._server.sockets[0]
        self._port = sock.getsockname()[1]
