"""Bad requests get a 400 (or 404) with an OpenAI error object, never a 500."""

from __future__ import annotations

import http.client
import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.fallback.conftest import FallbackServer

HELLO: tuple[ChatCompletionMessageParam, ...] = ({"role": "user", "content": "Hello!"},)


def _assert_error(body: Any, *, param: str | None, code: str | None) -> None:
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["param"] == param
    assert error["code"] == code


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("payload", [b'{"messages": [', b"not json", b"\xff\xfe", b""])
def test_malformed_json(server: FallbackServer, path: str, payload: bytes) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", path, payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 400
    _assert_error(body, param=None, code="invalid_json")


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_type"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": -1}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stop": 5}, "stop", "invalid_type"),
        ({"stop": ["ok", 1]}, "stop", "invalid_type"),
        ({"seed": 1.5}, "seed", "invalid_type"),
        ({"messages": "hi"}, "messages", "invalid_type"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
        ({"stream_options": True}, "stream_options", "invalid_type"),
        ({"stream_options": {"include_usage": 1}}, "include_usage", "invalid_type"),
    ],
)
def test_wrong_types_and_values(
    server: FallbackServer, extra: dict[str, Any], param: str, code: str
) -> None:
    status, body = server.post("/v1/chat/completions", {"messages": HELLO, **extra})
    assert status == 400, body
    _assert_error(body, param=param, code=code)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 2}, "best_of"),
        ({"echo": True}, "echo"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_unsupported_parameters(server: FallbackServer, extra: dict[str, Any], param: str) -> None:
    status, body = server.post("/v1/chat/completions", {"messages": HELLO, **extra})
    assert status == 400, body
    _assert_error(body, param=param, code="unsupported_parameter")
    assert param in body["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 9}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        # int() refuses a superscript digit and more than 4,300 digits (were 500s).
        ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 5}}, "logit_bias"),
        ({"logit_bias": {"\u0663": 5}}, "logit_bias"),  # an Arabic-Indic 3
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),  # vLLM's 400; was clamped
        # Each is matched after every token (on the event loop, batched): bounded.
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
        ({"min_tokens": 6, "max_completion_tokens": 5}, "min_tokens"),
        # A grammar ends on the end token, which ignore_eos would forbid.
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ],
)
def test_invalid_values_of_honoured_fields(
    server: FallbackServer, extra: dict[str, Any], param: str
) -> None:
    status, body = server.post("/v1/chat/completions", {"messages": HELLO, **extra})
    assert status == 400, body
    _assert_error(body, param=param, code="invalid_value")


_LONE_SURROGATE_TOOL = {"name": "a", "parameters": {"properties": {"\ud800": {}}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800 hi"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HELLO,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"enum": ["ok", "\udfff"]}},
                },
            },
            "response_format.json_schema.schema.enum[1]",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HELLO,
                "tools": [{"type": "function", "function": _LONE_SURROGATE_TOOL}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters.properties.\\ud800",
        ),
        ("/v1/completions", {"prompt": "x\udc00"}, "prompt"),
        ("/tokenize", {"prompt": "x\udc00"}, "prompt"),
    ],
)
def test_a_lone_surrogate_escape_is_a_400_naming_the_field(
    server: FallbackServer, path: str, body: dict[str, Any], param: str
) -> None:
    """`"\\ud800"` is valid JSON but not Unicode: the tokenizer or xgrammar raised (500)."""
    status, answer = server.post(path, {"max_tokens": 1, **body} if path != "/tokenize" else body)
    assert status == 400, answer
    _assert_error(answer, param=param, code="invalid_value")


def test_a_pair_of_surrogate_escapes_is_one_character(server: FallbackServer) -> None:
    # json.dumps escapes every emoji so, as "\\ud83d\\ude00".
    messages = [{"role": "user", "content": "\U0001f600"}]
    status, answer = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200, answer


def test_openai_client_sees_bad_request_naming_the_field(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.served_model_name, messages=HELLO, reasoning_effort="high"
        )
    assert info.value.status_code == 400
    assert info.value.code == "unsupported_parameter"
    assert info.value.param == "reasoning_effort"
    assert "reasoning_effort" in info.value.message


def test_completions_rejects_echo_suffix_and_unknown_fields(server: FallbackServer) -> None:
    cases = (
        ({"echo": True}, "echo", "unsupported_parameter"),
        ({"suffix": "end"}, "suffix", "unsupported_parameter"),
        ({"messages": HELLO}, "messages", "unknown_parameter"),
        ({"tools": []}, "tools", "unknown_parameter"),
    )
    for extra, param, code in cases:
        status, body = server.post("/v1/completions", {"prompt": "Hi", **extra})
        assert status == 400, body
        _assert_error(body, param=param, code=code)


def test_context_length_exceeded(server: FallbackServer) -> None:
    status, body = server.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2048})
    assert status == 400
    _assert_error(body, param="messages", code="context_length_exceeded")
    assert "2048" in body["error"]["message"]
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 300  # > 2048 tokens
    status, body = server.post("/v1/completions", {"prompt": long_prompt})
    assert status == 400
    _assert_error(body, param="messages", code="context_length_exceeded")


def test_continue_final_message_needs_an_assistant_message(server: FallbackServer) -> None:
    status, body = server.post(
        "/v1/chat/completions", {"messages": HELLO, "continue_final_message": True}
    )
    assert status == 400
    _assert_error(body, param="continue_final_message", code="invalid_value")
    messages = [*HELLO, {"role": "assistant", "content": "Hi"}]
    status, body = server.post(
        "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert status == 400
    _assert_error(body, param="continue_final_message", code="invalid_value")


def test_unknown_model_is_404(server: FallbackServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    assert info.value.code == "model_not_found"


def test_unknown_route_and_method_keep_the_error_shape(server: FallbackServer) -> None:
    status, body = server.post("/v1/embeddings", {"input": "x"})
    assert status == 404
    _assert_error(body, param=None, code=None)
    status, body = server.post("/v1/models", {})
    assert status == 405
    _assert_error(body, param=None, code=None)


def test_sixty_four_stop_strings_are_fine(server: FallbackServer) -> None:
    stops = [f"never{i}" for i in range(64)] + ["never0"]  # duplicates count once
    body = {"messages": HELLO, "max_tokens": 2, "stop": stops}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 200, answer
