"""Tools: `tools`/`tool_choice` validated in, Hermes `<tool_call>` blocks parsed out.

The chat template shows the tools to the model (see `proxy.tinymodel`), which
answers with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks. `ToolCallSplitter` streams the text before the first block as
content and holds the rest back; at the end `parse_tool_calls` turns the
blocks into OpenAI `tool_calls`. Text that does not parse as a call of one
of the offered tools stays content (tool_choice "auto" takes whatever the
model wrote); forced calls are made parseable by the grammar in `structured`.
"""

from __future__ import annotations

import json
import re
import uuid

from proxy.fallback.api.errors import invalid, unsupported
from proxy.fallback.api.reading import Body, json_text, wrong_type
from proxy.fallback.protocol import Tool, ToolCall, ToolChoiceMode, ToolUse

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


# --- request side ------------------------------------------------------------------------


def _parse_tool(i: int, raw: object) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise wrong_type(param, "an object", raw)
    if raw.get("type", "function") != "function":
        raise unsupported(f"{param}.type", "Only function tools are supported.")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise wrong_type(f"{param}.function", "an object", function)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'.",
            f"{param}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise wrong_type(f"{param}.function.description", "a string", description)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise wrong_type(f"{param}.function.parameters", "an object", parameters)
    return Tool(name, description, None if parameters is None else json_text(parameters))


def _parse_choice(value: object, tools: tuple[Tool, ...]) -> tuple[ToolChoiceMode, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        mode: ToolChoiceMode = value
        if mode == "required" and not tools:
            raise invalid("tool_choice 'required' needs 'tools'.", "tool_choice")
        return mode, None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise wrong_type("tool_choice.function.name", "a string", name)
        if name not in {t.name for t in tools}:
            raise invalid(f"tool_choice names '{name}', which is not in 'tools'.", "tool_choice")
        return "function", name
    raise invalid(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )


def parse_tools(b: Body) -> tuple[Tool, ...]:
    raw = b.raw("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise wrong_type("tools", "an array", raw)
    tools = tuple(_parse_tool(i, t) for i, t in enumerate(raw))
    if len({t.name for t in tools}) != len(tools):
        raise invalid("Tool names must be unique.", "tools")
    return tools


def parse_tool_use(b: Body) -> ToolUse:
    tools = parse_tools(b)
    mode, forced = _parse_choice(b.raw("tool_choice"), tools)
    return ToolUse(tools, mode, forced, b.bool_("parallel_tool_calls", True))


# --- response side -----------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_block(body: str, names: set[str]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(new_call_id(), str(call["name"]), text)


def parse_tool_calls(text: str, tool_use: ToolUse) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content, calls) of a finished output; no calls unless every block parses."""
    start = text.find(OPEN)
    if start < 0:
        return text, ()
    names = {t.name for t in tool_use.tools}
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text, start):
        body = match.group(1).strip()
        if match.end() == len(text):  # the last block may end in a cut-off close tag
            body = next(
                (
                    body[: -len(CLOSE[:k])]
                    for k in range(len(CLOSE), 0, -1)
                    if body.endswith(CLOSE[:k])
                ),
                body,
            ).strip()
        call = _parse_block(body, names)
        if call is None:
            return text, ()
        calls.append(call)
    if not tool_use.parallel:
        calls = calls[:1]
    content = text[:start].strip()
    return (content or None), tuple(calls)


_NAME_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)(")?')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def partial_call(text: str, tool_use: ToolUse) -> ToolCall | None:
    """The forced call `max_tokens` cut short: its name and the arguments so far.

    What vLLM answers for a forced call cut by the limit (`finish_reason:
    "length"`): a tool call whose `arguments` is the JSON written so far, not
    the `<tool_call>` markup as content. None when not even the function's name
    is known (tool_choice "required" cut before the name was written).
    """
    start = text.find(OPEN)
    body = text[start + len(OPEN) :] if start >= 0 else ""
    name = tool_use.forced
    match = _NAME_SO_FAR.match(body)
    if name is None and match is not None:
        names = [t.name for t in tool_use.tools]
        written = match.group(1)
        if match.group(2) and written in names:
            name = written
        elif len(started := [n for n in names if n.startswith(written)]) == 1:
            name = started[0]
    if name is None:
        return None
    arguments = _ARGUMENTS.search(body)
    return ToolCall(new_call_id(), name, body[arguments.end() :] if arguments else "")


class ToolCallSplitter:
    """Streams content up to the first `<tool_call>` and holds back everything after."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.text = ""  # everything seen, for the final parse

    def push(self, delta: str) -> str:
        """The content that is safe to send now."""
        self.text += delta
        if self._in_call:
            return ""
        buffer = self._held + delta
        index = buffer.find(OPEN)
        if index >= 0:
            self._in_call = True
            self._held = ""
            return buffer[:index]
        keep = next(
            (k for k in range(min(len(OPEN) - 1, len(buffer)), 0, -1) if buffer.endswith(OPEN[:k])),
            0,
        )
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def finish(
        self, tool_use: ToolUse, *, cut: bool = False
    ) -> tuple[str, tuple[ToolCall, ...], str | None]:
        """(content still to send, calls, the whole answer's content): held text, parsed.

        `cut`: the output ended on `max_tokens`. A forced call cut short comes back
        as that call with its partial arguments (`partial_call`), never as markup.
        """
        if cut and tool_use.constrained:
            content, calls = parse_tool_calls(self.text, tool_use) if self._in_call else (None, ())
            if calls:
                return "", calls, content
            self._held = ""
            call = partial_call(self.text, tool_use)
            return "", (() if call is None else (call,)), None
        if not self._in_call:
            held, self._held = self._held, ""
            return held, (), None
        content, calls = parse_tool_calls(self.text, tool_use)
        if not calls:  # not a call after all: the held-back text is content
            return self.text[self.text.find(OPEN) :], (), None
        return "", calls, content
