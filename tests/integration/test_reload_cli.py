"""`brownout reload` against a running proxy, and against things that are not
one: the exit code and the lines an operator reads for each answer."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Thread

import pytest

from proxy.cli import main
from proxy.policy import load_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port

ROOT = Path(__file__).resolve().parents[2]


def write_policy(path: Path, upstream: str, extra: str = "", token: str = "s3cret") -> None:
    path.write_text(
        f"server:\n  admin_token: '{token}'\n  heartbeat_s: 0.3\n{extra}"
        f"backends:\n  primary:\n    url: {upstream}\n"
    )


async def reload_cli(url: str, token: str) -> tuple[int, str, str]:
    """`brownout reload` in its own process (the proxy logs to this one's stdout)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy.cli",
        "reload",
        "--url",
        url,
        "--token",
        token,
        "--timeout",
        "5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_reload_cli_exit_codes_against_a_running_proxy(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, fake_upstream.url)
    proxy = await start_proxy(load_policy(path))

    # A restart-only knob: listed, not applied, exit 0.
    write_policy(path, fake_upstream.url, "  port: 9999\n  log_level: debug\n")
    rc, out, err = await reload_cli(proxy.url, "s3cret")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "reloaded: no changes",
        "needs restart:",
        "  ~ server.log_level: 'info' -> 'debug'  (needs restart)",
        "  ~ server.port: 8080 -> 9999  (needs restart)",
    ]
    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        st = await resp.json()
    assert st["policy"]["last_reload"]["changes"] == []

    # A broken policy: exit 1 (rejected, documented), the FILE:LINE lines as they are.
    # It used to exit 3 ("unreachable or refused") with the errors in one line.
    path.write_text(path.read_text().replace("heartbeat_s: 0.3", "heartbeat_s: soon"))
    rc, out, err = await reload_cli(proxy.url, "s3cret")
    assert (rc, out) == (1, "")
    assert err.splitlines() == [
        "brownout reload: rejected, the running policy is unchanged:",
        f"{path}:3: server.heartbeat_s: expected a number, got 'soon'",
    ]

    # The wrong token: refused, exit 3.
    rc, out, err = await reload_cli(proxy.url, "nope")
    assert (rc, out) == (3, "")
    assert err.startswith("brownout reload: HTTP 401: ")


async def test_reload_cli_with_admin_disabled(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, fake_upstream.url, token="")
    proxy = await start_proxy(load_policy(path))
    rc, out, err = await reload_cli(proxy.url, "s3cret")
    assert (rc, out) == (3, "")
    assert err.startswith("brownout reload: HTTP 403: admin endpoints are disabled")


@contextmanager
def fake_server(answer: bytes) -> Iterator[str]:
    """A TCP server that answers every connection with `answer`, then closes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    thread = Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        thread.join(timeout=2)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"ok"', "IncompleteRead"),
        (b"-ERR unknown command\r\n", "BadStatusLine"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", "with unexpected JSON"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n<html>hi", "without JSON"),
        (
            b'HTTP/1.1 200 OK\r\nContent-Length: 24\r\n\r\n{"ok": true, "changes": 7}'[:24],
            "without JSON",
        ),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"ok": "yes"}', "not a reload answer"),
        (
            b'HTTP/1.1 200 OK\r\nContent-Length: 26\r\n\r\n{"ok": true, "changes": 7}',
            "not a reload answer",
        ),
    ],
)
def test_reload_cli_against_something_that_is_not_a_proxy(
    answer: bytes, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_server(answer) as url:
        rc = main(["reload", "--url", url, "--token", "t", "--timeout", "5"])
    out = capsys.readouterr()
    assert (rc, out.out) == (3, "")
    assert out.err.startswith("brownout reload: ") and problem in out.err, out.err


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:notaport"])
def test_reload_cli_with_a_bad_url(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["reload", "--url", url, "--timeout", "2"])
    out = capsys.readouterr()
    assert rc == 3
    assert out.err.startswith(f"brownout reload: cannot reach {url}: "), out.err


def test_reload_cli_against_a_proxy_that_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["reload", "--url", url, "--timeout", "2"]) == 3
    assert capsys.readouterr().err.startswith(f"brownout reload: cannot reach {url}: ")
