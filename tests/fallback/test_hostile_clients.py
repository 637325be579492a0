"""One client's requests cannot hold up the fallback server for the others.

Attacks measured on 8c097b4: six requests with costly `response_format`
schemas (or one 100k-entry enum) held the one grammar thread past the
proxy's first-byte deadline, which then opened the fallback's breaker. Here,
on both engines, such requests are refused at once (over the static limits)
or answered within the compile deadline (a 503 with Retry-After: load), and
a plain request sent meanwhile is answered promptly.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fallback.conftest import FallbackServer, start_server, stop_server

GRAMMAR_TIMEOUT_S = 1.0
PLAIN = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module", params=("threads", "batched"))
def hostile_server(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp(f"hostile-{request.param}") / "server.log"
    args = [
        "--engine", request.param, "--max-concurrency", "2", "--max-queue", "4",
        "--grammar-workers", "1", "--grammar-queue", "1",
        "--grammar-timeout", str(GRAMMAR_TIMEOUT_S),
    ]  # fmt: skip
    server = start_server(tiny_model_dir, log_path, args)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture
def server(hostile_server: FallbackServer) -> Iterator[FallbackServer]:
    assert hostile_server.proc.poll() is None, hostile_server.log_tail()
    yield hostile_server
    hostile_server.wait_metric("vllm:num_requests_running", 0, timeout=10)
    hostile_server.wait_metric("vllm:num_requests_waiting", 0, timeout=10)


def _post_raw(server: FallbackServer, body: str, timeout: float) -> dict[str, Any]:
    """POST a raw JSON body; status, headers, body and seconds taken."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        return {
            "status": response.status,
            "headers": dict(response.getheaders()),
            "body": json.loads(payload) if payload else None,
            "seconds": time.monotonic() - started,
        }
    finally:
        conn.close()


def _with_schema(schema: object) -> str:
    return json.dumps(
        PLAIN
        | {
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
    )


def _costly_schema(tag: int) -> dict[str, Any]:
    """Within every static limit (6 KB, depth 4, no enum), yet ≈ 5 s of xgrammar on
    one idle core here: 100 properties, each a string of exactly 1,000 letters."""
    names = [f"p{tag}_{i}" for i in range(100)]
    return {
        "type": "object",
        "properties": {n: {"type": "string", "pattern": "[a-z]{1000}"} for n in names},
        "required": names,
    }


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [f"value-{i}" for i in range(100_000)]},  # > 120 s of compile on 8c097b4
        json.loads('{"type":"object","properties":{"a":' * 200 + "{}" + "}}" * 200),
        {"type": "string", "pattern": "[a-z]{20000}"},
    ],
    ids=["enum-100k", "depth-200", "repeat-20000"],
)
def test_an_oversized_schema_is_refused_at_once(server: FallbackServer, schema: object) -> None:
    answer = _post_raw(server, _with_schema(schema), timeout=30)
    assert answer["status"] == 400, answer
    error = answer["body"]["error"]
    assert error["param"] == "response_format"
    assert "too large" in error["message"]
    assert answer["seconds"] < 5, answer["seconds"]


def test_costly_schemas_neither_hang_nor_hold_up_plain_requests(server: FallbackServer) -> None:
    answers: list[dict[str, Any]] = []

    def hostile(tag: int) -> None:
        answers.append(_post_raw(server, _with_schema(_costly_schema(tag)), timeout=120))

    started = server.metric("brownout_fallback_grammar_compiles_total", result="started")
    threads = [threading.Thread(target=hostile, args=(tag,)) for tag in range(6)]
    for thread in threads:
        thread.start()
    server.wait_metric("brownout_fallback_grammar_lane", 1, timeout=10, state="running")
    plain = []
    while any(t.is_alive() for t in threads) or len(plain) < 3:
        plain.append(_post_raw(server, json.dumps(PLAIN), timeout=30))
    for thread in threads:
        thread.join()
    # Every plain request was answered, and promptly, while the schemas compiled.
    assert all(p["status"] == 200 for p in plain), plain
    assert max(p["seconds"] for p in plain) < 3, [round(p["seconds"], 2) for p in plain]
    # Every hostile request was answered within the deadline (plus slack for a
    # loaded box), never past it, and as load: a 503 with Retry-After.
    for answer in answers:
        assert answer["status"] == 503, answer
        assert answer["headers"].get("Retry-After") == "1", answer
        assert answer["body"]["error"]["code"] in ("grammar_timeout", "overloaded")
        assert answer["seconds"] < GRAMMAR_TIMEOUT_S + 4, answer["seconds"]
    # One compile worker: one compile ran; the rest waited in line or were shed.
    compiles = server.metric("brownout_fallback_grammar_compiles_total", result="started")
    assert compiles - started == 1


# --- long prompts ------------------------------------------------------------------------


