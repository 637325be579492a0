"""FAQ matching, maintenance rendering, partial-answer recovery."""

from __future__ import annotations

import json

from proxy.control.maintenance import Maintenance, render_json, render_stream
from proxy.openai.chunkrun import ChunkRuns, Run
from proxy.openai.partial import answer_from_body, continuation_body, partial_text, streamed_answer
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


def _vllm_chunk(text: str, finish: str | None = None, key: str = "content") -> bytes:
    # vLLM's order: the text, then `"finish_reason":null` (runs need it after).
    field = {"delta": {"content": text}} if key == "content" else {"text": text}
    choice = {"index": 0, **field, "logprobs": None, "finish_reason": finish}
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    obj["choices"] = [choice]
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _relayed(events: list[bytes], per_region: int) -> tuple[list[bytes], list[Run | None]]:
    """Regions of `per_region` events and the runs the relay cuts from them."""
    regions = [b"".join(events[i : i + per_region]) for i in range(0, len(events), per_region)]
    runs = ChunkRuns()
    return regions, [runs.cut(r) for r in regions]


def test_the_answer_is_read_from_the_relays_runs_as_from_the_bytes() -> None:
    """Issue 24: a session's answer is read from the literals the relay cut
    already (a 1,024-chunk answer was scanned again, as long as the relay)."""
    words = ["tok ", "é🚀", 'say "hi"', "back\\slash", "", "new\nline"]
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    events = [role, *(_vllm_chunk(words[i % len(words)]) for i in range(300))]
    events += [_vllm_chunk("", "stop"), b"data: [DONE]\n\n"]
    regions, runs = _relayed(events, 40)
    assert sum(r is not None for r in runs) >= 6
    want = "".join(words[i % len(words)] for i in range(300))
    assert partial_text(regions, "chat") == (want, 250)
    assert partial_text(regions, "chat", runs) == (want, 250)
    assert streamed_answer(regions, "chat", runs) == want
    # The runs' literals are what is read, not their bytes again.
    first = next(i for i, r in enumerate(runs) if r is not None)
    run = runs[first]
    assert run is not None
    lied = [*runs]
    lied[first] = Run(run.start, run.end, run.events, b"X" * run.events, 0)
    assert "X" * run.events in partial_text(regions, "chat", lied)[0]
    # Unfinished: no answer, with or without runs.
    assert streamed_answer(regions[:-1], "chat", runs[:-1]) is None


def test_runs_that_do_not_fit_are_ignored() -> None:
    events = [_vllm_chunk(f"t{i} ", key="text") for i in range(100)]
    events += [_vllm_chunk("", "stop", key="text"), b"data: [DONE]\n\n"]
    regions, runs = _relayed(events, 30)
    assert any(r is not None and not r.chat for r in runs)
    text = "".join(f"t{i} " for i in range(100))
    assert partial_text(regions, "completions", runs) == (text, 100)
    # Completions runs for a chat answer: the bytes are searched (no content).
    assert partial_text(regions, "chat", runs) == partial_text(regions, "chat")
    # Runs that are not one per region: not used.
    assert partial_text(regions, "completions", runs[:-1]) == (text, 100)
