"""The requests the fallback server understands, as frozen dataclasses.

`parsing` turns untrusted JSON into these (or a 400 naming the field),
`fields` says which request fields are honoured, ignored or rejected,
`shapes` renders the answers. The engines only see `SamplingParams`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls"]
ToolChoiceMode = Literal["none", "auto", "required", "function"]
FormatKind = Literal["text", "json_object", "json_schema"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: whatever the context window leaves
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class ToolCall:
    """An assistant's call of a function; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant or tool ("developer" arrives as system)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_json() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is a JSON Schema, kept as JSON text."""

    name: str
    description: str | None
    parameters: str | None

    def as_template_input(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """`tools` + `tool_choice` + `parallel_tool_calls`, validated together."""

    tools: tuple[Tool, ...] = ()
    mode: ToolChoiceMode = "none"
    forced: str | None = None  # the function's name when mode == "function"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is shown tools and its output is parsed for calls."""
        return bool(self.tools) and self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether the output must be a tool call (forced through the grammar)."""
        return self.active and self.mode in ("required", "function")


@dataclass(frozen=True)
class ResponseFormat:
    kind: FormatKind = "text"
    schema: str | None = None  # JSON text of json_schema.schema
    strict: bool = False


@dataclass(frozen=True)
class Output:
    """What shapes the answer besides sampling: choices, logprobs, structure."""

    n: int = 1
    logprobs: int | None = None  # None: off; k: chosen token plus the k most likely
    response_format: ResponseFormat = ResponseFormat()
    tool_use: ToolUse = ToolUse()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def needs_grammar(self) -> bool:
        return self.response_format.kind != "text" or self.tool_use.constrained

    @property
    def needs_logits_processors(self) -> bool:
        return self.needs_grammar or bool(self.logit_bias) or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[Message, ...]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    output: Output = Output()


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]
    add_special_tokens: bool
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    output: Output = Output()


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    messages: tuple[Message, ...] | None
    prompt: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    tools: tuple[Tool, ...] = ()
