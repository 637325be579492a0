"""Load behaviour: bounded queue and 503, cancellation on disconnect, shutdown."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.fallback.conftest import (
    FallbackServer,
    RawStream,
    long_stream_body,
    start_server,
    stop_server,
)


def _read_content_chunks(stream: RawStream, count: int) -> None:
    seen = 0
    for event in stream.events():
        if '"content":"' in event and '"role"' not in event:
            seen += 1
            if seen == count:
                return
    pytest.fail("stream ended before producing content")


def test_disconnect_mid_stream_stops_generation(server: FallbackServer) -> None:
    tokens_before = server.metric("vllm:generation_tokens_total")
    aborted_before = server.metric(
        "vllm:request_success_total", finished_reason="abort", model_name=server.served_model_name
    )
    stream = RawStream(server, "/v1/chat/completions", long_stream_body(server.served_model_name))
    _read_content_chunks(stream, 3)
    assert server.metric("vllm:num_requests_running") == 1
    stream.close()

    freed_after = server.wait_metric("vllm:num_requests_running", 0, timeout=5)
    assert freed_after < 1.0
    generated = server.metric("vllm:generation_tokens_total") - tokens_before
    assert generated < 1000  # of the 2000 it would have produced
    time.sleep(0.3)
    assert server.metric("vllm:generation_tokens_total") - tokens_before == generated
    aborted = server.metric(
        "vllm:request_success_total", finished_reason="abort", model_name=server.served_model_name
    )
    assert aborted == aborted_before + 1


def test_disconnect_while_waiting_for_a_non_streaming_answer(server: FallbackServer) -> None:
    body = {**long_stream_body(server.served_model_name), "stream": False}
    request = RawStream(server, "/v1/chat/completions", body)
    server.wait_metric("vllm:num_requests_running", 1, timeout=5)
    request.close()  # never reads the answer
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=5) < 1.0


def test_repeated_disconnects_leak_no_threads(server: FallbackServer) -> None:
    # One full request first, so lazily created pool threads already exist.
    status, _ = server.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 200
    threads_before = server.thread_count()
    for _ in range(4):
        stream = RawStream(
            server, "/v1/chat/completions", long_stream_body(server.served_model_name)
        )
        _read_content_chunks(stream, 1)
        stream.close()
        server.wait_metric("vllm:num_requests_running", 0, timeout=5)
    assert server.thread_count() == threads_before


def test_over_capacity_gets_503_with_retry_after(server: FallbackServer) -> None:
    body = long_stream_body(server.served_model_name)
    running = RawStream(server, "/v1/chat/completions", body)
    _read_content_chunks(running, 1)
    waiting = RawStream(server, "/v1/chat/completions", body)  # sent; its headers wait for a slot
    try:
        server.wait_metric("vllm:num_requests_waiting", 1, timeout=5)
        assert server.metric("vllm:num_requests_running") == 1

        with server.openai() as client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=server.served_model_name,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=5,
            )
        assert info.value.status_code == 503
        retry_after = info.value.response.headers["Retry-After"]
        assert int(retry_after) >= 1
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "overloaded"
        rejected = server.metric(
            "brownout_fallback_http_requests_total", endpoint="/v1/chat/completions", status="503"
        )
        assert rejected >= 1

        # The queued request gets the slot as soon as the first one goes away.
        running.close()
        server.wait_metric("vllm:num_requests_waiting", 0, timeout=5)
        _read_content_chunks(waiting, 1)
        assert server.metric("vllm:num_requests_running") == 1
    finally:
        running.close()
        waiting.close()
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=5) < 1.0


def test_client_leaving_the_queue_frees_its_place(server: FallbackServer) -> None:
    body = long_stream_body(server.served_model_name)
    running = RawStream(server, "/v1/chat/completions", body)
    try:
        _read_content_chunks(running, 1)
        waiting = RawStream(server, "/v1/chat/completions", body)
        server.wait_metric("vllm:num_requests_waiting", 1, timeout=5)
        waiting.close()
        assert server.wait_metric("vllm:num_requests_waiting", 0, timeout=5) < 1.0
        assert server.metric("vllm:num_requests_running") == 1
    finally:
        running.close()


def test_sigterm_ends_streams_with_an_error_event_and_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_model_dir, tmp_path / "server.log", ["--served-model-name", "tiny"])
    try:
        stream = RawStream(server, "/v1/chat/completions", long_stream_body("tiny"))
        _read_content_chunks(stream, 1)
        server.proc.send_signal(signal.SIGTERM)
        rest = list(stream.events())
        stream.close()
        assert server.proc.wait(timeout=10) == 0
    finally:
        if server.proc.poll() is None:
            stop_server(server)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    # Never a silently truncated "success": an explicit error the SDKs raise on.
    assert last["error"]["code"] == 503
    assert "shutting down" in last["error"]["message"]
    assert not any('"finish_reason":"length"' in e for e in rest)
