"""The API the fallback claims, through the official `openai` client, on both engines.

logprobs in OpenAI's shapes, n choices, stop strings (streamed, split across
tokens), seeds, structured output through xgrammar, tools rendered by the
chat template and tool calls parsed back. Every test runs on the threads
engine (the session server) and on the batched engine, whose side lane
serves what continuous batching cannot (logprobs, grammars, penalties, ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.fallback.conftest import (
    FallbackServer,
    RawStream,
    long_stream_body,
    start_server,
    stop_server,
)
from tests.harness.procs import http_json


@pytest.fixture(scope="module", params=("threads", "batched"))
def api_server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[FallbackServer]:
    if request.param == "threads":
        yield request.getfixturevalue("fallback_server")
        return
    log_path = tmp_path_factory.mktemp("api-batched") / "server.log"
    args = ["--engine", "batched", "--max-concurrency", "1", "--max-queue", "1"]
    server = start_server(tiny_model_dir, log_path, args)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def server(api_server: FallbackServer) -> Iterator[FallbackServer]:
    """This module's server for the engine at hand, checked idle before and after each test."""
    assert api_server.proc.poll() is None, api_server.log_tail()
    yield api_server
    api_server.wait_metric("vllm:num_requests_running", 0, timeout=10)
    api_server.wait_metric("vllm:num_requests_waiting", 0, timeout=10)


ASK: tuple[ChatCompletionMessageParam, ...] = (
    {"role": "user", "content": "What is the weather in Paris?"},
)
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
YES_NO = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}


def _chat(client: openai.OpenAI, server: FallbackServer, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=server.served_model_name, messages=kwargs.pop("messages", ASK), **kwargs
    )


# --- logprobs ----------------------------------------------------------------------------


