"""Response rendering: the objects each endpoint answers with, in vLLM's layout.

`finish_reason` and `logprobs` are present as null in intermediate chunks,
`usage` only in non-streaming bodies and in the final `include_usage`
chunk. Every choice carries its `index` (n > 1), streamed chunks too.
Logprobs come in OpenAI's shapes: chat's `{"content": [{token, logprob,
bytes, top_logprobs}]}` and the legacy completions' `{tokens,
token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.fallback.engines.interface import TokenLogprob
from proxy.fallback.protocol import FinishReason, ToolCall

JSONObject = dict[str, Any]
TokenText = Callable[[int], tuple[str, bytes]]


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


@dataclass
class ChoiceResult:
    """One finished choice of a non-streaming answer."""

    text: str | None
    reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # None: not asked for
    tool_calls: tuple[ToolCall, ...] = field(default=())


class Shape(Protocol):
    """The objects one endpoint answers with; the generation flow is endpoint-agnostic."""

    def start_chunk(self, index: int) -> JSONObject | None: ...
    def delta_chunk(
        self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None
    ) -> JSONObject: ...
    def tool_calls_chunk(self, index: int, calls: Sequence[ToolCall]) -> JSONObject: ...
    def finish_chunk(self, index: int, reason: FinishReason) -> JSONObject: ...
    def usage_chunk(self, usage: Usage) -> JSONObject: ...
    def full(self, choices: Sequence[ChoiceResult], usage: Usage) -> JSONObject: ...


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


def _entry(token_text: TokenText, token_id: int, logprob: float) -> JSONObject:
    token, raw = token_text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(raw)}


class ChatShape:
    def __init__(self, model: str, token_text: TokenText) -> None:
        self._env = _Envelope(model=model, prefix="chatcmpl")
        self._token_text = token_text

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> JSONObject | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            entry = _entry(self._token_text, lp.token_id, lp.logprob)
            entry["top_logprobs"] = [_entry(self._token_text, i, v) for i, v in lp.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chunk(
        self,
        index: int,
        delta: JSONObject,
        reason: FinishReason | None,
        logprobs: JSONObject | None = None,
    ) -> JSONObject:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._env.wrap("chat.completion.chunk", [choice])

    def start_chunk(self, index: int) -> JSONObject:
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def delta_chunk(
        self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None
    ) -> JSONObject:
        return self._chunk(index, {"content": text}, None, self._logprobs(logprobs))

    def tool_calls_chunk(self, index: int, calls: Sequence[ToolCall]) -> JSONObject:
        deltas = [{"index": k, **call.as_json()} for k, call in enumerate(calls)]
        return self._chunk(index, {"tool_calls": deltas}, None)

    def finish_chunk(self, index: int, reason: FinishReason) -> JSONObject:
        return self._chunk(index, {}, reason)

    def usage_chunk(self, usage: Usage) -> JSONObject:
        return self._env.wrap("chat.completion.chunk", []) | {"usage": usage.as_json()}

    def full(self, choices: Sequence[ChoiceResult], usage: Usage) -> JSONObject:
        rendered = []
        for index, choice in enumerate(choices):
            message: JSONObject = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                message["tool_calls"] = [call.as_json() for call in choice.tool_calls]
            rendered.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._logprobs(choice.logprobs),
                    "finish_reason": choice.reason,
                }
            )
        return self._env.wrap("chat.completion", rendered) | {"usage": usage.as_json()}


class CompletionShape:
    def __init__(self, model: str, token_text: TokenText) -> None:
        self._env = _Envelope(model=model, prefix="cmpl")
        self._token_text = token_text
        self._offsets: dict[int, int] = {}  # per choice: characters rendered so far

    def _logprobs(self, index: int, logprobs: Sequence[TokenLogprob] | None) -> JSONObject | None:
        if logprobs is None:
            return None
        block: JSONObject = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        offset = self._offsets.get(index, 0)
        for lp in logprobs:
            token, _ = self._token_text(lp.token_id)
            block["tokens"].append(token)
            block["token_logprobs"].append(lp.logprob)
            top = {self._token_text(i)[0]: v for i, v in lp.top}
            block["top_logprobs"].append({token: lp.logprob} | top)
            block["text_offset"].append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return block

    def _choice(
        self, index: int, text: str, reason: FinishReason | None, logprobs: JSONObject | None
    ) -> JSONObject:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def start_chunk(self, index: int) -> None:
        return None

    def delta_chunk(
        self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None
    ) -> JSONObject:
        choice = self._choice(index, text, None, self._logprobs(index, logprobs))
        return self._env.wrap("text_completion", [choice])

    def tool_calls_chunk(self, index: int, calls: Sequence[ToolCall]) -> JSONObject:
        raise TypeError("completions have no tool calls")

    def finish_chunk(self, index: int, reason: FinishReason) -> JSONObject:
        return self._env.wrap("text_completion", [self._choice(index, "", reason, None)])

    def usage_chunk(self, usage: Usage) -> JSONObject:
        return self._env.wrap("text_completion", []) | {"usage": usage.as_json()}

    def full(self, choices: Sequence[ChoiceResult], usage: Usage) -> JSONObject:
        rendered = [
            self._choice(i, c.text or "", c.reason, self._logprobs(i, c.logprobs))
            for i, c in enumerate(choices)
        ]
        return self._env.wrap("text_completion", rendered) | {"usage": usage.as_json()}