def test_huge_prompts_are_refused_before_tokenizing_and_hold_no_one_up(
    server: FallbackServer,
) -> None:
    """Three 15 MB prompts tokenized one after another on the tokenizer thread, and a
    plain request waited behind them (58 s measured on 8c097b4)."""
    huge = json.dumps(
        {"messages": [{"role": "user", "content": "lorem ipsum " * 1_250_000}], "max_tokens": 1}
    )
    assert len(huge) > 15_000_000
    answers: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=lambda: answers.append(_post_raw(server, huge, timeout=120)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    plain = []
    while any(t.is_alive() for t in threads) or len(plain) < 3:
        plain.append(_post_raw(server, json.dumps(PLAIN), timeout=120))
    for thread in threads:
        thread.join()
    assert all(p["status"] == 200 for p in plain), plain
    assert max(p["seconds"] for p in plain) < 3, [round(p["seconds"], 2) for p in plain]
    for answer in answers:
        assert answer["status"] == 400, answer
        error = answer["body"]["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert "maximum context length is 2048 tokens" in error["message"]


def test_the_length_check_never_refuses_a_prompt_that_fits(server: FallbackServer) -> None:
    """The bound is the vocabulary's longest token: a prompt of that many characters per
    token, as long as the context allows, is still served (or refused by its real count)."""
    _, tokenized = server.post("/tokenize", {"prompt": " " * 4000, "add_special_tokens": False})
    fits = " " * 4000
    status, answer = server.post(
        "/v1/completions", {"prompt": fits, "max_tokens": 1, "add_special_tokens": False}
    )
    if tokenized["count"] < 2048:
        assert status == 200, answer
    else:
        assert status == 400, answer
        assert "tokens (" in answer["error"]["message"]  # the real count, after tokenizing


def test_tokenize_refuses_a_huge_prompt_without_tokenizing_it(server: FallbackServer) -> None:
    started = time.monotonic()
    status, answer = server.post("/tokenize", {"prompt": "lorem ipsum " * 1_000_000})
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == "prompt"
    assert time.monotonic() - started < 3


# --- sampling parameters -----------------------------------------------------------------

EXTREME_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0.0, -0.0, 5e-324, 1e-300, 1e-38, 1e-6, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e38, 1e308]
    ),
)
EXTREME_INTS = st.one_of(
    st.integers(-3, 6),
    st.integers(-(2**200), 2**200),
    st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)]),
)
NUMBER = st.one_of(EXTREME_FLOATS, EXTREME_INTS)
NUMERIC = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "seed", "max_tokens", "min_tokens", "n",
)  # fmt: skip
CHAT_ONLY = ("max_completion_tokens", "top_logprobs")


def _number(value: float | int) -> str:
    """JSON text of a number, as a hostile client writes it: inf as 1e309 (Python's JSON
    reads that as inf), nan as NaN, integers with all their digits."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "1e309" if value > 0 else "-1e309"
        return repr(value)
    return str(value)


def _body(endpoint: str, params: dict[str, float | int], extra: dict[str, Any]) -> str:
    base: dict[str, Any] = {"max_tokens": 2} | extra
    if endpoint == "chat":
        base["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        base["prompt"] = "Hi"
    fields = [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in base.items() if k not in params]
    fields += [f"{json.dumps(k)}:{_number(v)}" for k, v in params.items()]
    return "{" + ",".join(fields) + "}"


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, str, set[str]]:
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    names = NUMERIC + (CHAT_ONLY if endpoint == "chat" else ("logprobs",))
    params = draw(st.dictionaries(st.sampled_from(names), NUMBER, min_size=1, max_size=4))
    extra: dict[str, Any] = {}
    if endpoint == "chat" and draw(st.booleans()):
        extra["logprobs"] = True
    if draw(st.booleans()):
        extra["logit_bias"] = {"5": None}  # its value is drawn below, as raw JSON
        params_bias = draw(NUMBER)
        body = _body(endpoint, params, extra).replace('"5":null', '"5":' + _number(params_bias))
        return endpoint, body, set(params) | {"logit_bias"}
    return endpoint, _body(endpoint, params, extra), set(params)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=hostile_requests())
# The values that were a 500 on 8c097b4, always tried:
@example(
    request=("chat", _body("chat", {"repetition_penalty": 1e-300}, {}), {"repetition_penalty"})
)
@example(request=("chat", _body("chat", {"repetition_penalty": 1e300}, {}), {"repetition_penalty"}))
@example(request=("chat", _body("chat", {"temperature": 10**400}, {}), {"temperature"}))
@example(request=("completions", _body("completions", {"top_p": -(10**400)}, {}), {"top_p"}))
@example(request=("chat", _body("chat", {"temperature": 1e300}, {}), {"temperature"}))
def test_no_sampling_value_makes_a_500(
    hostile_server: FallbackServer, request: tuple[str, str, set[str]]
) -> None:
    """Whatever number a client sends: a 400 naming a field, or an answer; never a 500
    (`repetition_penalty: 1e-300` made the logits inf, and a 500: on 8c097b4)."""
    endpoint, body, sent = request
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", hostile_server.port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status in (200, 400), (status, answer, body)
    if status == 400:
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer
        assert error["type"] == "invalid_request_error"
        assert error["param"], answer
        assert error["param"].split(".")[0].split("[")[0] in sent | {"messages", "prompt"}
    else:
        assert answer["choices"], answer
        for choice in answer["choices"]:
            assert choice["finish_reason"] in ("stop", "length"), answer
    assert hostile_server.proc.poll() is None, hostile_server.log_tail()
