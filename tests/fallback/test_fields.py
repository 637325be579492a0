"""Request-field classification and capability gating (pure, no server)."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions

from proxy.fallback.api import fields
from proxy.fallback.api.errors import APIError
from proxy.fallback.engines.interface import Capabilities
from proxy.fallback.protocol import Output, ResponseFormat, SamplingParams, Tool, ToolUse

SDK_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
FULL = Capabilities("threads", True, True, 20, True, True, True)
BARE = Capabilities("batched", False, False, 0, False, False, False)


def _sdk_fields(create: Any) -> set[str]:
    return set(inspect.signature(create).parameters) - SDK_ONLY


@pytest.mark.parametrize(
    ("endpoint", "create"), [("chat", ChatCompletions.create), ("completions", Completions.create)]
)
def test_every_field_of_the_openai_sdk_is_classified(endpoint: Any, create: Any) -> None:
    known = set(fields.honoured_fields(endpoint)) | set(fields.ignored_fields(endpoint))
    known |= set(fields._REJECTED)
    assert _sdk_fields(create) - known == set()


def _error(data: dict[str, Any], endpoint: Any = "chat") -> APIError:
    with pytest.raises(APIError) as info:
        fields.check_fields(data, endpoint)
    return info.value


def test_neutral_values_of_rejected_fields_pass() -> None:
    neutral = {"n": 1, "echo": False, "best_of": 1, "modalities": ["text"], "length_penalty": 1.0}
    fields.check_fields(neutral | {"user": "u", "metadata": {"a": "b"}}, "chat")
    fields.check_fields({"echo": None, "suffix": ""}, "completions")


@pytest.mark.parametrize(
    ("data", "param", "code"),
    [
        ({"echo": 1}, "echo", "unsupported_parameter"),  # a number is not false
        ({"best_of": 2}, "best_of", "unsupported_parameter"),
        ({"moderation": {"model": "m"}}, "moderation", "unsupported_parameter"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
        ({"made_up": 1}, "made_up", "unknown_parameter"),
    ],
)
def test_what_is_not_honoured_is_a_400_naming_it(
    data: dict[str, Any], param: str, code: str
) -> None:
    error = _error(data)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert param in error.message


def test_chat_only_fields_are_unknown_to_completions() -> None:
    assert _error({"tools": [{}]}, "completions").code == "unknown_parameter"
    assert _error({"prompt": "x"}, "chat").code == "unknown_parameter"


FORCED = ToolUse((Tool("f", None, None),), "required")
JSON = ResponseFormat("json_object")


@pytest.mark.parametrize(
    ("sampling", "output", "param"),
    [
        (SamplingParams(seed=1), Output(), "seed"),
        (SamplingParams(), Output(logprobs=0), "logprobs"),
        (
            SamplingParams(),
            Output(response_format=ResponseFormat("json_object")),
            "response_format",
        ),
        (SamplingParams(), Output(tool_use=FORCED), "tool_choice"),
        (SamplingParams(), Output(logit_bias=((1, 1.0),)), "logit_bias"),
        (SamplingParams(), Output(presence_penalty=1.0), "presence_penalty"),
        (SamplingParams(repetition_penalty=1.1), Output(), "repetition_penalty"),
        (SamplingParams(min_tokens=2), Output(), "min_tokens"),
    ],
)
def test_an_engine_without_the_capability_refuses_the_field(
    sampling: SamplingParams, output: Output, param: str
) -> None:
    fields.check_capabilities(FULL, sampling, output, chat=True, grammar=True)
    with pytest.raises(APIError) as info:
        fields.check_capabilities(BARE, sampling, output, chat=True, grammar=True)
    assert info.value.param == param


def test_without_xgrammar_no_structured_output_is_advertised_or_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.fallback.features import support
    from proxy.fallback.features.grammarlane import LaneLimits

    monkeypatch.setitem(sys.modules, "proxy.fallback.features.structured", None)  # import fails
    assert support._load_structured(object(), 10, LaneLimits()) is None
    caps = fields.advertise(FULL, grammar=False)
    assert caps["response_format"] == ["text"]
    assert caps["tool_choice"] == ["none", "auto"]
    assert caps["logit_bias"] is True  # needs no grammar
    json_mode = Output(response_format=ResponseFormat("json_object"))
    with pytest.raises(APIError) as info:
        fields.check_capabilities(FULL, SamplingParams(), json_mode, chat=True, grammar=False)
    assert info.value.param == "response_format"


def test_advertised_fields_follow_the_engine() -> None:
    full, bare = fields.advertise(FULL, grammar=True), fields.advertise(BARE, grammar=True)
    assert "logprobs" in full["chat_completions"]["honoured"]
    assert "logprobs" not in bare["chat_completions"]["honoured"]
    assert "seed" not in bare["completions"]["honoured"]
    assert "user" in bare["chat_completions"]["ignored"]
    assert bare["response_format"] == ["text"]
