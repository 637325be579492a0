"""Both generation engines, each on a real server under its default settings.

`--engine threads` and `--engine batched` (Transformers' continuous batching,
slow on CPU but correct) each get one server started without
`--max-concurrency`, so the capacity is whatever the device planning gives.
Overlap is asserted on what the server reports (its running gauge while
every stream has produced a token and none has finished), never on timing.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fallback.conftest import FallbackServer, RawStream, start_server, stop_server
from tests.harness.procs import http_json

ENGINES = ("threads", "batched")
STORY = [{"role": "user", "content": "Write a story about a fox."}]


@pytest.fixture(scope="module", params=ENGINES)
def engine_server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    engine = request.param
    log_path = tmp_path_factory.mktemp(f"engine-{engine}") / "server.log"
    server = start_server(tiny_model_dir, log_path, ["--engine", engine])
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def server(engine_server: FallbackServer) -> Iterator[FallbackServer]:
    assert engine_server.proc.poll() is None, engine_server.log_tail()
    yield engine_server
    engine_server.wait_metric("vllm:num_requests_running", 0, timeout=10)
    engine_server.wait_metric("vllm:num_requests_waiting", 0, timeout=10)


def _long_stream(model: str, content: str = "Tell me a very long story.") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
    }


def _first_content(stream: RawStream) -> str:
    for event in stream.events():
        if '"content":"' in event and '"role"' not in event:
            return event
        assert event != "[DONE]", "stream ended before producing content"
    pytest.fail("stream ended before producing content")


def test_capacity_is_planned_from_the_device(server: FallbackServer) -> None:
    lines = server.log_path.read_text().splitlines()
    planned = [json.loads(line) for line in lines if '"event":"capacity"' in line]
    assert len(planned) == 1
    assert planned[0]["engine"] in ENGINES
    assert planned[0]["source"] != "--max-concurrency"
    assert planned[0]["max_running"] >= 8  # not the old default of 1


def test_eight_streams_overlap_under_default_settings(server: FallbackServer) -> None:
    streams = [
        RawStream(server, "/v1/chat/completions", _long_stream(server.served_model_name, f"Go {i}"))
        for i in range(8)
    ]
    try:
        for stream in streams:
            assert stream.response.status == 200  # admitted, not 503
            _first_content(stream)
        # Every stream has its first token and none can have finished (1,500 tokens each):
        # all eight are generating at once, and the engine says so.
        assert server.metric("vllm:num_requests_running") == 8
        assert server.metric("vllm:num_requests_waiting") == 0
    finally:
        for stream in streams:
            stream.close()
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=5) < 2.0


def test_disconnect_frees_the_slot_at_once(server: FallbackServer) -> None:
    name = server.served_model_name
    tokens_before = server.metric("vllm:generation_tokens_total")
    aborted_before = server.metric(
        "vllm:request_success_total", finished_reason="abort", model_name=name
    )
    stream = RawStream(server, "/v1/chat/completions", _long_stream(name))
    _first_content(stream)
    assert server.metric("vllm:num_requests_running") == 1
    stream.close()

    assert server.wait_metric("vllm:num_requests_running", 0, timeout=5) < 1.0
    generated = server.metric("vllm:generation_tokens_total") - tokens_before
    assert generated < 1000  # of the 1,500 it would have produced
    aborted = server.metric("vllm:request_success_total", finished_reason="abort", model_name=name)
    assert aborted == aborted_before + 1
    # The freed slot serves the next request.
    status, body = server.post(
        "/v1/chat/completions", {"messages": STORY, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4


def test_side_lane_shares_admission_and_metrics_and_frees_on_disconnect(
    server: FallbackServer,
) -> None:
    """Requests continuous batching cannot honour (here logprobs) still count and cancel.

    The batched engine runs them on its side lane (2 slots by default): a
    third one waits in the side lane's own queue (not in the batch's, where
    it would hold a slot the batch could use), counted as waiting, and its
    client leaving ends it at once. The threads engine runs all of them.
    """
    name = server.served_model_name
    _, models = http_json("GET", server.url + "/v1/models")
    batched = models["data"][0]["capabilities"]["engine"] == "batched"
    plain = RawStream(server, "/v1/chat/completions", _long_stream(name))
    side = [
        RawStream(
            server, "/v1/chat/completions", _long_stream(name, f"Go {i}") | {"logprobs": True}
        )
        for i in range(3)
    ]
    try:
        _first_content(plain)
        for stream in side[:2]:
            _first_content(stream)
        if not batched:
            assert side[2].response.status == 200  # admitted
            _first_content(side[2])
        else:
            server.wait_metric("vllm:num_requests_waiting", 1, timeout=5)
        assert server.metric("vllm:num_requests_running") == (3 if batched else 4)
        assert server.metric("vllm:num_requests_waiting") == (1 if batched else 0)
        side[2].close()
        if batched:  # left while waiting for a side thread: gone at once, the others run on
            assert server.wait_metric("vllm:num_requests_waiting", 0, timeout=5) < 1.0
            assert server.metric("vllm:num_requests_running") == 3
    finally:
        for stream in [plain, *side]:
            stream.close()
    assert server.wait_metric("vllm:num_requests_running", 0, timeout=5) < 2.0


def test_a_temperature_below_vllms_epsilon_is_greedy_and_the_engine_serves_on(
    server: FallbackServer,
) -> None:
    """1e-300 rounds to 0 in float32: the logits divided by it were inf/nan, which
    ended the batched engine's generation loop (every later request a 503 'shutting
    down', /health still 200) and failed the request on the threads engine (500)."""

    def content(temperature: float, **extra: Any) -> str:
        body = {"messages": STORY, "max_tokens": 8, "temperature": temperature, **extra}
        status, answer = server.post("/v1/chat/completions", body)
        assert status == 200, answer
        return str(answer["choices"][0]["message"]["content"])

    greedy = content(0)
    assert content(1e-300) == greedy
    assert content(1e-300, seed=3) == greedy
    assert content(1e-6, logprobs=True) == content(0, logprobs=True)  # the side lane too
    assert content(0) == greedy  # and the engine still serves


