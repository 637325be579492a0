"""Logging never blocks the loop: the proxy keeps serving while nobody reads stderr."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import IO

import pytest
import structlog
from aiohttp import web

from proxy.telemetry.logs import configure_logging, current_writer
from tests.integration.conftest import CHAT_BODY, FakeUpstream, ProxyFactory, make_policy

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
}


class StalledPipe:
    """A real pipe whose buffer is full: every write to it blocks until
    `drain()` starts reading."""

    def __init__(self) -> None:
        self.r, w = os.pipe()
        flags = fcntl.fcntl(w, fcntl.F_GETFL)
        fcntl.fcntl(w, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self.filler = 0
        try:
            while True:
                self.filler += os.write(w, b"x" * 4096)
        except BlockingIOError:
            pass
        fcntl.fcntl(w, fcntl.F_SETFL, flags)  # blocking again, like stderr
        self.file: IO[bytes] = open(w, "wb", buffering=0)  # noqa: SIM115
        self.data = bytearray()
        self._reader: threading.Thread | None = None

    def drain(self) -> None:
        def read() -> None:
            while chunk := os.read(self.r, 65536):
                self.data += chunk

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def close(self) -> list[dict[str, object]]:
        """Close the write end; the JSON lines that came after the filler."""
        self.file.close()
        if self._reader is not None:
            self._reader.join(5)
        os.close(self.r)
        out = bytes(self.data[self.filler :])
        return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def stalled() -> Iterator[StalledPipe]:
    pipe = StalledPipe()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield pipe
    if pipe._reader is None:
        pipe.drain()  # unblock the writer thread whatever happened
    writer = current_writer()
    if writer is not None:
        writer.close()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    if not pipe.file.closed:
        pipe.close()


@pytest.mark.timeout(60)
async def test_a_stalled_stderr_reader_does_not_freeze_serving(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, stalled: StalledPipe
) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        return web.json_response(ANSWER)

    fake_upstream.handlers["/v1/chat/completions"] = chat
    writer = configure_logging("info", stalled.file, max_bytes=16 * 1024, cache_loggers=False)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    body = {**CHAT_BODY, "stream": False}
    for _ in range(200):  # one `request` log line each, and nobody reads them
        async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"] == "ok"
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    dropped = writer.dropped
    assert dropped > 0
    assert f"brownout_log_lines_dropped_total {float(dropped)}" in text

    stalled.drain()  # the reader comes back: what waited is written, then the news
    assert writer.flush(timeout=10)
    assert writer.close()
    lines = stalled.close()
    assert sum(int(str(e["count"])) for e in lines if e["event"] == "log_lines_dropped") == dropped
    requests = [e for e in lines if e["event"] == "request"]
    assert requests and all(e["status"] == 200 for e in requests)
