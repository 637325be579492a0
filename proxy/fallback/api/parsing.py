"""OpenAI request validation: untrusted JSON in, frozen dataclasses out (or a 400).

Every field goes through `fields.check_fields` first, so a field this server
does not honour is a 400 naming it rather than silently ignored; what the
engine in use can do is checked later (`fields.check_capabilities`).
"""

from __future__ import annotations

from proxy.fallback.api.errors import APIError, invalid, unsupported
from proxy.fallback.api.fields import MAX_N, Endpoint, check_fields
from proxy.fallback.api.reading import Body, json_text, require_object, wrong_type
from proxy.fallback.features.schemalimits import check_schema
from proxy.fallback.features.tools import parse_tool_use, parse_tools
from proxy.fallback.protocol import (
    ChatRequest,
    CompletionRequest,
    Message,
    Output,
    ResponseFormat,
    SamplingParams,
    TokenizeRequest,
    ToolCall,
)

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the engine may allow fewer
# Every stop string is looked for after every token, on the event loop for the
# batched engine: 100,000 of them (a 1.6 MB body) stalled every stream for 5 s.
# OpenAI takes 4.
MAX_STOPS = 64
# Upper bounds where neither OpenAI nor vLLM set one and a huge value breaks the
# numbers: a temperature or repetition_penalty of 1e300 is inf in float32, and a
# logit divided by (or multiplied with) inf is nan, or 0 * inf. Past 100 the
# temperature samples uniformly anyway; a penalty of 100 already bans a token.
MAX_TEMPERATURE = 100.0
# repetition_penalty: Transformers divides positive logits by it, so 1e-300 made
# them inf and sampling failed on nan ("probability tensor contains either inf,
# nan or element < 0": a 500). 0.01 multiplies them by 100 at most.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# vLLM's `_SAMPLING_EPS`: a lower temperature is greedy. Dividing the logits by a
# temperature that rounds to 0 in float32 makes them inf/nan, which kills the
# batched engine's loop (every later request a 503) and fails the threads engine.
_GREEDY_BELOW = 1e-5


# --- sampling ----------------------------------------------------------------------------


def _parse_stop(b: Body) -> tuple[str, ...]:
    value = b.raw("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise wrong_type("stop", "a string or an array of strings", value)
    if any(s == "" for s in items):
        raise invalid("Stop strings must not be empty.", "stop")
    stops = tuple(dict.fromkeys(items))
    if len(stops) > MAX_STOPS:
        raise invalid(f"At most {MAX_STOPS} stop strings are supported, got {len(stops)}.", "stop")
    return stops


def _parse_token_ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise wrong_type(name, "an array of integers", value)
    if any(i < 0 for i in value):
        raise invalid(f"'{name}' must contain non-negative token ids.", name)
    return tuple(value)


def _parse_sampling(b: Body) -> SamplingParams:
    # `max_completion_tokens` is the newer name; it wins when both are sent.
    max_tokens = b.int_("max_completion_tokens", min_value=1)
    if max_tokens is None:
        max_tokens = b.int_("max_tokens", min_value=1)
    temperature = b.float_("temperature", min_value=0.0, max_value=MAX_TEMPERATURE)
    top_p = b.float_("top_p", min_value=0.0, max_value=1.0, exclusive_min=True)
    top_k = b.int_("top_k", min_value=-1)
    min_tokens = b.int_("min_tokens", min_value=0)
    penalty = b.float_(
        "repetition_penalty",
        min_value=MIN_REPETITION_PENALTY,
        max_value=MAX_REPETITION_PENALTY,
    )
    stop_ids = b.raw("stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else _greedy_if_tiny(temperature),
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),  # vLLM spells "disabled" as -1
        seed=b.int_("seed", min_value=_SEED_MIN, max_value=_SEED_MAX),
        stop=_parse_stop(b),
        stop_token_ids=() if stop_ids is None else _parse_token_ids(stop_ids, "stop_token_ids"),
        min_tokens=min_tokens or 0,
        ignore_eos=b.bool_("ignore_eos", False),
        repetition_penalty=1.0 if penalty is None else penalty,
    )


def _greedy_if_tiny(temperature: float) -> float:
    return 0.0 if temperature < _GREEDY_BELOW else temperature


