"""What a backend honours of a request, and which fields of a request it does not.

Built once per backend, at discovery (`/v1/models`: the fallback server
advertises a `capabilities` object per model, see
`proxy.fallback.api.fields.advertise`), never per request. `None` stands for "the
whole OpenAI API" (vLLM and OpenAI-compatible backends that advertise
nothing): requests to them are not checked at all.

`unsupported` names every field of a request the backend would not honour —
unknown fields, values beyond the advertised limits (`n`, `top_logprobs`,
`response_format` types, forced `tool_choice`) and non-text content parts —
so the proxy can refuse or drop them explicitly instead of letting an answer
degrade silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Fields that never change what an answer says (bookkeeping, caching, routing hints).
_BOOKKEEPING = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "request_id",
        "priority",
    }
)
# Plain chat / completion: what a fallback that advertises nothing is assumed to honour.
_PLAIN_CHAT = _BOOKKEEPING | {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "continue_final_message",
    "add_generation_prompt",
}
_PLAIN_COMPLETIONS = _BOOKKEEPING | {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
}


# Values that ask for nothing (clients such as LangChain send them by default):
# a backend honours them whether it knows the field or not.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "stop": ([],),
    "tools": ([],),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "echo": (False,),
    "best_of": (1,),
    "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
}


def _neutral(name: str, value: object, body: Mapping[str, Any]) -> bool:
    if name in ("tool_choice", "parallel_tool_calls") and not body.get("tools"):
        return name == "parallel_tool_calls" or value in ("none", "auto")
    return any(
        value == ok and isinstance(value, bool) is isinstance(ok, bool)
        for ok in _NEUTRAL.get(name, ())
    )


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one backend honours (frozen: shared by every request)."""

    chat: frozenset[str]
    completions: frozenset[str]
    response_format: frozenset[str] = frozenset({"text"})
    tool_choice: frozenset[str] = frozenset({"none", "auto"})
    max_n: int = 1
    max_top_logprobs: int = 0
    content_parts: frozenset[str] = frozenset({"text"})
    continuation: bool | None = None  # continue_final_message, when advertised

    def unsupported(self, body: Mapping[str, Any], chat: bool) -> list[str]:
        """The request's fields this backend would not honour ([] in the common case)."""
        known = self.chat if chat else self.completions
        out = [
            k
            for k, v in body.items()
            if v is not None and k not in known and not _neutral(k, v, body)
        ]
        n = body.get("n")
        if isinstance(n, int) and n > self.max_n:
            out.append("n")
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type", "text") not in self.response_format:
            out.append("response_format")
        tc = body.get("tool_choice")
        tc_kind = "function" if isinstance(tc, dict) else tc
        if isinstance(tc_kind, str) and tc_kind not in self.tool_choice:
            out.append("tool_choice")
        top = body.get("top_logprobs" if chat else "logprobs")
        if isinstance(top, int) and not isinstance(top, bool) and top > self.max_top_logprobs:
            out.append("top_logprobs" if chat else "logprobs")
        if chat:
            out.extend(part_fields(body.get("messages"), self.content_parts))
        return list(dict.fromkeys(out))  # each field once, in order


def part_fields(messages: object, allowed: frozenset[str]) -> list[str]:
    """`messages[].content[type=X]` for each content part type not in `allowed`."""
    if not isinstance(messages, list):
        return []
    seen: list[str] = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue  # a plain string: the common case
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                name = f"messages[].content[type={kind}]"
                if name not in seen:
                    seen.append(name)
    return seen


def without(body: dict[str, Any], fields: list[str], allowed: frozenset[str]) -> dict[str, Any]:
    """`body` with `fields` removed (`drop` policy): unknown fields deleted,
    over-limit values set to their neutral value, foreign content parts cut."""
    out = dict(body)
    for name in fields:
        if name == "n":
            out["n"] = 1
        elif name.startswith("messages[]"):
            out["messages"] = [_text_parts(m, allowed) for m in out["messages"]]
        else:
            out.pop(name, None)
    return out


def _text_parts(message: Any, allowed: frozenset[str]) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    kept = [p for p in content if isinstance(p, dict) and p.get("type") in allowed]
    return {**message, "content": kept}


#: A transformers fallback that advertises nothing: plain chat only.
PLAIN = Capabilities(_PLAIN_CHAT, _PLAIN_COMPLETIONS, continuation=True)


def from_model_card(card: Mapping[str, Any]) -> Capabilities | None:
    """The capabilities a `/v1/models` entry advertises (None: none advertised)."""
    caps = card.get("capabilities")
    if not isinstance(caps, dict):
        return None

    def names(endpoint: str, fallback: frozenset[str]) -> frozenset[str]:
        spec = caps.get(endpoint)
        if not isinstance(spec, dict):
            return fallback
        items = [*spec.get("honoured", ()), *spec.get("ignored", ())]
        return frozenset(x for x in items if isinstance(x, str))

    def strings(key: str, default: frozenset[str]) -> frozenset[str]:
        v = caps.get(key)
        if isinstance(v, list):
            return frozenset(x for x in v if isinstance(x, str))
        if v is True:
            return default | {"required", "function"} if key == "tool_choice" else default
        return default

    def integer(key: str, default: int) -> int:
        v = caps.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else default

    cont = caps.get("continue_final_message")
    return Capabilities(
        chat=names("chat_completions", _PLAIN_CHAT),
        completions=names("completions", _PLAIN_COMPLETIONS),
        response_format=strings("response_format", frozenset({"text"})),
        tool_choice=strings("tool_choice", frozenset({"none", "auto"})),
        max_n=integer("max_n", 8 if caps.get("n") is True else 1),
        max_top_logprobs=integer("max_top_logprobs", 0),
        content_parts=strings("content_parts", frozenset({"text"})),
        continuation=cont if isinstance(cont, bool) else None,
    )
