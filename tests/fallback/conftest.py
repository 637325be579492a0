"""Fixtures: the real fallback server as a subprocess on the tiny model.

One session-wide server (`fallback_server`) serves most tests. It runs with
`--max-concurrency 1 --max-queue 1`, so capacity tests can fill it with two
long streams; those tests close their streams and wait until the gauges are
back to zero, leaving the server idle for the next test.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.procs import free_port, http_json, terminate_tree, wait_for_http

STARTUP_TIMEOUT_S = 90.0


@dataclass
class FallbackServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model_dir: Path
    served_model_name: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return http_json("POST", self.url + path, body)

    def metric(self, name: str, **labels: str) -> float:
        """One sample from /metrics (0.0 when the labelled series does not exist yet)."""
        status, text = http_json("GET", self.url + "/metrics")
        assert status == 200, text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    def wait_metric(self, name: str, value: float, *, timeout: float, **labels: str) -> float:
        """Seconds until `name` equals `value`; fails the test at `timeout`."""
        started = time.monotonic()
        while True:
            current = self.metric(name, **labels)
            if current == value:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                pytest.fail(f"{name} is {current}, not {value}, after {timeout} s")
            time.sleep(0.02)

    def thread_count(self) -> int:
        return len(list(Path(f"/proc/{self.proc.pid}/task").iterdir()))

    def openai(self) -> openai.OpenAI:
        # No retries: tests must see exactly what the server answered.
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


def start_server(model_dir: Path, log_path: Path, args: Sequence[str] = ()) -> FallbackServer:
    port = free_port()
    cmd = [
        sys.executable, "-m", "proxy.cli", "fallback-server",
        "--model", str(model_dir), "--port", str(port), *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    name = args[args.index("--served-model-name") + 1] if "--served-model-name" in args else None
    server = FallbackServer(proc, port, log_path, model_dir, name or model_dir.name)
    try:
        wait_for_http(
            server.url + "/health", timeout=STARTUP_TIMEOUT_S, alive=lambda: proc.poll() is None
        )
    except (TimeoutError, RuntimeError) as exc:
        stop_server(server)
        pytest.fail(f"fallback server did not start: {exc}\n{server.log_tail()}")
    return server


def stop_server(server: FallbackServer) -> None:
    terminate_tree(server.proc.pid, timeout=15.0, reap=server.proc.poll)
    server.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def fallback_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp("fallback") / "server.log"
    server = start_server(tiny_model_dir, log_path, ["--max-concurrency", "1", "--max-queue", "1"])
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def server(fallback_server: FallbackServer) -> Iterator[FallbackServer]:
    """The session server, checked idle before and after each test."""
    assert fallback_server.proc.poll() is None, fallback_server.log_tail()
    yield fallback_server
    fallback_server.wait_metric("vllm:num_requests_running", 0, timeout=10)
    fallback_server.wait_metric("vllm:num_requests_waiting", 0, timeout=10)


@pytest.fixture
def client(server: FallbackServer) -> Iterator[openai.OpenAI]:
    with server.openai() as c:
        yield c


class RawStream:
    """An SSE request over a bare HTTP connection, so a test can walk away mid-stream."""

    def __init__(self, server: FallbackServer, path: str, body: dict[str, Any]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        payload = json.dumps(body)
        self.conn.request("POST", path, payload, {"Content-Type": "application/json"})
        self._response: http.client.HTTPResponse | None = None

    @property
    def response(self) -> http.client.HTTPResponse:
        if self._response is None:
            self._response = self.conn.getresponse()
        return self._response

    def events(self) -> Iterator[str]:
        """`data:` payloads in order, up to and including `[DONE]`."""
        for raw in self.response:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: "):
                yield line[len("data: ") :]
                if line == "data: [DONE]":
                    return

    def close(self) -> None:
        self.conn.close()


def long_stream_body(model: str) -> dict[str, Any]:
    """A stream that would run to the context limit (≈2000 tokens) if nobody stopped it."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
    }
