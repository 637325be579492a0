"""Hermes <tool_call> blocks back into OpenAI tool calls (pure, no model)."""

from __future__ import annotations

import json

import pytest

from proxy.fallback.features.tools import ToolCallSplitter, parse_tool_calls
from proxy.fallback.protocol import Tool, ToolUse

USE = ToolUse(tools=(Tool("get_weather", None, None), Tool("get_time", None, None)), mode="auto")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_content_then_calls() -> None:
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("get_weather", "get_time")
    content, calls = parse_tool_calls(text, USE)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert len({c.id for c in calls}) == 2


def test_parallel_false_keeps_the_first_call() -> None:
    serial = ToolUse(tools=USE.tools, mode="auto", parallel=False)
    _, calls = parse_tool_calls(CALL + CALL, serial)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": 5}\n</tool_call>',
    ],
)
def test_what_does_not_parse_stays_content(text: str) -> None:
    assert parse_tool_calls(text, USE) == (text, ())


def test_a_cut_off_close_tag_still_parses() -> None:
    _, calls = parse_tool_calls(CALL[:-3], USE)
    assert [c.name for c in calls] == ["get_weather"]


def test_splitter_streams_content_and_holds_the_call_split_across_deltas() -> None:
    head = "Sure <tool"
    splitter = ToolCallSplitter()
    sent = [splitter.push(head[i : i + 3]) for i in range(0, len(head), 3)]
    sent += [splitter.push(CALL[len("<tool") :])]
    assert "".join(sent) == "Sure "
    rest, calls, content = splitter.finish(USE)
    assert rest == ""
    assert content == "Sure"
    assert [c.name for c in calls] == ["get_weather"]


def test_splitter_releases_a_false_alarm() -> None:
    splitter = ToolCallSplitter()
    assert splitter.push("a <tool") == "a "
    assert splitter.push("box> b") == "<toolbox> b"
    assert splitter.finish(USE) == ("", (), None)
    broken = ToolCallSplitter()
    assert broken.push("x <tool_call> oops") == "x "
    assert broken.finish(USE) == ("<tool_call> oops", (), None)
