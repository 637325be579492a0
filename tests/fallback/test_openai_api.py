"""The fallback server through the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.fallback.conftest import FallbackServer, RawStream
from tests.harness.procs import http_json

HELLO: tuple[ChatCompletionMessageParam, ...] = (
    {"role": "user", "content": "Hello! How can I help you today?"},
)


def test_health_is_200_with_empty_body(server: FallbackServer) -> None:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
        assert resp.status == 200
        assert resp.read() == b""


def test_models_lists_the_served_model_with_its_context(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_dir.name]  # defaults to the basename
    status, body = http_json("GET", server.url + "/v1/models")
    assert status == 200
    card = body["data"][0]
    assert card["object"] == "model"
    assert card["owned_by"] == "brownout"
    assert card["max_model_len"] == 2048  # the tiny model's max_position_embeddings


def test_chat_non_streaming(server: FallbackServer, client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=server.served_model_name,
        messages=HELLO,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == server.served_model_name
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    _, tokenized = server.post("/tokenize", {"messages": HELLO})
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == tokenized["count"]
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == tokenized["count"] + 12


def test_chat_streaming_matches_non_streaming(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    model = server.served_model_name
    full = client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=model,
        messages=HELLO,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, final, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == full.choices[0].message.content
    assert all(c.choices[0].finish_reason is None for c in body)
    assert final.choices[0].finish_reason == full.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert full.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_wire_format(server: FallbackServer) -> None:
    stream = RawStream(
        server,
        "/v1/chat/completions",
        {"messages": HELLO, "stream": True, "max_tokens": 3, "temperature": 0},
    )
    try:
        headers = stream.response.headers
        assert headers["Content-Type"].startswith("text/event-stream")
        assert headers["Cache-Control"] == "no-cache"
        assert headers["X-Accel-Buffering"] == "no"
        events = list(stream.events())
    finally:
        stream.close()
    assert events[-1] == "[DONE]"
    objects = [json.loads(e) for e in events[:-1]]
    # Without include_usage there is no usage chunk: the last object carries finish_reason.
    assert objects[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in o for o in objects)


def test_completions_streaming_and_not(server: FallbackServer, client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=10, temperature=0
    )
    assert full.object == "text_completion"
    assert full.usage is not None
    assert full.usage.completion_tokens <= 10
    chunks = list(
        client.completions.create(
            model=server.served_model_name,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_harmless_fields_are_ignored_and_unknown_ones_rejected(server: FallbackServer) -> None:
    harmless = {
        "user": "someone",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "parallel_tool_calls": False,
        "n": 1,
        "echo": False,
        "presence_penalty": 0.0,
    }
    status, body = server.post(
        "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, **harmless}
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 2
    # A field nobody knows might change the answer: rejected, never silently dropped.
    status, body = server.post(
        "/v1/chat/completions", {"messages": HELLO, "some_future_field": [1, 2, 3]}
    )
    assert status == 400
    assert body["error"]["param"] == "some_future_field"
    assert body["error"]["code"] == "unknown_parameter"


def test_tokenize_prompt_and_messages(server: FallbackServer) -> None:
    status, body = server.post("/tokenize", {"model": server.served_model_name, "prompt": "Hello"})
    assert status == 200
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 2048
    _, chat = server.post("/tokenize", {"messages": HELLO})
    _, no_header = server.post("/tokenize", {"messages": HELLO, "add_generation_prompt": False})
    # The generation prompt adds the assistant header's tokens at the end.
    assert chat["tokens"][: no_header["count"]] == no_header["tokens"]
    assert chat["count"] > no_header["count"]


def test_metrics_exposes_load_and_latency(server: FallbackServer, client: openai.OpenAI) -> None:
    before_prompt = server.metric("vllm:prompt_tokens_total")
    before_gen = server.metric("vllm:generation_tokens_total")
    before_ttft = server.metric("vllm:time_to_first_token_seconds_count")
    completion = client.chat.completions.create(
        model=server.served_model_name,
        messages=HELLO,
        max_tokens=5,
    )
    assert completion.usage is not None
    # The slot is freed when the worker thread has returned, a moment after the answer.
    server.wait_metric("vllm:num_requests_running", 0, timeout=1)
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:time_to_first_token_seconds_count") == before_ttft + 1
    assert (
        server.metric("vllm:prompt_tokens_total") == before_prompt + completion.usage.prompt_tokens
    )
    assert (
        server.metric("vllm:generation_tokens_total")
        == before_gen + completion.usage.completion_tokens
    )
    ok = server.metric(
        "brownout_fallback_http_requests_total", endpoint="/v1/chat/completions", status="200"
    )
    assert ok >= 1


@pytest.mark.parametrize("max_param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_gives_length_and_exact_count(
    server: FallbackServer, client: openai.OpenAI, max_param: str
) -> None:
    completion = client.chat.completions.create(
        model=server.served_model_name,
        messages=HELLO,
        temperature=0.8,
        seed=1,
        extra_body={max_param: 7, "ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 7
