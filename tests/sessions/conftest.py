"""Fixtures: the shared Redis (with a per-test key prefix) and private redis-servers.

The shared server on 127.0.0.1:6379 has other users: every test writes under
its own `brownout-test:{uuid}:` prefix and deletes it afterwards. Fault tests
get a private `redis-server` they may stop, pause and restart.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.harness.procs import free_port

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_answers(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def key_prefix() -> str:
    return f"brownout-test:{uuid.uuid4().hex}:"


@pytest.fixture
async def shared_redis(key_prefix: str) -> AsyncIterator[aioredis.Redis]:
    """A raw client on the shared Redis; deletes every key under `key_prefix` at the end."""
    if not _redis_answers(6379):
        pytest.skip("no Redis on 127.0.0.1:6379")
    client = aioredis.Redis.from_url(SHARED_REDIS_URL, decode_responses=True)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{key_prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


class PrivateRedis:
    """A throw-away redis-server on its own port: no persistence, restartable."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                str(self.workdir),
                # Lets a fault test point `dir` at an unwritable place (MISCONF).
                "--enable-protected-configs",
                "local",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while not _redis_answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGCONT)  # in case a test paused it
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
