"""FAQ matching, maintenance rendering, partial-answer recovery."""

from __future__ import annotations

import json

from proxy.control.maintenance import Maintenance, render_json, render_stream
from proxy.openai.partial import answer_from_body, continuation_body, partial_text
from proxy.openai.sse import SSEParser
from proxy.policy import FaqEntry, FaqPolicy, MaintenancePolicy

FAQ = FaqPolicy(
    entries=(
        FaqEntry("How do I reset my password?", "Use the forgot-password link.", ("password",)),
        FaqEntry("What are your opening hours?", "9 to 5.", ("hours", "open")),
    ),
    threshold=0.35,
)


def test_faq_matching() -> None:
    m = Maintenance(FAQ, MaintenancePolicy(notice="Down for maintenance."))
    assert m.answer("I forgot my password, how can I reset it?").kind == "faq"
    assert m.answer("When are you open?").text == "9 to 5."
    a = m.answer("Tell me a story about dragons")
    assert (a.kind, a.text) == ("notice", "Down for maintenance.")
    assert m.answer("").kind == "notice"


def test_render_stream_is_a_valid_chat_stream() -> None:
    raw = render_stream("Hello there, world.", "tiny", "chat", include_usage=True)
    events = [e.data for e in SSEParser().feed(raw)]
    assert events[-1] == b"[DONE]"
    objs = [json.loads(d) for d in events[:-1] if d]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
    assert text == "Hello there, world."
    assert objs[-2]["choices"][0]["finish_reason"] == "stop"
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] > 0
    assert all(o["object"] == "chat.completion.chunk" for o in objs)


def test_render_json() -> None:
    chat = json.loads(render_json("hi", "tiny", "chat"))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    comp = json.loads(render_json("hi", "tiny", "completions"))
    assert comp["choices"][0]["text"] == "hi"


def test_partial_text_and_continuation() -> None:
    def c(text: str) -> bytes:
        obj = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    regions = [role + c("Hel"), c("lo") + b": ping\n\n" + c(" wor")]
    text, n = partial_text(regions, "chat")
    assert (text, n) == ("Hello wor", 3)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    cont = continuation_body(body, text, n, "chat")
    assert cont["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert cont["continue_final_message"] is True
    assert cont["add_generation_prompt"] is False
    assert cont["max_tokens"] == 7
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # not mutated
    # Nothing said yet: the same request afresh.
    assert continuation_body(body, "", 0, "chat") == body
    comp = continuation_body({"prompt": "Once", "max_tokens": 5}, " upon", 1, "completions")
    assert comp == {"prompt": "Once upon", "max_tokens": 4}


def test_partial_text_of_n2_chunks_is_choice_0() -> None:
    def ev(index: int, text: str) -> bytes:
        obj = {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    regions = [ev(0, "The ") + ev(1, "Un "), ev(0, "cat") + ev(1, "chien")]
    assert partial_text(regions, "chat") == ("The cat", 2)


def test_answer_from_body_is_choice_0_of_a_finished_answer() -> None:
    body = {
        "choices": [
            {"index": 1, "message": {"content": "deux"}, "finish_reason": "stop"},
            {"index": 0, "message": {"content": "one"}, "finish_reason": "stop"},
        ]
    }
    assert answer_from_body(json.dumps(body).encode()) == "one"
    body["choices"][1]["finish_reason"] = None  # type: ignore[index]
    assert answer_from_body(json.dumps(body).encode()) is None
    assert answer_from_body(b"[" * 100_000) is None
