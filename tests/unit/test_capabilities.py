"""What a backend honours: read from its model card once, checked per request."""

from __future__ import annotations

from proxy.fallback.api.fields import advertise
from proxy.fallback.engines.interface import Capabilities as EngineCaps
from proxy.openai.capabilities import PLAIN, from_model_card, without

MSG = [{"role": "user", "content": "hi"}]


def test_plain_chat_names_every_field_beyond_it() -> None:
    body = {
        "model": "m",
        "messages": MSG,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "logprobs": True,
        "response_format": {"type": "json_object"},
        "n": 2,
        "stop": ["x"],
        "seed": 1,
        "logit_bias": {"1": 2},
        "user": "u",
        "temperature": 0.2,
    }
    missing = PLAIN.unsupported(body, chat=True)
    assert missing == [
        "tools",
        "tool_choice",
        "logprobs",
        "response_format",
        "n",
        "stop",
        "seed",
        "logit_bias",
    ]
    assert PLAIN.unsupported({"model": "m", "messages": MSG, "user": "u"}, chat=True) == []


def test_multimodal_parts_are_named_and_dropped_by_type() -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        }
    ]
    body = {"model": "m", "messages": msgs}
    missing = PLAIN.unsupported(body, chat=True)
    assert missing == ["messages[].content[type=image_url]"]
    out = without(body, missing, PLAIN.content_parts)
    assert out["messages"][0]["content"] == [{"type": "text", "text": "what is this"}]
    assert body["messages"][0]["content"][1]["type"] == "image_url"  # the original is untouched


def test_the_fallback_servers_advertisement_is_read() -> None:
    full = EngineCaps(
        engine="batched",
        seed=True,
        logprobs=True,
        max_top_logprobs=5,
        logits_processors=True,
        repetition_penalty=True,
        min_tokens=True,
    )
    caps = from_model_card({"id": "tiny", "capabilities": advertise(full, grammar=True)})
    assert caps is not None
    body = {
        "model": "m",
        "messages": MSG,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "logprobs": True,
        "top_logprobs": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        "n": 2,
        "stop": ["x"],
        "seed": 1,
        "logit_bias": {"1": 2},
    }
    assert caps.unsupported(body, chat=True) == []
    assert caps.unsupported({**body, "top_logprobs": 6, "n": 9}, chat=True) == [
        "n",
        "top_logprobs",
    ]
    assert caps.continuation is True
    bare = EngineCaps("threads", False, False, 0, False, False, False)
    weak = from_model_card({"id": "tiny", "capabilities": advertise(bare, grammar=False)})
    assert weak is not None
    assert set(weak.unsupported(body, chat=True)) == {
        "logprobs",
        "top_logprobs",
        "seed",
        "logit_bias",
        "tool_choice",
        "response_format",
    }
    assert from_model_card({"id": "x"}) is None


def test_neutral_values_ask_for_nothing() -> None:
    """Clients that send every default (n: 1, penalties 0, ...) are not refused."""
    body = {
        "model": "m",
        "messages": MSG,
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "stop": [],
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
    }
    assert PLAIN.unsupported(body, chat=True) == []
    assert PLAIN.unsupported({**body, "n": 2, "logprobs": True}, chat=True) == ["n", "logprobs"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert PLAIN.unsupported({**body, "tools": tools}, chat=True) == [
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    ]
