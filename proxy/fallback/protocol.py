"""OpenAI request validation and response shaping.

Parsing turns untrusted JSON into frozen dataclasses or raises `APIError`
(400). Parameters that would change the answer in a way this server cannot
honour (tools, logprobs, n > 1, structured output, penalties) are rejected
rather than silently ignored; fields that do not affect generation (`user`,
`metadata`, `store`, ...) are ignored.

Shaping builds responses in the layout vLLM sends: `finish_reason` and
`logprobs` present as null in intermediate chunks, `usage` only in
non-streaming bodies and in the final `include_usage` chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from proxy.fallback.errors import APIError, invalid, unsupported

FinishReason = Literal["stop", "length"]

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# vLLM's structured-output extensions: honouring them needs a grammar engine.
_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


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
class Message:
    role: str
    content: str

    def as_template_input(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[Message, ...]
    add_generation_prompt: bool
    continue_final_message: bool
    stream: bool
    include_usage: bool
    sampling: SamplingParams


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]
    add_special_tokens: bool
    stream: bool
    include_usage: bool
    sampling: SamplingParams


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    messages: tuple[Message, ...] | None
    prompt: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool


# --- field access with OpenAI-style error messages ---------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(name: str, expected: str, value: object) -> APIError:
    return invalid(
        f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.",
        name,
        code="invalid_type",
    )


class _Body:
    """Typed reads from a request object; absent and null read as None."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    def raw(self, name: str) -> Any:
        return self._data.get(name)

    def has(self, name: str) -> bool:
        return self._data.get(name) is not None

    def str_(self, name: str) -> str | None:
        value = self._data.get(name)
        if value is None or isinstance(value, str):
            return value
        raise _wrong_type(name, "a string", value)

    def bool_(self, name: str, default: bool) -> bool:
        value = self._data.get(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        raise _wrong_type(name, "a boolean", value)

    def int_(
        self, name: str, *, min_value: int | None = None, max_value: int | None = None
    ) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        # JSON has one number type; 3.0 is an integer to most clients.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(name, "an integer", value)
        if min_value is not None and value < min_value:
            raise invalid(f"'{name}' must be at least {min_value}, got {value}.", name)
        if max_value is not None and value > max_value:
            raise invalid(f"'{name}' must be at most {max_value}, got {value}.", name)
        return value

    def float_(
        self,
        name: str,
        *,
        min_value: float | None = None,
        max_value: float | None = None,
        exclusive_min: bool = False,
    ) -> float | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(name, "a number", value)
        number = float(value)
        if min_value is not None and (
            number < min_value or (exclusive_min and number == min_value)
        ):
            bound = "greater than" if exclusive_min else "at least"
            raise invalid(f"'{name}' must be {bound} {min_value}, got {number}.", name)
        if max_value is not None and number > max_value:
            raise invalid(f"'{name}' must be at most {max_value}, got {number}.", name)
        return number


def _require_object(data: object) -> _Body:
    if not isinstance(data, dict):
        raise invalid("The request body must be a JSON object.", None, code="invalid_type")
    return _Body(data)


# --- shared parameter groups -------------------------------------------------------------


def _reject_unsupported(b: _Body, *, chat: bool) -> None:
    for name in ("n", "best_of"):
        if b.int_(name, min_value=1) not in (None, 1):
            raise unsupported(name, f"Only '{name}': 1 is supported by this server.")
    if b.raw("tools") not in (None, []):
        raise unsupported("tools", "Tool calling is not supported by this server.")
    if b.raw("tool_choice") not in (None, "none", "auto"):
        raise unsupported("tool_choice", "Tool calling is not supported by this server.")
    for name in ("functions", "function_call", "audio", *_GUIDED):
        if b.has(name):
            raise unsupported(name)
    # Chat's `logprobs` is a boolean; the legacy completions' is a count (0 included).
    wants_logprobs = b.raw("logprobs") not in (None, False) if chat else b.has("logprobs")
    if wants_logprobs:
        raise unsupported("logprobs", "Log probabilities are not supported by this server.")
    if b.raw("top_logprobs") not in (None, 0):
        raise unsupported("top_logprobs", "Log probabilities are not supported by this server.")
    if b.raw("echo") not in (None, False):
        raise unsupported("echo")
    if b.raw("suffix") not in (None, ""):
        raise unsupported("suffix")
    if b.raw("logit_bias") not in (None, {}):
        raise unsupported("logit_bias")
    fmt = b.raw("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise unsupported("response_format", "Only response_format {'type': 'text'} is supported.")
    for name in ("presence_penalty", "frequency_penalty"):
        if b.float_(name, min_value=-2.0, max_value=2.0) not in (None, 0.0):
            raise unsupported(name, f"'{name}' other than 0 is not supported by this server.")


def _parse_stop(b: _Body) -> tuple[str, ...]:
    value = b.raw("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _wrong_type("stop", "a string or an array of strings", value)
    if any(s == "" for s in items):
        raise invalid("Stop strings must not be empty.", "stop")
    return tuple(dict.fromkeys(items))


def _parse_token_ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise _wrong_type(name, "an array of integers", value)
    if any(i < 0 for i in value):
        raise invalid(f"'{name}' must contain non-negative token ids.", name)
    return tuple(value)


def _parse_sampling(b: _Body) -> SamplingParams:
    # `max_completion_tokens` is the newer name; it wins when both are sent.
    max_tokens = b.int_("max_completion_tokens", min_value=1)
    if max_tokens is None:
        max_tokens = b.int_("max_tokens", min_value=1)
    temperature = b.float_("temperature", min_value=0.0)
    top_p = b.float_("top_p", min_value=0.0, max_value=1.0, exclusive_min=True)
    top_k = b.int_("top_k", min_value=-1)
    min_tokens = b.int_("min_tokens", min_value=0)
    penalty = b.float_("repetition_penalty", min_value=0.0, exclusive_min=True)
    stop_ids = b.raw("stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),  # vLLM spells "disabled" as -1
        seed=b.int_("seed", min_value=_SEED_MIN, max_value=_SEED_MAX),
        stop=_parse_stop(b),
        stop_token_ids=() if stop_ids is None else _parse_token_ids(stop_ids, "stop_token_ids"),
        min_tokens=min_tokens or 0,
        ignore_eos=b.bool_("ignore_eos", False),
        repetition_penalty=1.0 if penalty is None else penalty,
    )


def _parse_stream(b: _Body) -> tuple[bool, bool]:
    stream = b.bool_("stream", False)
    options = b.raw("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    return stream, _Body(options).bool_("include_usage", False)


def _text_content(value: object, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise _wrong_type(f"{param}[{i}]", "an object", part)
        if part.get("type") != "text":
            raise unsupported(f"{param}[{i}].type", "Only text content parts are supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{param}[{i}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)  # vLLM joins text parts with newlines too


def _parse_messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise _wrong_type("messages", "an array", value)
    if not value:
        raise invalid("'messages' must contain at least one message.", "messages")
    messages: list[Message] = []
    for i, raw in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise _wrong_type(param, "an object", raw)
        role = raw.get("role")
        if role in ("tool", "function"):
            raise unsupported(f"{param}.role", "Tool messages are not supported by this server.")
        if not isinstance(role, str) or role not in _ROLES:
            raise invalid(
                f"Invalid role for '{param}': expected one of system, developer, user, "
                f"assistant, got {role!r}.",
                f"{param}.role",
            )
        if raw.get("tool_calls"):
            raise unsupported(f"{param}.tool_calls", "Tool calls are not supported.")
        content = _text_content(raw.get("content"), f"{param}.content")
        messages.append(Message(role=_ROLES[role], content=content))
    return tuple(messages)


def _parse_chat_flags(b: _Body, messages: tuple[Message, ...]) -> tuple[bool, bool]:
    continue_final = b.bool_("continue_final_message", False)
    # Continuing implies no new assistant header, so an unset flag defaults off.
    add_generation = b.bool_("add_generation_prompt", not continue_final)
    if continue_final and add_generation:
        raise invalid(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
            "continue_final_message",
        )
    if continue_final and messages[-1].role != "assistant":
        raise invalid(
            "'continue_final_message' needs the last message to be from the assistant.",
            "continue_final_message",
        )
    return add_generation, continue_final


# --- public parsers ----------------------------------------------------------------------


def parse_chat(data: object) -> ChatRequest:
    b = _require_object(data)
    _reject_unsupported(b, chat=True)
    messages = _parse_messages(b.raw("messages"))
    add_generation, continue_final = _parse_chat_flags(b, messages)
    stream, include_usage = _parse_stream(b)
    return ChatRequest(
        model=b.str_("model"),
        messages=messages,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
        stream=stream,
        include_usage=include_usage,
        sampling=_parse_sampling(b),
    )


def _parse_prompt(value: object) -> str | tuple[int, ...]:
    # One prompt per request: a string, token ids, or a one-element batch of either.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(i, int) for i in value):
        return _parse_token_ids(value, "prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise unsupported("prompt", "Only one prompt per request is supported.")
    raise _wrong_type("prompt", "a string or an array of token ids", value)


def parse_completion(data: object) -> CompletionRequest:
    b = _require_object(data)
    _reject_unsupported(b, chat=False)
    stream, include_usage = _parse_stream(b)
    return CompletionRequest(
        model=b.str_("model"),
        prompt=_parse_prompt(b.raw("prompt")),
        add_special_tokens=b.bool_("add_special_tokens", True),
        stream=stream,
        include_usage=include_usage,
        sampling=_parse_sampling(b),
    )


def parse_tokenize(data: object) -> TokenizeRequest:
    b = _require_object(data)
    if b.has("messages"):
        messages = _parse_messages(b.raw("messages"))
        add_generation, continue_final = _parse_chat_flags(b, messages)
        return TokenizeRequest(
            model=b.str_("model"),
            messages=messages,
            prompt=None,
            add_generation_prompt=add_generation,
            continue_final_message=continue_final,
            # The chat template already contains the special tokens.
            add_special_tokens=b.bool_("add_special_tokens", False),
        )
    prompt = b.str_("prompt")
    if prompt is None:
        raise invalid("Either 'prompt' or 'messages' is required.", "prompt")
    return TokenizeRequest(
        model=b.str_("model"),
        messages=None,
        prompt=prompt,
        add_generation_prompt=False,
        continue_final_message=False,
        add_special_tokens=b.bool_("add_special_tokens", True),
    )


def context_length_error(prompt_tokens: int, max_tokens: int, max_model_len: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
        f"{max_tokens} in the completion). Please reduce the length of the messages or "
        "completion.",
        param="messages",
        code="context_length_exceeded",
    )


def resolve_max_tokens(prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """The completion budget, or a `context_length_exceeded` error (as vLLM does)."""
    room = max_model_len - prompt_tokens
    if requested is None:
        if room < 1:
            raise context_length_error(prompt_tokens, 1, max_model_len)
        return room
    if requested > room:
        raise context_length_error(prompt_tokens, requested, max_model_len)
    return requested


# --- response shaping --------------------------------------------------------------------

JSONObject = dict[str, Any]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_json(self) -> JSONObject:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Shape(Protocol):
    """The objects one endpoint answers with; the handlers are endpoint-agnostic."""

    def start_chunk(self) -> JSONObject | None: ...
    def delta_chunk(self, text: str) -> JSONObject: ...
    def finish_chunk(self, reason: FinishReason) -> JSONObject: ...
    def usage_chunk(self, usage: Usage) -> JSONObject: ...
    def full(self, text: str, reason: FinishReason, usage: Usage) -> JSONObject: ...


class _Envelope:
    """id, created and model: shared by every object of one response."""

    def __init__(self, model: str, prefix: str) -> None:
        self.model = model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def wrap(self, obj: str, choices: list[JSONObject]) -> JSONObject:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


class ChatShape:
    def __init__(self, model: str) -> None:
        self._env = _Envelope(model=model, prefix="chatcmpl")

    def _chunk(self, delta: JSONObject, reason: FinishReason | None) -> JSONObject:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._env.wrap("chat.completion.chunk", [choice])

    def start_chunk(self) -> JSONObject:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta_chunk(self, text: str) -> JSONObject:
        return self._chunk({"content": text}, None)

    def finish_chunk(self, reason: FinishReason) -> JSONObject:
        return self._chunk({}, reason)

    def usage_chunk(self, usage: Usage) -> JSONObject:
        return self._env.wrap("chat.completion.chunk", []) | {"usage": usage.as_json()}

    def full(self, text: str, reason: FinishReason, usage: Usage) -> JSONObject:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
        return self._env.wrap("chat.completion", [choice]) | {"usage": usage.as_json()}


class CompletionShape:
    def __init__(self, model: str) -> None:
        self._env = _Envelope(model=model, prefix="cmpl")

    def _choice(self, text: str, reason: FinishReason | None) -> JSONObject:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def start_chunk(self) -> None:
        return None

    def delta_chunk(self, text: str) -> JSONObject:
        return self._env.wrap("text_completion", [self._choice(text, None)])

    def finish_chunk(self, reason: FinishReason) -> JSONObject:
        return self._env.wrap("text_completion", [self._choice("", reason)])

    def usage_chunk(self, usage: Usage) -> JSONObject:
        return self._env.wrap("text_completion", []) | {"usage": usage.as_json()}

    def full(self, text: str, reason: FinishReason, usage: Usage) -> JSONObject:
        body = self._env.wrap("text_completion", [self._choice(text, reason)])
        return body | {"usage": usage.as_json()}
