"""Every request field, classified: honoured, ignored (harmless) or rejected.

A field the server does not honour is a 400 naming it (`param` = the field),
never silently dropped: rejected fields are accepted only at their neutral
value (`n: 1`, `echo: false`, ...), and a field not listed at all is an
unknown parameter, as OpenAI answers. Fields whose support depends on the
engine (logprobs, structured output, ...) are checked against the engine's
`Capabilities` after parsing, and `/v1/models` advertises the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from proxy.fallback.api.errors import APIError, unsupported
from proxy.fallback.engines.interface import Capabilities
from proxy.fallback.protocol import Output, SamplingParams

Endpoint = Literal["chat", "completions"]

#: Choices per request (`n`): generated one after another in one slot.
MAX_N = 8

_BOTH = ("chat", "completions")

# Honoured: the server does what the field asks (engine permitting, see `check_capabilities`).
_HONOURED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "model": _BOTH,
        "max_tokens": _BOTH,
        "temperature": _BOTH,
        "top_p": _BOTH,
        "n": _BOTH,
        "stream": _BOTH,
        "stream_options": _BOTH,
        "stop": _BOTH,
        "seed": _BOTH,
        "logprobs": _BOTH,
        "logit_bias": _BOTH,
        "presence_penalty": _BOTH,
        "frequency_penalty": _BOTH,
        "response_format": _BOTH,
        "messages": ("chat",),
        "max_completion_tokens": ("chat",),
        "top_logprobs": ("chat",),
        "tools": ("chat",),
        "tool_choice": ("chat",),
        "parallel_tool_calls": ("chat",),
        "prompt": ("completions",),
        # vLLM's extensions
        "top_k": _BOTH,
        "min_tokens": _BOTH,
        "ignore_eos": _BOTH,
        "repetition_penalty": _BOTH,
        "stop_token_ids": _BOTH,
        "add_special_tokens": _BOTH,
        "add_generation_prompt": ("chat",),
        "continue_final_message": ("chat",),
    }
)

# Ignored: bookkeeping, caching and routing hints that cannot change the answer.
_IGNORED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "user": _BOTH,
        "metadata": _BOTH,
        "store": _BOTH,
        "service_tier": _BOTH,
        "prompt_cache_key": _BOTH,
        "prompt_cache_retention": _BOTH,
        "prompt_cache_options": _BOTH,
        "safety_identifier": _BOTH,
        "request_id": _BOTH,
        "priority": _BOTH,  # one FIFO queue here
        "cache_salt": _BOTH,
        # Predicted outputs only speed generation up; the answer is the same.
        "prediction": ("chat",),
    }
)

# Rejected unless neutral: the accepted values (compared with ==).
_REJECTED: Mapping[str, tuple[object, ...]] = MappingProxyType(
    {
        "best_of": (1,),
        "echo": (False,),
        "suffix": ("",),
        "audio": (),
        "modalities": (["text"],),
        "functions": ([],),
        "function_call": ("none",),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
        "moderation": (),  # nothing here moderates input or output
        "use_beam_search": (False,),
        "length_penalty": (1,),
        "min_p": (0,),
        "include_stop_str_in_output": (False,),
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
        "truncate_prompt_tokens": (),
        "prompt_logprobs": (),
        "allowed_token_ids": (),
        "bad_words": ([],),
        "guided_json": (),
        "guided_regex": (),
        "guided_choice": (),
        "guided_grammar": (),
        "guided_decoding_backend": (),
        "guided_whitespace_pattern": (),
        "structured_outputs": (),
        "return_tokens_as_token_ids": (False,),
        "return_token_ids": (False,),
        "documents": (),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "mm_processor_kwargs": ({},),
        "vllm_xargs": ({},),
        "kv_transfer_params": (),
        "logits_processors": (),
    }
)


def honoured_fields(endpoint: Endpoint) -> list[str]:
    return sorted(k for k, v in _HONOURED.items() if endpoint in v)


def ignored_fields(endpoint: Endpoint) -> list[str]:
    return sorted(k for k, v in _IGNORED.items() if endpoint in v)


def check_fields(data: Mapping[str, Any], endpoint: Endpoint) -> None:
    """400 for a field this endpoint does not know or does not honour at that value."""
    for name, value in data.items():
        if value is None:
            continue  # absent and null read the same everywhere
        if endpoint in _HONOURED.get(name, ()) or endpoint in _IGNORED.get(name, ()):
            continue
        accepted = _REJECTED.get(name)
        if accepted is None:
            raise APIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        if not any(_same(value, ok) for ok in accepted):
            neutral = ", ".join(repr(v) for v in accepted) or "absent"
            raise unsupported(
                name, f"'{name}' is not supported by this server (accepted: {neutral})."
            )


def _same(value: object, neutral: object) -> bool:
    # JSON has one number type (0 == 0.0), but a boolean is not a number.
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def check_capabilities(
    caps: Capabilities, sampling: SamplingParams, output: Output, *, chat: bool, grammar: bool
) -> None:
    """400 naming the first field the engine in use cannot honour.

    `grammar`: whether constrained decoding is available at all (xgrammar installed).
    """
    if sampling.seed is not None and not caps.seed:
        raise unsupported("seed", f"'seed' is not supported by the {caps.engine} engine.")
    if output.logprobs is not None:
        if not caps.logprobs:
            raise unsupported(
                "logprobs", f"Log probabilities are not supported by the {caps.engine} engine."
            )
        if output.logprobs > caps.max_top_logprobs:
            name = "top_logprobs" if chat else "logprobs"
            raise unsupported(name, f"'{name}' must be at most {caps.max_top_logprobs}.")
    if not (caps.logits_processors and grammar):
        if output.response_format.kind != "text":
            raise unsupported(
                "response_format",
                f"Structured output is not supported by the {caps.engine} engine.",
            )
        if output.tool_use.constrained:
            raise unsupported(
                "tool_choice",
                f"Forcing a tool call is not supported by the {caps.engine} engine; "
                "use tool_choice 'auto'.",
            )
    if output.logit_bias and not caps.logits_processors:
        raise unsupported("logit_bias", f"Not supported by the {caps.engine} engine.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(output, name) != 0.0 and not caps.logits_processors:
            raise unsupported(name, f"'{name}' is not supported by the {caps.engine} engine.")
    if sampling.repetition_penalty != 1.0 and not caps.repetition_penalty:
        raise unsupported("repetition_penalty", f"Not supported by the {caps.engine} engine.")
    if sampling.min_tokens > 0 and not caps.min_tokens:
        raise unsupported("min_tokens", f"Not supported by the {caps.engine} engine.")


def advertise(caps: Capabilities, *, grammar: bool) -> dict[str, Any]:
    """The `capabilities` object of a model card: what a request may ask of this server."""
    structured = caps.logits_processors and grammar
    gated = {
        "seed": caps.seed,
        "logprobs": caps.logprobs,
        "top_logprobs": caps.logprobs,
        "logit_bias": caps.logits_processors,
        "presence_penalty": caps.logits_processors,
        "frequency_penalty": caps.logits_processors,
        "repetition_penalty": caps.repetition_penalty,
        "min_tokens": caps.min_tokens,
    }

    def fields(endpoint: Endpoint) -> dict[str, list[str]]:
        honoured = [f for f in honoured_fields(endpoint) if gated.get(f, True)]
        return {"honoured": honoured, "ignored": ignored_fields(endpoint)}

    return {
        "engine": caps.engine,
        "continue_final_message": True,
        "n": True,
        "max_n": MAX_N,
        "stop": True,
        "seed": caps.seed,
        "logprobs": caps.logprobs,
        "max_top_logprobs": caps.max_top_logprobs if caps.logprobs else 0,
        "response_format": ["text", "json_object", "json_schema"] if structured else ["text"],
        "tools": True,
        "tool_choice": ["none", "auto", "required", "function"] if structured else ["none", "auto"],
        "parallel_tool_calls": True,
        "logit_bias": caps.logits_processors,
        "penalties": caps.logits_processors,  # presence_penalty, frequency_penalty
        "repetition_penalty": caps.repetition_penalty,
        "min_tokens": caps.min_tokens,
        "chat_completions": fields("chat"),
        "completions": fields("completions"),
    }