def _parse_stream(b: Body) -> tuple[bool, bool]:
    stream = b.bool_("stream", False)
    options = b.raw("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    opts = Body(options)
    # include_obfuscation only pads chunks against side channels: harmless to leave out.
    if opts.bool_("continuous_usage_stats", False):
        raise unsupported(
            "stream_options.continuous_usage_stats", "Usage in every chunk is not supported."
        )
    unknown = sorted(
        set(options) - {"include_usage", "include_obfuscation", "continuous_usage_stats"}
    )
    if unknown:
        raise APIError(
            400,
            f"Unrecognized request argument supplied: stream_options.{unknown[0]}",
            param=f"stream_options.{unknown[0]}",
            code="unknown_parameter",
        )
    return stream, opts.bool_("include_usage", False)


# --- output: n, logprobs, response_format, tools, logit_bias -----------------------------


def _parse_logprobs(b: Body, endpoint: Endpoint) -> int | None:
    if endpoint == "completions":  # the legacy API's `logprobs` is the count itself
        return b.int_("logprobs", min_value=0, max_value=_MAX_TOP_LOGPROBS)
    wanted = b.bool_("logprobs", False)
    top = b.int_("top_logprobs", min_value=0, max_value=_MAX_TOP_LOGPROBS)
    if top and not wanted:  # 0 without logprobs is harmless
        raise invalid("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if wanted else None


def _parse_response_format(b: Body) -> ResponseFormat:
    value = b.raw("response_format")
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict):
        raise wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise invalid(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object", spec)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "an object", schema)
    strict = spec.get("strict")
    text = json_text(schema)
    check_schema(text, "response_format")
    return ResponseFormat("json_schema", text, strict is True)


def _parse_logit_bias(b: Body) -> tuple[tuple[int, float], ...]:
    value = b.raw("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object", value)
    bias: list[tuple[int, float]] = []
    for key, raw in value.items():
        # ASCII only: str.isdigit() takes '²' (which int() refuses) and other scripts'
        # digits; past 10 digits no id is in any vocabulary (and int() has a digit limit).
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"logit_bias key {key[:20]!r} is not a token id.", "logit_bias")
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not -100 <= raw <= 100:
            raise invalid("logit_bias values must be numbers from -100 to 100.", "logit_bias")
        bias.append((int(key), float(raw)))
    return tuple(bias)


def _parse_output(b: Body, endpoint: Endpoint) -> Output:
    n = b.int_("n", min_value=1, max_value=MAX_N)
    output = Output(
        n=n or 1,
        logprobs=_parse_logprobs(b, endpoint),
        response_format=_parse_response_format(b),
        tool_use=parse_tool_use(b) if endpoint == "chat" else Output().tool_use,
        logit_bias=_parse_logit_bias(b),
        presence_penalty=b.float_("presence_penalty", min_value=-2.0, max_value=2.0) or 0.0,
        frequency_penalty=b.float_("frequency_penalty", min_value=-2.0, max_value=2.0) or 0.0,
    )
    if output.tool_use.constrained and output.response_format.kind != "text":
        raise invalid("A forced tool call and 'response_format' cannot be combined.", "tool_choice")
    if output.tool_use.constrained:  # the tools' parameters become one grammar
        schemas = [t.parameters or "{}" for t in output.tool_use.tools]
        check_schema("[" + ",".join(schemas) + "]", "tools")
    return output


# --- messages ----------------------------------------------------------------------------


def _text_content(value: object, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise wrong_type(f"{param}[{i}]", "an object", part)
        if part.get("type") != "text":
            raise unsupported(f"{param}[{i}].type", "Only text content parts are supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise wrong_type(f"{param}[{i}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)  # vLLM joins text parts with newlines too


def _parse_tool_calls(value: object, param: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    calls: list[ToolCall] = []
    for i, raw in enumerate(value):
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or not isinstance(function, dict):
            raise wrong_type(f"{param}[{i}]", "a function tool call object", raw)
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise wrong_type(f"{param}[{i}].function", "a name and JSON arguments string", raw)
        calls.append(ToolCall(str(raw.get("id", "")), name, arguments))
    return tuple(calls)


def _parse_message(i: int, raw: object) -> Message:
    param = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise wrong_type(param, "an object", raw)
    role = raw.get("role")
    if role == "function" or raw.get("function_call") is not None:
        raise unsupported(f"{param}.role", "Function messages are deprecated; use tools.")
    if raw.get("audio") is not None:
        raise unsupported(f"{param}.audio", "Audio is not supported by this server.")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(
            f"Invalid role for '{param}': expected one of system, developer, user, "
            f"assistant, tool, got {role!r}.",
            f"{param}.role",
        )
    tool_calls = _parse_tool_calls(raw.get("tool_calls"), f"{param}.tool_calls")
    if tool_calls and role != "assistant":
        raise invalid("Only assistant messages carry 'tool_calls'.", f"{param}.tool_calls")
    tool_call_id = raw.get("tool_call_id")
    if role == "tool" and not isinstance(tool_call_id, str):
        raise wrong_type(f"{param}.tool_call_id", "a string", tool_call_id)
    return Message(
        role=_ROLES[role],
        content=_text_content(raw.get("content"), f"{param}.content"),
        tool_calls=tool_calls,
        tool_call_id=tool_call_id if role == "tool" else None,
    )


def _parse_messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise wrong_type("messages", "an array", value)
    if not value:
        raise invalid("'messages' must contain at least one message.", "messages")
    return tuple(_parse_message(i, raw) for i, raw in enumerate(value))


def _parse_chat_flags(b: Body, messages: tuple[Message, ...]) -> tuple[bool, bool]:
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


def _check_combination(sampling: SamplingParams, output: Output) -> None:
    # vLLM's check (only against a max_tokens the client gave).
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        raise invalid(
            f"'min_tokens' must be at most max_tokens={sampling.max_tokens}, "
            f"got {sampling.min_tokens}.",
            "min_tokens",
        )
    # A grammar ends on an end token; ignore_eos (min_tokens) would leave nothing to sample.
    if output.needs_grammar and (sampling.ignore_eos or sampling.min_tokens):
        name = "ignore_eos" if sampling.ignore_eos else "min_tokens"
        raise invalid(f"'{name}' cannot be combined with constrained output.", name)


def parse_chat(data: object) -> ChatRequest:
    b = require_object(data)
    check_fields(b.data, "chat")
    messages = _parse_messages(b.raw("messages"))
    add_generation, continue_final = _parse_chat_flags(b, messages)
    stream, include_usage = _parse_stream(b)
    sampling, output = _parse_sampling(b), _parse_output(b, "chat")
    _check_combination(sampling, output)
    return ChatRequest(
        model=b.str_("model"),
        messages=messages,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
        add_special_tokens=b.bool_("add_special_tokens", False),
        stream=stream,
        include_usage=include_usage,
        sampling=sampling,
        output=output,
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
    raise wrong_type("prompt", "a string or an array of token ids", value)


def parse_completion(data: object) -> CompletionRequest:
    b = require_object(data)
    check_fields(b.data, "completions")
    stream, include_usage = _parse_stream(b)
    sampling, output = _parse_sampling(b), _parse_output(b, "completions")
    _check_combination(sampling, output)
    return CompletionRequest(
        model=b.str_("model"),
        prompt=_parse_prompt(b.raw("prompt")),
        add_special_tokens=b.bool_("add_special_tokens", True),
        stream=stream,
        include_usage=include_usage,
        sampling=sampling,
        output=output,
    )


def parse_tokenize(data: object) -> TokenizeRequest:
    b = require_object(data)
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
            tools=parse_tools(b),
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


def context_length_error(
    prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "messages"
) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
        f"{max_tokens} in the completion). Please reduce the length of the messages or "
        "completion.",
        param=param,
        code="context_length_exceeded",
    )


def prompt_chars(req: ChatRequest | CompletionRequest | TokenizeRequest) -> int:
    """Characters of the prompt's own text (what the template adds comes on top)."""
    if isinstance(req, CompletionRequest):
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    if isinstance(req, TokenizeRequest) and req.messages is None:
        return len(req.prompt or "")
    total = 0
    for message in req.messages or ():
        total += len(message.content)
        total += sum(len(c.name) + len(c.arguments) for c in message.tool_calls)
    return total


def check_prompt_size(
    req: ChatRequest | CompletionRequest | TokenizeRequest, max_model_len: int, max_token_chars: int
) -> None:
    """`context_length_exceeded` before any tokenizing, for a prompt that cannot fit.

    No token covers more than `max_token_chars` characters (the vocabulary's
    longest token), so a prompt of more than `max_model_len * max_token_chars`
    characters is more than `max_model_len` tokens: refusing it costs a length,
    where tokenizing it cost seconds of the one tokenizer thread (three 15 MB
    prompts held a plain request 58 s). Token-id prompts are counted as such.
    """
    param = "prompt" if isinstance(req, CompletionRequest) or req.messages is None else "messages"
    if isinstance(req, CompletionRequest) and not isinstance(req.prompt, str):
        if len(req.prompt) > max_model_len:
            raise context_length_error(len(req.prompt), 0, max_model_len, param)
        return
    chars = prompt_chars(req)
    limit = max_model_len * max(max_token_chars, 1)
    if chars > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{param} hold {chars} characters, more than {max_model_len} tokens can hold "
            f"(no token is longer than {max_token_chars} characters). Please reduce the "
            f"length of the {param}.",
            param=param,
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