def test_logprobs_in_openai_shape(server: FallbackServer, client: openai.OpenAI) -> None:
    completion = _chat(
        client,
        server,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    (choice,) = completion.choices
    assert choice.logprobs is not None
    entries = choice.logprobs.content
    assert entries is not None
    assert len(entries) == completion.usage.completion_tokens == 6
    for entry in entries:
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0.0
        assert entry.bytes is not None
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob
    # The tokens' bytes spell the answer.
    raw = b"".join(bytes(e.bytes or []) for e in entries)
    assert raw.decode("utf-8", errors="replace") == choice.message.content

    stream = _chat(
        client,
        server,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        e
        for chunk in stream
        for c in chunk.choices
        if c.logprobs is not None and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_without_logprobs_they_are_null(server: FallbackServer, client: openai.OpenAI) -> None:
    completion = _chat(client, server, max_tokens=3)
    assert completion.choices[0].logprobs is None


def test_completions_logprobs_legacy_shape(server: FallbackServer) -> None:
    status, body = server.post(
        "/v1/completions",
        {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 2,
         "ignore_eos": True},
    )  # fmt: skip
    assert status == 200, body
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(len(top) >= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][0] == 0


# --- n, seed, stop -----------------------------------------------------------------------


def test_n_two_choices_non_streaming_and_streaming(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    params: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    full = _chat(client, server, **params, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1]
    texts = [c.message.content for c in full.choices]
    assert texts[0] != texts[1]  # seed + index: distinct, yet reproducible
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 16
    # Choice 0 of n=2 is what n=1 gives with the same seed.
    single = _chat(client, server, max_tokens=8, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})  # fmt: skip
    assert single.choices[0].message.content == texts[0]

    stream = _chat(
        client,
        server,
        **params,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            by_index[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert [by_index[0], by_index[1]] == texts
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16


def test_same_seed_same_text_streamed_too(server: FallbackServer, client: openai.OpenAI) -> None:
    def streamed(seed: int) -> str:
        stream = _chat(client, server, max_tokens=12, temperature=1.0, seed=seed, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert streamed(21) == streamed(21)
    full = _chat(client, server, max_tokens=12, temperature=1.0, seed=21)
    assert streamed(21) == full.choices[0].message.content


def test_stop_split_across_tokens_is_cut_in_the_stream(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    params: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 30,
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    free = _chat(client, server, **params, logprobs=True)
    tokens = [e.token for e in free.choices[0].logprobs.content]
    text = free.choices[0].message.content
    # A stop string made of the end of one token and the start of the next.
    for k in range(len(tokens) // 2, len(tokens) - 1):
        left, right = tokens[k], tokens[k + 1]
        if len(left) >= 2 and len(right) >= 2 and "\ufffd" not in left + right:
            stop = left[-2:] + right[:2]
            index = text.find(stop)
            if index >= 0 and index == len("".join(tokens[:k])) + len(left) - 2:
                break
    else:
        raise AssertionError(f"no two-token stop string in {tokens!r}")
    # logprobs here too: the batched engine then serves both from its side lane
    # (a seed's text across its two lanes can differ by rounding).
    stream = _chat(client, server, **params, stop=[stop], stream=True, logprobs=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[:index]
    assert stop not in streamed
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- structured output -------------------------------------------------------------------


def test_json_schema_enum_always_valid(server: FallbackServer, client: openai.OpenAI) -> None:
    seen = set()
    for seed in range(6):
        completion = _chat(
            client, server, max_tokens=30, temperature=1.0, seed=seed, response_format=YES_NO
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        answer = json.loads(choice.message.content)
        assert answer in ({"answer": "yes"}, {"answer": "no"})
        seen.add(answer["answer"])
    stream = _chat(client, server, max_tokens=30, seed=99, response_format=YES_NO, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) in ({"answer": "yes"}, {"answer": "no"})


def test_json_object_is_an_object(server: FallbackServer, client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = _chat(
            client,
            server,
            max_tokens=200,
            seed=seed,
            response_format={"type": "json_object"},
        )
        text = completion.choices[0].message.content
        assert text.startswith("{")
        if completion.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


# --- tools -------------------------------------------------------------------------------


def test_forced_tool_call_is_parsed(server: FallbackServer, client: openai.OpenAI) -> None:
    completion = _chat(
        client,
        server,
        max_tokens=120,
        seed=1,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_required_tool_call_streamed(server: FallbackServer, client: openai.OpenAI) -> None:
    stream = _chat(
        client, server, max_tokens=120, seed=2, tools=[WEATHER, TIME], tool_choice="required",
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].index == 0
    assert calls[0].id and calls[0].id.startswith("call_")
    assert calls[0].function is not None
    name, arguments = calls[0].function.name, json.loads(calls[0].function.arguments or "")
    assert (name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == ""


FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _forced_call(
    server: FallbackServer, client: openai.OpenAI, max_tokens: int, *, stream: bool
) -> tuple[str | None, str, str, str, str]:
    """(finish_reason, content, call id, name, arguments) of a forced call of get_weather."""
    kwargs: Any = dict(max_tokens=max_tokens, seed=3, tools=[WEATHER], tool_choice=FORCED)
    if stream:
        chunks = list(_chat(client, server, stream=True, **kwargs))
        deltas = [ch.delta for c in chunks for ch in c.choices]
        (call,) = [tc for d in deltas for tc in d.tool_calls or []]
        content = "".join(d.content or "" for d in deltas)
        reason = chunks[-1].choices[0].finish_reason
        function = call.function
        return reason, content, call.id or "", function.name or "", function.arguments or ""
    choice = _chat(client, server, **kwargs).choices[0]
    (whole,) = choice.message.tool_calls
    return (
        choice.finish_reason,
        choice.message.content or "",
        whole.id,
        whole.function.name,
        whole.function.arguments,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_cut_by_max_tokens_is_a_partial_call(
    server: FallbackServer, client: openai.OpenAI, stream: bool
) -> None:
    """As vLLM: the call with the arguments written so far and finish_reason "length".
    It came back as `<tool_call>` markup in `content` (8c097b4)."""
    full = _chat(client, server, max_tokens=120, seed=3, tools=[WEATHER], tool_choice=FORCED)
    whole = full.choices[0].message.tool_calls[0].function.arguments
    # The longest limit that cuts into the arguments (the grammar's text is fixed).
    for limit in range(full.usage.completion_tokens - 1, 0, -1):
        reason, content, call_id, name, arguments = _forced_call(
            server, client, limit, stream=stream
        )
        if arguments != whole:
            break
    assert reason == "length"
    assert content == ""
    assert call_id.startswith("call_")
    assert name == "get_weather"
    assert arguments and whole.startswith(arguments) and arguments != whole, (arguments, whole)


def test_a_required_tool_call_cut_before_the_name_has_no_markup(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    completion = _chat(
        client, server, max_tokens=1, seed=4, tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert "<tool" not in (choice.message.content or "")


def test_tools_are_rendered_into_the_prompt(server: FallbackServer, client: openai.OpenAI) -> None:
    plain = _chat(client, server, max_tokens=2)
    with_tools = _chat(client, server, max_tokens=2, tools=[WEATHER], tool_choice="auto")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    _, tokenized = server.post("/tokenize", {"messages": list(ASK), "tools": [WEATHER]})
    assert tokenized["count"] == with_tools.usage.prompt_tokens
    # tool_choice "none": the model is not shown the tools.
    hidden = _chat(client, server, max_tokens=2, tools=[WEATHER], tool_choice="none")
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_results_continue_the_conversation(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    first = _chat(client, server, max_tokens=120, tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = _chat(client, server, messages=messages, max_tokens=4, tools=[WEATHER])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_logit_bias_forces_a_token(server: FallbackServer, client: openai.OpenAI) -> None:
    _, tokenized = server.post("/tokenize", {"prompt": " the", "add_special_tokens": False})
    (token,) = tokenized["tokens"]
    completion = _chat(
        client, server, max_tokens=4, temperature=0, logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert completion.choices[0].message.content == " the" * 4


def test_presence_penalty_breaks_greedy_repetition(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    def tokens(**extra: Any) -> list[str]:
        completion = _chat(
            client, server, max_tokens=24, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True}, **extra,
        )  # fmt: skip
        return [e.token for e in completion.choices[0].logprobs.content]

    free, penalised = tokens(), tokens(presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised != free
    assert len(set(penalised)) > len(set(free))  # fewer repeats


def test_disconnect_during_the_second_choice_frees_the_slot(server: FallbackServer) -> None:
    body = long_stream_body(server.served_model_name) | {"n": 2, "max_tokens": 300}
    stream = RawStream(server, "/v1/chat/completions", body)
    try:
        for event in stream.events():
            if '"index":1' in event:
                break
        else:
            raise AssertionError("the second choice never started")
        assert server.metric("vllm:num_requests_running") == 1
    finally:
        stream.close()
    server.wait_metric("vllm:num_requests_running", 0, timeout=5)
    # The admission slot came back too: the next request is served, not queued forever.
    status, answer = http_json(
        "POST", server.url + "/v1/chat/completions", {"messages": list(ASK), "max_tokens": 2},
        timeout=10,
    )  # fmt: skip
    assert status == 200, answer
    assert server.metric("vllm:num_requests_waiting") == 0


def test_completions_honour_n_and_response_format(server: FallbackServer) -> None:
    status, body = server.post(
        "/v1/completions",
        {"prompt": "Answer:", "n": 2, "seed": 5, "max_tokens": 30, "response_format": YES_NO},
    )
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert json.loads(choice["text"]) in ({"answer": "yes"}, {"answer": "no"})


def test_stop_token_ids_still_stop_with_ignore_eos(server: FallbackServer) -> None:
    """vLLM's ignore_eos ignores the model's end tokens only. The threads engine (and the
    batched engine's side lane) held every stop_token_id back too, with min_new_tokens =
    max_tokens, so the answer ran on to max_tokens (the batch stopped)."""
    prompt = "Paris is"
    status, first = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    assert status == 200, first
    _, ids = server.post(
        "/tokenize", {"prompt": first["choices"][0]["text"], "add_special_tokens": False}
    )
    assert ids["count"] == 1, ids  # the greedy first token, as one id
    for extra in ({}, {"logprobs": 0}):  # logprobs: the batched engine's side lane
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        status, answer = server.post(
            "/v1/completions", body | {"stop_token_ids": ids["tokens"], **extra}
        )
        assert status == 200, answer
        assert answer["choices"][0]["finish_reason"] == "stop", (extra, answer)
        assert answer["usage"]["completion_tokens"] == 1, (extra, answer)


def test_stop_strings_wait_for_min_tokens(server: FallbackServer) -> None:
    """vLLM looks for stop strings only once the output is past min_tokens; here a stop
    string in the first token ended the answer there, min_tokens notwithstanding."""
    prompt = "Paris is"
    status, first = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    assert status == 200, first
    stop = first["choices"][0]["text"].strip()
    assert stop, first
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    status, early = server.post("/v1/completions", body)
    assert status == 200, early
    assert early["usage"]["completion_tokens"] == 1  # without min_tokens: cut at once
    status, held = server.post("/v1/completions", body | {"min_tokens": 8})
    assert status == 200, held
    assert held["usage"]["completion_tokens"] >= 8, held
    assert held["choices"][0]["text"].startswith(first["choices"][0]["text"])


def test_a_stop_token_id_past_int64_is_no_error(server: FallbackServer) -> None:
    """No model has such a token; torch's int64 tensor of the end ids overflowed (500)."""
    for extra in ({}, {"logprobs": 0}):  # logprobs: the batched engine's side lane
        body = {"prompt": "Hi", "max_tokens": 3, "stop_token_ids": [2**64], **extra}
        status, answer = server.post("/v1/completions", body)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 3