@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"],
)
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_number_is_a_400_and_the_engine_serves_on(
    server: FallbackServer, field: str, value: float
) -> None:
    """Python's JSON reads NaN and Infinity (json.dumps writes them): a NaN temperature
    made the logits nan, which ended the batched engine's loop (every later request a
    503); the others were 200s or 500s."""
    body = {"messages": STORY, "max_tokens": 4, field: value}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field
    status, answer = server.post("/v1/chat/completions", {"messages": STORY, "max_tokens": 2})
    assert status == 200, answer


@pytest.mark.parametrize("top_k", [2**31, 2**70])
def test_a_top_k_past_the_vocabulary_keeps_every_token(server: FallbackServer, top_k: int) -> None:
    """2**31 overflowed the batched engine's int32 tensor of top_k inside its generation
    loop, which died (that request a 500, every later one a 503)."""
    for extra in ({}, {"logprobs": True}):  # logprobs: the batched engine's side lane
        body = {"messages": STORY, "max_tokens": 4, "top_k": top_k, "seed": 1, **extra}
        status, answer = server.post("/v1/chat/completions", body)
        assert status == 200, answer
    status, answer = server.post("/v1/chat/completions", {"messages": STORY, "max_tokens": 2})
    assert status == 200, answer


def test_continuation_continues_the_partial_assistant_message(server: FallbackServer) -> None:
    prefix = "Once upon a time, there was a small village"
    messages = [*STORY, {"role": "assistant", "content": prefix}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    _, rendered = server.post("/tokenize", {"messages": messages, **flags})
    _, prefix_ids = server.post("/tokenize", {"prompt": prefix, "add_special_tokens": False})
    assert rendered["tokens"][-prefix_ids["count"] :] == prefix_ids["tokens"]

    status, continued = server.post(
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 10, "temperature": 0, **flags},
    )
    assert status == 200, continued
    assert continued["usage"]["prompt_tokens"] == rendered["count"]
    status, raw = server.post(
        "/v1/completions", {"prompt": rendered["tokens"], "max_tokens": 10, "temperature": 0}
    )
    assert status == 200, raw
    # Greedy from exactly those ids: the same continuation.
    assert continued["choices"][0]["message"]["content"] == raw["choices"][0]["text"]


