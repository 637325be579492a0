"""The eval runner against a scripted backend on a real socket: what it sends,
how it scores, and that a 500, a timeout, a refused connection or a broken
answer is a listed failure of that question, never an exception."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from proxy.backends.upstream import Upstream, make_session
from proxy.control.breaker import BackendBreaker
from proxy.policy import parse_policy
from proxy.policy.evalset import EvalSet, parse_evalset
from proxy.runtime.evalrun import EvalResult, run_eval
from tests.integration.conftest import FakeUpstream, free_port

EVALSET = parse_evalset(
    """
questions:
  - id: capital
    prompt: "capital?"
    max_tokens: 16
    checks: [{contains: Paris}, {regex: "^Paris"}]
  - id: sum
    messages: [{role: system, content: "numbers only"}, {role: user, content: "17+25?"}]
    temperature: 0.7
    checks: [{equals: "42"}]
  - id: data
    prompt: "json?"
    checks: [{json: true}, {json_schema: {type: object, required: [a]}}]
""",
    "eval.yaml",
)

Answer = Callable[[dict[str, object]], Awaitable[web.StreamResponse]]


def completion(content: object) -> web.Response:
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        }
    )


def last_user(body: dict[str, object]) -> str:
    messages = body["messages"]
    assert isinstance(messages, list)
    return str(messages[-1]["content"])


def script(answers: dict[str, Answer]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        return await answers[last_user(body)](body)

    return handler


def says(text: object) -> Answer:
    async def answer(body: dict[str, object]) -> web.StreamResponse:
        return completion(text)

    return answer


@pytest.fixture
async def upstream(fake_upstream: FakeUpstream) -> AsyncIterator[Upstream]:
    up = _upstream(fake_upstream.url, "model: served-name\n    api_key: sk-backend\n")
    yield up
    await up.session.close()


def _upstream(url: str, extra: str = "") -> Upstream:
    policy = parse_policy(
        f"backends:\n  primary:\n    url: {url}\n  candidate:\n    url: {url}\n    {extra}",
        "p.yaml",
    )
    bp = policy.backends.candidate
    assert bp is not None
    return Upstream(
        "candidate",
        bp,
        make_session(bp),
        BackendBreaker("candidate", policy.ladder.breaker, time.monotonic),
    )


async def test_each_question_goes_straight_to_the_backend_and_is_scored(
    fake_upstream: FakeUpstream, upstream: Upstream
) -> None:
    fake_upstream.handlers["/v1/chat/completions"] = script(
        {"capital?": says("Paris."), "17+25?": says(" 42\n"), "json?": says('{"a": 1}')}
    )
    result = await run_eval(EVALSET, upstream, timeout_s=5, clock=lambda: 1234.5)
    assert result == EvalResult("candidate", 5, 5, 1234.5, (), 0)
    assert result.score == 1.0
    sent = sorted(
        (json.loads(body) for path, _, body in fake_upstream.requests),
        key=lambda b: b["max_tokens"],
    )
    assert {path for path, _, _ in fake_upstream.requests} == {"/v1/chat/completions"}
    assert sent[0] == {
        "messages": [{"role": "user", "content": "capital?"}],
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": False,
        "model": "served-name",
    }
    assert {"role": "system", "content": "numbers only"} in sent[1]["messages"] + sent[2][
        "messages"
    ]
    assert sorted(b["temperature"] for b in sent) == [0.0, 0.0, 0.7]
    for _, headers, _ in fake_upstream.requests:
        assert headers["X-Priority"] == "sheddable"
        assert headers["Authorization"] == "Bearer sk-backend"
        assert "X-Session-Id" not in headers


async def test_wrong_answers_fail_their_checks_and_are_listed(
    fake_upstream: FakeUpstream, upstream: Upstream
) -> None:
    fake_upstream.handlers["/v1/chat/completions"] = script(
        {"capital?": says("It is Paris."), "17+25?": says("41"), "json?": says('{"b": 1}')}
    )
    result = await run_eval(EVALSET, upstream, timeout_s=5, clock=lambda: 0.0)
    assert (result.passed, result.total, result.errors) == (2, 5, 0)
    assert result.score == pytest.approx(0.4)
    assert result.failures == (
        ("capital", "1/2 checks passed; failed: regex"),
        ("sum", "0/1 checks passed; failed: equals"),
        ("data", "1/2 checks passed; failed: json_schema"),
    )
    assert result.as_dict() == {
        "arm": "candidate",
        "passed": 2,
        "total": 5,
        "score": pytest.approx(0.4),
        "at": 0.0,
        "errors": 0,
        "failures": [
            {"id": "capital", "reason": "1/2 checks passed; failed: regex"},
            {"id": "sum", "reason": "0/1 checks passed; failed: equals"},
            {"id": "data", "reason": "1/2 checks passed; failed: json_schema"},
        ],
    }
    json.dumps(result.as_dict())  # it goes into bundles and status as is


async def test_a_500_a_timeout_and_a_broken_answer_fail_their_questions_only(
    fake_upstream: FakeUpstream, upstream: Upstream
) -> None:
    async def error_500(body: dict[str, object]) -> web.StreamResponse:
        return web.json_response(
            {
                "error": {
                    "message": "EngineCore encountered an issue",
                    "type": "InternalServerError",
                    "code": 500,
                }
            },
            status=500,
        )

    async def hangs(body: dict[str, object]) -> web.StreamResponse:
        await asyncio.sleep(30)
        return completion("Paris")

    fake_upstream.handlers["/v1/chat/completions"] = script(
        {"capital?": hangs, "17+25?": error_500, "json?": says('{"a": 1}')}
    )
    started = time.monotonic()
    result = await run_eval(EVALSET, upstream, timeout_s=0.5, concurrency=3)
    assert time.monotonic() - started < 3
    assert (result.passed, result.total, result.errors) == (2, 5, 2)
    assert dict(result.failures) == {
        "capital": "timeout after 0.5 s",
        "sum": "HTTP 500: EngineCore encountered an issue",
    }


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            web.Response(text="not json", content_type="text/plain"),
            "no choices[0].message.content in the answer",
        ),
        (web.json_response({"choices": []}), "no choices[0].message.content in the answer"),
        (completion(None), "choices[0].message.content is not text"),
        (web.json_response({"error": {"message": "in-band"}}), "HTTP 200: in-band"),
        (web.Response(status=307, headers={"Location": "/elsewhere"}), "HTTP 307"),
        (web.Response(status=503, text="x" * 1000), "HTTP 503"),
    ],
)
async def test_an_answer_without_content_is_a_failure(
    fake_upstream: FakeUpstream, upstream: Upstream, answer: web.Response, reason: str
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return answer

    fake_upstream.handlers["/v1/chat/completions"] = handler
    one = parse_evalset(
        "questions: [{id: only, prompt: x, checks: [{regex: '.*'}, {json: false}]}]"
    )
    result = await run_eval(one, upstream, timeout_s=5)
    assert (result.passed, result.total, result.errors, result.failures) == (
        0,
        2,
        1,
        (("only", reason),),
    )
    assert [p for p, _, _ in fake_upstream.requests] == ["/v1/chat/completions"]  # 307 not followed


async def test_a_refused_connection_never_raises() -> None:
    up = _upstream(f"http://127.0.0.1:{free_port()}")
    try:
        result = await run_eval(EVALSET, up, timeout_s=2)
    finally:
        await up.session.close()
    assert (result.passed, result.total, result.errors) == (0, 5, 3)
    assert [qid for qid, _ in result.failures] == ["capital", "sum", "data"]
    assert all(why.startswith("ClientConnectorError") for _, why in result.failures)


async def test_no_more_than_concurrency_questions_in_flight(
    fake_upstream: FakeUpstream, upstream: Upstream
) -> None:
    many: EvalSet = parse_evalset(
        "questions:\n"
        + "".join(f"  - {{prompt: p{i}, checks: [{{contains: ok}}]}}\n" for i in range(12))
    )
    in_flight = 0
    peak = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, peak
        await request.read()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return completion("ok")

    fake_upstream.handlers["/v1/chat/completions"] = handler
    result = await run_eval(many, upstream, timeout_s=5, concurrency=3)
    assert (result.passed, result.total, result.failures) == (12, 12, ())
    assert peak == 3
    fake_upstream.requests.clear()
    peak = 0
    await run_eval(many, upstream, timeout_s=5)
    assert peak == 2  # the default


async def test_the_served_model_is_used_when_the_policy_names_none(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.handlers["/v1/chat/completions"] = script({"x": says("fine")})
    up = _upstream(fake_upstream.url)
    one = parse_evalset("questions: [{prompt: x, checks: [{equals: fine}]}]")
    try:
        await run_eval(one, up, timeout_s=5)
        up.served_model = "discovered"
        await run_eval(one, up, timeout_s=5)
    finally:
        await up.session.close()
    first, second = (json.loads(b) for _, _, b in fake_upstream.requests)
    assert "model" not in first
    assert second["model"] == "discovered"
    assert all("Authorization" not in h for _, h, _ in fake_upstream.requests)
