"""Generation semantics: stop strings, seeds, greedy decoding, continuation."""

from __future__ import annotations

from typing import Any

import openai

from tests.fallback.conftest import FallbackServer

STORY = ({"role": "user", "content": "Write a story about a fox."},)


def _chat(client: openai.OpenAI, server: FallbackServer, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=server.served_model_name, messages=kwargs.pop("messages", STORY), **kwargs
    )


def _pick_stop(text: str) -> tuple[str, int]:
    """A 3-character stop string first occurring around the middle of `text`."""
    for k in range(len(text) // 2, 0, -1):
        candidate = text[k : k + 3]
        if text.find(candidate) == k and "\ufffd" not in candidate:
            return candidate, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_same_seed_same_text_and_temperature_zero_is_greedy(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    sampled = [_chat(client, server, max_tokens=24, temperature=1.0, seed=s) for s in (5, 5, 6)]
    texts = [c.choices[0].message.content for c in sampled]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    greedy = {_chat(client, server, max_tokens=24, temperature=0).choices[0].message.content}
    greedy.add(
        _chat(client, server, max_tokens=24, temperature=0, seed=9).choices[0].message.content
    )
    assert len(greedy) == 1


def test_stop_string_ends_output_and_is_not_included(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    # Seeded sampling gives varied, reproducible text to cut.
    # ignore_eos in every call: it changes the sampled distribution, so all runs need it.
    params: dict[str, Any] = {
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 40,
        "extra_body": {"ignore_eos": True},
    }
    free = _chat(client, server, **params)
    text = free.choices[0].message.content
    stop, index = _pick_stop(text)

    cut = _chat(client, server, **params, stop=["never-appears", stop])
    assert cut.choices[0].message.content == text[:index]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < free.usage.completion_tokens

    chunks = list(_chat(client, server, **params, stop=stop, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[:index]  # no part of the stop string leaked to the stream
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_with_stop(server: FallbackServer, client: openai.OpenAI) -> None:
    # Every id is a stop id, so the very first token ends the answer.
    cut = client.completions.create(
        model=server.served_model_name,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": list(range(4096))},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None
    assert cut.usage.completion_tokens == 1  # the stop token counts...
    assert cut.choices[0].text == ""  # ...but its text is not part of the answer


def test_continue_final_message_continues_the_prefix(
    server: FallbackServer, client: openai.OpenAI
) -> None:
    prefix = "Once upon a time, there was a small village"
    messages = [*STORY, {"role": "assistant", "content": prefix}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}

    # The prompt ends with the prefix's own tokens: no end-of-turn after it.
    _, rendered = server.post("/tokenize", {"messages": messages, **flags})
    _, prefix_ids = server.post("/tokenize", {"prompt": prefix, "add_special_tokens": False})
    assert rendered["tokens"][-prefix_ids["count"] :] == prefix_ids["tokens"]
    _, closed = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert closed["count"] > rendered["count"]  # the normal rendering closes the turn

    continued = _chat(
        client, server, messages=messages, max_tokens=10, temperature=0, extra_body=flags
    )
    assert continued.usage.prompt_tokens == rendered["count"]
    text = continued.choices[0].message.content
    # Greedy generation from exactly those token ids gives the same continuation.
    raw = client.completions.create(
        model=server.served_model_name, prompt=rendered["tokens"], max_tokens=10, temperature=0
    )
    assert text == raw.choices[0].text
    # The proxy's rescue path streams it; same text.
    chunks = _chat(
        client,
        server,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body=flags,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_continue_defaults_add_generation_prompt_off(server: FallbackServer) -> None:
    messages = [*STORY, {"role": "assistant", "content": "Once upon"}]
    _, implicit = server.post("/tokenize", {"messages": messages, "continue_final_message": True})
    _, explicit = server.post(
        "/tokenize",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert implicit["tokens"] == explicit["tokens"]