def test_same_seed_same_text_while_sharing_the_engine(server: FallbackServer) -> None:
    def sample(seed: int) -> str:
        status, body = server.post(
            "/v1/chat/completions",
            {"messages": STORY, "max_tokens": 16, "temperature": 1.0, "seed": seed},
        )
        assert status == 200, body
        return str(body["choices"][0]["message"]["content"])

    alone = sample(5)
    # Again, while another stream shares the engine (the batched engine batches them).
    other = RawStream(server, "/v1/chat/completions", _long_stream(server.served_model_name))
    try:
        _first_content(other)
        shared = sample(5)
    finally:
        other.close()
    assert shared == alone
    assert sample(6) != alone


def test_seeded_side_lane_requests_are_reproducible(server: FallbackServer) -> None:
    """On the batched engine logprobs move a request to the side lane; its seed holds there.

    (It samples with the batch's hash too, so the text mostly matches the
    batch's for the same seed, but not always: the two forward passes round
    differently, and the tiny model's near-flat distributions flip on that.)
    """
    body = {"messages": STORY, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True,
            "logprobs": True}  # fmt: skip

    def sample(seed: int) -> str:
        status, answer = server.post("/v1/chat/completions", body | {"seed": seed})
        assert status == 200, answer
        assert len(answer["choices"][0]["logprobs"]["content"]) == 24
        return str(answer["choices"][0]["message"]["content"])

    first = sample(3)
    other = RawStream(server, "/v1/chat/completions", _long_stream(server.served_model_name))
    try:
        _first_content(other)  # the batch is busy meanwhile
        assert sample(3) == first
    finally:
        other.close()
    assert sample(4) != first


def test_metrics_keep_vllm_names_fed_by_the_engine(server: FallbackServer) -> None:
    name = server.served_model_name
    status, text = http_json("GET", server.url + "/metrics")
    assert status == 200
    for metric in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{metric}{{model_name="{name}"}}' in text
    stream = RawStream(server, "/v1/chat/completions", _long_stream(name))
    try:
        _first_content(stream)
        assert 0.0 < server.metric("vllm:kv_cache_usage_perc", model_name=name) <= 1.0
    finally:
        stream.close()


def test_batched_over_capacity_503_then_sigterm_ends_streams_in_band(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    args = ["--engine", "batched", "--max-concurrency", "1", "--max-queue", "0"]
    server = start_server(tiny_model_dir, tmp_path / "server.log", args)
    try:
        stream = RawStream(server, "/v1/chat/completions", _long_stream(server.served_model_name))
        _first_content(stream)
        status, body = server.post(
            "/v1/chat/completions", {"messages": STORY, "max_tokens": 4, "temperature": 0}
        )
        assert status == 503
        assert body["error"]["code"] == "overloaded"
        server.proc.send_signal(signal.SIGTERM)
        rest = list(stream.events())
        stream.close()
        assert server.proc.wait(timeout=15) == 0
    finally:
        if server.proc.poll() is None:
            stop_server(server)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    assert last["error"]["code"] == 503
    assert "shutting down" in last["error"]["message"]


def test_side_lane_traffic_never_holds_the_batchs_slots(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Batch capacity 2, one side slot: two side-lane requests (logprobs) take the
    side slot and the side queue, and a plain request still starts at once.
    Before, side requests waiting for a side thread held batch slots: the plain
    request queued behind them while the batch itself was idle."""
    args = ["--engine", "batched", "--max-concurrency", "2", "--side-slots", "1"]
    server = start_server(tiny_model_dir, tmp_path / "server.log", [*args, "--max-queue", "4"])
    try:
        name = server.served_model_name
        side = [
            RawStream(
                server, "/v1/chat/completions", _long_stream(name, f"Go {i}") | {"logprobs": True}
            )
            for i in range(2)
        ]
        streams = list(side)
        try:
            server.wait_metric("vllm:num_requests_running", 1, timeout=10)
            server.wait_metric("vllm:num_requests_waiting", 1, timeout=10)
            plain = RawStream(server, "/v1/chat/completions", _long_stream(name))
            streams.append(plain)
            _first_content(plain)  # admitted and generating while both side requests hold on
            assert server.metric("vllm:num_requests_running") == 2
            assert server.metric("vllm:num_requests_waiting") == 1
        finally:
            for stream in streams:
                stream.close()
        server.wait_metric("vllm:num_requests_running", 0, timeout=10)
        server.wait_metric("vllm:num_requests_waiting", 0, timeout=10)
    finally:
        stop_server(server)
