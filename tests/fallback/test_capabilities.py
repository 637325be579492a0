"""What /v1/models advertises is what the server does, on both engines.

Each advertised capability is exercised: honoured ones must work, the
others must be a 400 naming the field. A capability this test does not know
fails it, so nothing can be advertised without being exercised here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fallback.conftest import FallbackServer, start_server, stop_server
from tests.harness.procs import http_json

HELLO = [{"role": "user", "content": "Hello!"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"x": {"enum": ["a", "b"]}},
            "required": ["x"],
        },
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "v",
        "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
}
FORMATS: dict[str, dict[str, Any]] = {
    "text": {"type": "text"},
    "json_object": {"type": "json_object"},
    "json_schema": SCHEMA,
}
CHOICES: dict[str, Any] = {
    "none": "none",
    "auto": "auto",
    "required": "required",
    "function": {"type": "function", "function": {"name": "pick"}},
}


# The engines under their defaults, and the batched one without its side lane
# (then only what continuous batching itself honours is advertised).
SERVERS = {
    "threads": ["--engine", "threads"],
    "batched": ["--engine", "batched"],
    "batched-no-side-lane": ["--engine", "batched", "--side-slots", "0"],
}


@pytest.fixture(scope="module", params=tuple(SERVERS))
def engine_server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp(f"caps-{request.param}") / "server.log"
    server = start_server(tiny_model_dir, log_path, SERVERS[request.param])
    try:
        yield server
    finally:
        stop_server(server)


def _caps(server: FallbackServer) -> dict[str, Any]:
    status, body = http_json("GET", server.url + "/v1/models")
    assert status == 200
    caps: dict[str, Any] = body["data"][0]["capabilities"]
    return caps


def _chat(server: FallbackServer, **extra: Any) -> tuple[int, Any]:
    return server.post(
        "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3, "temperature": 0, **extra}
    )


def _ok(result: tuple[int, Any]) -> dict[str, Any]:
    status, body = result
    assert status == 200, body
    answer: dict[str, Any] = body
    return answer


def _refused(result: tuple[int, Any], param: str) -> None:
    status, body = result
    assert status == 400, body
    assert body["error"]["param"] == param, body


# One exerciser per advertised key: (server, advertised value, whole capabilities object).
Exercise = Callable[[FallbackServer, Any, dict[str, Any]], None]


def _engine(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value in ("threads", "batched")


def _continue(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value is True
    messages = [*HELLO, {"role": "assistant", "content": "Hi there,"}]
    _ok(_chat(server, messages=messages, continue_final_message=True))


def _n(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value is True
    body = _ok(_chat(server, n=2))
    assert [c["index"] for c in body["choices"]] == [0, 1]


def _max_n(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    _refused(_chat(server, n=value + 1), "n")


def _stop(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value is True
    body = _ok(_chat(server, stop=["e", "a", "o", " "], max_tokens=20, ignore_eos=True))
    assert body["choices"][0]["finish_reason"] == "stop"


def _seed(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    if not value:
        _refused(_chat(server, seed=1, temperature=1.0), "seed")
        return
    a, b = (_ok(_chat(server, seed=4, temperature=1.0, max_tokens=5)) for _ in range(2))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def _logprobs(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    if not value:
        _refused(_chat(server, logprobs=True), "logprobs")
        return
    body = _ok(_chat(server, logprobs=True, ignore_eos=True))
    assert len(body["choices"][0]["logprobs"]["content"]) == 3


def _max_top(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    if not caps["logprobs"]:
        assert value == 0
        return
    body = _ok(_chat(server, logprobs=True, top_logprobs=value, ignore_eos=True))
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == value
    if value < 20:
        _refused(_chat(server, logprobs=True, top_logprobs=value + 1), "top_logprobs")


def _formats(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert "text" in value
    for kind, fmt in FORMATS.items():
        result = _chat(server, response_format=fmt, max_tokens=30)
        if kind in value:
            _ok(result)
        else:
            _refused(result, "response_format")


def _tools(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value is True
    _ok(_chat(server, tools=[TOOL]))


def _tool_choice(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    for name, choice in CHOICES.items():
        forced = name in ("required", "function")
        result = _chat(server, tools=[TOOL], tool_choice=choice, max_tokens=120 if forced else 3)
        if name not in value:
            _refused(result, "tool_choice")
            continue
        body = _ok(result)
        if forced:
            assert body["choices"][0]["finish_reason"] == "tool_calls", body


def _parallel(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
    assert value is True
    _ok(_chat(server, tools=[TOOL], parallel_tool_calls=False))


def _flag(field: str, **request: Any) -> Exercise:
    def exercise(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
        result = _chat(server, **request)
        if value:
            _ok(result)
        else:
            _refused(result, field)

    return exercise


def _fields(endpoint: str) -> Exercise:
    path = "/v1/chat/completions" if endpoint == "chat_completions" else "/v1/completions"
    base = {"messages": HELLO} if endpoint == "chat_completions" else {"prompt": "Hi"}

    def exercise(server: FallbackServer, value: Any, caps: dict[str, Any]) -> None:
        assert set(value) == {"honoured", "ignored"}
        for name in value["ignored"]:  # accepted, whatever the value
            status, body = server.post(path, {**base, "max_tokens": 1, name: "x"})
            assert status == 200, (name, body)
        for name in value["honoured"]:  # known: a bad value is a 400 naming it, not "unknown"
            status, body = server.post(path, {**base, "max_tokens": 1, name: {"bad": []}})
            if status == 400:  # (a sub-key of the bad value may be unknown, not the field)
                error = body["error"]
                assert (error["code"], error["param"]) != ("unknown_parameter", name), body

    return exercise


EXERCISES: dict[str, Exercise] = {
    "engine": _engine,
    "continue_final_message": _continue,
    "n": _n,
    "max_n": _max_n,
    "stop": _stop,
    "seed": _seed,
    "logprobs": _logprobs,
    "max_top_logprobs": _max_top,
    "response_format": _formats,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _parallel,
    "logit_bias": _flag("logit_bias", logit_bias={"5": 1}),
    "penalties": _flag("presence_penalty", presence_penalty=0.5, frequency_penalty=0.5),
    "repetition_penalty": _flag("repetition_penalty", repetition_penalty=1.2),
    "min_tokens": _flag("min_tokens", min_tokens=2),
    "chat_completions": _fields("chat_completions"),
    "completions": _fields("completions"),
}


def test_every_advertised_capability_is_exercised(engine_server: FallbackServer) -> None:
    caps = _caps(engine_server)
    assert set(caps) == set(EXERCISES), "advertised without a test, or tested but gone"
    for key, exercise in EXERCISES.items():
        exercise(engine_server, caps[key], caps)
    engine_server.wait_metric("vllm:num_requests_running", 0, timeout=10)


def test_both_engines_advertise_the_whole_api_by_default(engine_server: FallbackServer) -> None:
    """Issue 15's list, on either engine; without the side lane the batched one says less."""
    caps = _caps(engine_server)
    full = "--side-slots" not in engine_server.proc.args  # type: ignore[operator]
    assert caps["logprobs"] is full
    assert caps["max_top_logprobs"] == (20 if full else 0)
    assert caps["seed"] is True
    assert caps["n"] is True
    assert caps["stop"] is True
    assert caps["tools"] is True
    structured = ["text", "json_object", "json_schema"] if full else ["text"]
    assert caps["response_format"] == structured
    forced = ["none", "auto", "required", "function"] if full else ["none", "auto"]
    assert caps["tool_choice"] == forced
    for flag in ("logit_bias", "penalties", "repetition_penalty", "min_tokens"):
        assert caps[flag] is full, flag
    honoured = set(caps["chat_completions"]["honoured"])
    gated = {"logprobs", "top_logprobs", "logit_bias", "presence_penalty", "min_tokens"}
    assert gated <= honoured if full else not gated & honoured
