"""The output guard end to end: garbage from the backend, seen by real clients.

Part 1 scripts a fake upstream that sends a couple of good chunks, waits until
the client has them, then injects one kind of garbage (control characters,
a U+FFFD burst, a leaked special token split across chunks, a degenerate loop,
a malformed event) and keeps streaming. The official `openai` client must
raise `APIError` with code `invalid_output` after the good chunks; the raw
SSE bytes must hold the good events, our error event and `[DONE]`, never the
offending event; the upstream must be closed at once; the trip must be
counted and logged, and never saved to a session.

Part 2 runs a batch against the real vLLM on the random-weight tiny model with
the default guard policy and prints what the guard did to that output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import openai
import pytest
import structlog.testing
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.guard.core import Guard, Trip
from proxy.openai.sse import DONE_EVENT, SSEParser
from proxy.policy import GuardPolicy, Policy
from tests.harness.vllm import VLLMServer
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    Handler,
    ProxyFactory,
    RunningProxy,
    free_port,
    make_policy,
)


def patient_policy(*args: Any, **kwargs: Any) -> Policy:
    """make_policy with generous backend timeouts: these tests are about the
    guard, and a loaded CI machine must not turn a slow chunk into a timeout."""
    policy = make_policy(*args, **kwargs)
    b = policy.backends

    def patient(bp: Any) -> Any:
        return replace(bp, timeouts=replace(bp.timeouts, first_byte_s=20, idle_s=20))

    fb = patient(b.fallback) if b.fallback is not None else None
    return replace(policy, backends=replace(b, primary=patient(b.primary), fallback=fb))


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CHAT = "/v1/chat/completions"
RULES = ("control_chars", "replacement_chars", "special_tokens", "repetition", "malformed")
MALFORMED_ABORT = "guard:\n  malformed: {action: abort}\n"
# How soon the proxy must drop the upstream request after a trip.
CLOSE_WITHIN_S = 1.0
REP_STRIDE = 16  # proxy/guard/core.py: characters between two looks for a loop


# --------------------------------------------------------------------------- helpers


def ev(
    content: str,
    seq: int,
    *,
    finish: str | None = None,
    ascii_only: bool = True,
    endpoint: str = "chat",
) -> bytes:
    """One vLLM-style (compact JSON) chunk; `seq` makes every event's bytes unique.

    `ascii_only` escapes control and non-ASCII characters as `\\uXXXX` (as
    `json.dumps` does by default); otherwise they go out as raw UTF-8.
    """
    choice: dict[str, Any]
    if endpoint == "chat":
        obj_type = "chat.completion.chunk"
        choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    else:
        obj_type = "text_completion"
        choice = {"index": 0, "text": content, "finish_reason": finish}
    obj = {
        "id": f"cmpl-{seq}",
        "object": obj_type,
        "created": 1,
        "model": "tiny",
        "choices": [choice],
    }
    payload = json.dumps(obj, ensure_ascii=ascii_only, separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\n"


def raw_c0_event(seq: int) -> bytes:
    """A chunk whose JSON string holds a raw 0x01 byte (invalid JSON, still garbage)."""
    event = ev("a\x01b", seq)
    assert b"\\u0001" in event
    return event.replace(b"\\u0001", b"\x01")


def content_of(event: bytes) -> str:
    obj = json.loads(event[6:-2], strict=False)
    choice = obj["choices"][0]
    text = choice["delta"]["content"] if "delta" in choice else choice["text"]
    assert isinstance(text, str)
    return text


def split_events(raw: bytes) -> list[bytes]:
    parser = SSEParser()
    return [e.raw for e in parser.feed(raw) + parser.flush()]


def first_trip(policy: GuardPolicy, events: Sequence[bytes]) -> tuple[int, Trip]:
    """Index of the event that completes the garbage (fed one event at a time)."""
    sg = Guard(policy).stream()
    for i, event in enumerate(events):
        verdict = sg.feed(event)
        if isinstance(verdict, Trip):
            return i, verdict
    raise AssertionError("test data: these events never trip the guard")


def last_possible_trip(events: Sequence[bytes], k: int, trip: Trip) -> int:
    """The last event at which the proxy may catch the garbage that `first_trip`
    caught at event k. Only repetition has slack: it is looked for at the first
    event boundary at least REP_STRIDE characters after its last look, so where
    it is caught depends on how the events were grouped into reads."""
    if trip.rule != "repetition":
        return k
    slack = REP_STRIDE + max(len(content_of(e)) for e in events[k:])
    j, more = k, 0
    while more < slack and j + 1 < len(events):
        j += 1
        more += len(content_of(events[j]))
    return j


async def metric_samples(proxy: RunningProxy, name: str) -> list[tuple[dict[str, str], float]]:
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


async def counts_by_rule(proxy: RunningProxy, name: str) -> Counter[str]:
    """`name` (e.g. brownout_guard_trips_total) per rule, backend primary only."""
    out: Counter[str] = Counter()
    for labels, value in await metric_samples(proxy, name):
        assert labels["rule"] in RULES, labels
        if labels["backend"] == "primary" and value:
            out[labels["rule"]] += int(value)
    return out


@contextlib.asynccontextmanager
async def openai_client(proxy: RunningProxy) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


def assert_invalid_output_body(body: object) -> None:
    """The error object the SDK exposes as `exc.body` (the `error` member)."""
    assert isinstance(body, dict), body
    assert body["code"] == "invalid_output"
    assert body["type"] == "server_error"
    assert isinstance(body["message"], str) and "stopped" in body["message"]


def assert_error_then_done(events: list[bytes]) -> None:
    """The last two events: our in-band invalid_output error, then [DONE]."""
    assert events[-1] == DONE_EVENT, events[-3:]
    err = events[-2]
    assert err.startswith(b'data: {"error"'), events[-3:]
    assert_invalid_output_body(json.loads(err[6:-2])["error"])


def good_answer_handler(text: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-ok",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "tiny",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(ev(text, 900) + ev("", 901, finish="stop") + DONE_EVENT)
        return resp

    return handler


def last_messages(fake: FakeUpstream) -> list[dict[str, Any]]:
    # Background probes (/health, /v1/models) interleave: the last chat request.
    body = [b for path, _, b in fake.requests if path == CHAT][-1]
    messages: list[dict[str, Any]] = json.loads(body)["messages"]
    return messages


async def check_session_not_saved(
    proxy: RunningProxy,
    fake: FakeUpstream,
    garbage: Handler,
    *,
    stream: bool,
    sid: str,
    before_garbage: Callable[[], None] | None = None,
) -> None:
    """good turn → tripped turn → good turn in one session: the third request
    carries the first turn as history and nothing of the second."""
    headers = {"X-Session-Id": sid}

    async def ask(question: str) -> tuple[int, bytes]:
        body = {**CHAT_BODY, "stream": stream, "messages": [{"role": "user", "content": question}]}
        async with proxy.session.post(proxy.url + CHAT, json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    fake.handlers[CHAT] = good_answer_handler("First answer.")
    status, _ = await ask("first question")
    assert status == 200
    fake.handlers[CHAT] = garbage
    if before_garbage is not None:
        before_garbage()
    status, raw = await ask("second question")
    if stream:
        assert status == 200
        assert_error_then_done(split_events(raw))
    else:
        assert status == 502
        assert json.loads(raw)["error"]["code"] == "invalid_output"
    fake.handlers[CHAT] = good_answer_handler("Third answer.")
    status, _ = await ask("third question")
    assert status == 200
    # The history the proxy merged in (the positive control is the first turn).
    assert last_messages(fake) == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "third question"},
    ]


# --------------------------------------------------------------------------- the scripted upstream


@dataclass
class GarbageScript:
    """good events → (wait for the client to have them) → after events → either
    finish, or keep sending harmless chunks until the proxy hangs up."""

    good: tuple[bytes, ...]
    after: tuple[bytes, ...]
    finish: bool = False
    endpoint: str = "chat"
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    after_at: float | None = None  # when the first `after` event went out
    gone_at: float | None = None  # when the handler saw the proxy hang up
    calls: int = 0

    @property
    def sent(self) -> list[bytes]:
        return [*self.good, *self.after]

    def arm(self, *, open_gate: bool = False) -> None:
        self.gate = asyncio.Event()
        if open_gate:
            self.gate.set()
        self.after_at = self.gone_at = None

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        gate = self.gate
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            for event in self.good:
                await resp.write(event)
            # Lockstep: garbage only once the client holds the good chunks, so
            # TCP coalescing cannot decide what the client sees. A proxy that
            # withholds them just makes this wait time out (and the test fail).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gate.wait(), 2)
            self.after_at = time.monotonic()
            for event in self.after:
                await resp.write(event)
            if self.finish:
                await resp.write(ev("", 999, finish="stop", endpoint=self.endpoint))
                await resp.write(DONE_EVENT)
                return resp
            for i in range(100):
                await asyncio.sleep(0.02)
                await resp.write(ev(f" tail {i}", 1000 + i, endpoint=self.endpoint))
        except (ConnectionError, asyncio.CancelledError):
            self.gone_at = time.monotonic()
            raise
        return resp

    async def assert_upstream_closed(self) -> None:
        for _ in range(int(CLOSE_WITHIN_S / 0.02) + 5):
            if self.gone_at is not None:
                break
            await asyncio.sleep(0.02)
        assert self.gone_at is not None, "upstream request still running after the guard trip"
        assert self.after_at is not None
        assert self.gone_at - self.after_at < CLOSE_WITHIN_S


# --------------------------------------------------------------------------- part 1: garbage cases

GOOD = (ev("Hello", 0), ev(" there.", 1))
LOOP_WORDS = ["All", " work", " and", " no", " play", "."]


@dataclass(frozen=True)
class Case:
    name: str
    rule: str
    after: tuple[bytes, ...]
    good: tuple[bytes, ...] = GOOD
    extra: str = ""
    # Bytes that must never reach the client (besides the offending event).
    forbidden: tuple[bytes, ...] = ()


CASES = [
    Case("nul_escape", "control_chars", (ev("ok\x00ok", 2),), forbidden=(b"\\u0000",)),
    Case("esc_escape", "control_chars", (ev("\x1b[31mred", 2),), forbidden=(b"\\u001b",)),
    Case("del_escape", "control_chars", (ev("x\x7fy", 2),), forbidden=(b"\\u007f",)),
    Case("bel_vt_escapes", "control_chars", (ev("ding\x07\x0b", 2),), forbidden=(b"\\u0007",)),
    Case(
        "c1_raw_utf8",
        "control_chars",
        (ev("x\u009by", 2, ascii_only=False),),
        forbidden=(b"\xc2\x9b",),
    ),
    Case("c1_escape", "control_chars", (ev("x\u0085y", 2),), forbidden=(b"\\u0085",)),
    Case("c0_raw_byte", "control_chars", (raw_c0_event(2),), forbidden=(b"\x01",)),
    Case(
        "fffd_burst_raw",
        "replacement_chars",
        (ev("\ufffd" * 30, 2, ascii_only=False),),
        forbidden=(b"\xef\xbf\xbd",),
    ),
    Case(
        "fffd_spread_escaped",
        "replacement_chars",
        tuple(ev("\ufffd" * 6 + "a", i) for i in range(2, 8)),
    ),
    Case(
        "im_start_split",
        "special_tokens",
        (ev("start|>user\nIgnore that.", 2),),
        good=(ev("Hello", 0), ev(" <|im_", 1)),
        # (The error message names the token it found; the model's text stays out.)
        forbidden=(b"start|>user", b"Ignore that"),
    ),
    Case("endoftext_whole", "special_tokens", (ev("done<|endoftext|>", 2),)),
    Case(
        "loop_sentence",
        "repetition",
        tuple(ev(w, i) for i, w in enumerate(LOOP_WORDS * 60, start=2)),
    ),
    Case("loop_one_char", "repetition", tuple(ev("!!!!", i) for i in range(2, 300))),
    Case(
        "malformed_not_json",
        "malformed",
        (b"data: {not json\n\n",),
        extra=MALFORMED_ABORT,
        forbidden=(b"not json",),
    ),
    Case(
        "malformed_no_choices",
        "malformed",
        (b'data: {"object":"chat.completion.chunk","model":"tiny"}\n\n',),
        extra=MALFORMED_ABORT,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_stream_garbage_stops_with_invalid_output(
    case: Case, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    script = GarbageScript(case.good, case.after)
    policy = patient_policy(fake_upstream.url, extra=case.extra)
    k, trip = first_trip(policy.guard, script.sent)
    k_last = last_possible_trip(script.sent, k, trip)
    assert trip.rule == case.rule  # the test data trips the rule it is about...
    assert k >= len(case.good)  # ...and only after the good chunks
    good_texts = [content_of(e) for e in case.good]
    fake_upstream.handlers[CHAT] = script.handler
    proxy = await start_proxy(policy)

    # 1. The official client: good chunks, then APIError(invalid_output).
    script.arm()
    texts: list[str] = []
    with structlog.testing.capture_logs() as logs:
        async with openai_client(proxy) as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            with pytest.raises(openai.APIError) as info:
                async for c in stream:
                    texts.append(c.choices[0].delta.content or "")
                    if len(texts) == len(case.good):
                        script.gate.set()
    exc = info.value
    assert not isinstance(exc, openai.APIStatusError)  # in-band, after the 200
    assert exc.code == "invalid_output"
    assert exc.type == "server_error"
    assert_invalid_output_body(exc.body)
    assert texts[: len(good_texts)] == good_texts
    # Whatever else arrived is the (harmless) start of the garbage, in order.
    assert texts == [content_of(e) for e in script.sent[: len(texts)]]
    assert len(texts) <= k_last
    await script.assert_upstream_closed()
    # One warning log line naming the rule, with a short excerpt.
    trips = [e for e in logs if e["event"] == "guard_trip"]
    assert len(trips) == 1, logs
    assert trips[0]["rule"] == case.rule
    assert trips[0]["backend"] == "primary"
    assert trips[0]["log_level"] == "warning"
    assert 0 < len(trips[0]["excerpt"]) <= 40
    requests = [e for e in logs if e["event"] == "request"]
    assert [e["outcome"] for e in requests] == ["guard_trip"]

    # 2. The raw SSE bytes: a prefix of what the upstream sent, our error, [DONE].
    script.arm()
    raw = b""
    parser = SSEParser()
    got = 0
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        assert resp.status == 200
        assert resp.headers["X-Brownout-Backend"] == "primary"
        async for data in resp.content.iter_any():
            raw += data
            got += sum(1 for e in parser.feed(data) if e.data is not None)
            if got >= len(case.good):
                script.gate.set()
    events = [e for e in split_events(raw) if not e.startswith(b":")]  # heartbeats aside
    assert_error_then_done(events)
    relayed = events[:-2]
    assert len(case.good) <= len(relayed) <= k_last
    assert relayed == script.sent[: len(relayed)]
    assert script.sent[len(relayed)] not in raw  # the event that tripped
    for needle in case.forbidden:
        assert needle not in raw
    await script.assert_upstream_closed()

    # 3. Sessions: nothing of a tripped answer is saved.
    await check_session_not_saved(
        proxy,
        fake_upstream,
        script.handler,
        stream=True,
        sid=f"guard-{case.name}",
        before_garbage=lambda: script.arm(open_gate=True),
    )

    # 4. Metrics: three trips of this rule (client, raw, session), nothing else.
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {case.rule: 3}
    assert await counts_by_rule(proxy, "brownout_guard_notes_total") == {}
    assert script.calls == 3


async def test_completions_stream_garbage_stops_with_invalid_output(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    script = GarbageScript(
        (ev("Once", 0, endpoint="text"), ev(" upon", 1, endpoint="text")),
        (ev(" a\x00time", 2, endpoint="text"),),
        endpoint="text",
    )
    fake_upstream.handlers["/v1/completions"] = script.handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    script.arm()
    texts: list[str] = []
    async with openai_client(proxy) as client:
        stream = await client.completions.create(model="tiny", prompt="Once", stream=True)
        with pytest.raises(openai.APIError) as info:
            async for c in stream:
                texts.append(c.choices[0].text)
                if len(texts) == 2:
                    script.gate.set()
    assert info.value.code == "invalid_output"
    assert_invalid_output_body(info.value.body)
    assert texts == ["Once", " upon"]
    await script.assert_upstream_closed()
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {"control_chars": 1}


COALESCED = [c for c in CASES if c.name in ("nul_escape", "fffd_spread_escaped", "im_start_split")]


@pytest.mark.parametrize("case", COALESCED, ids=[c.name for c in COALESCED])
async def test_good_chunks_coalesced_with_garbage_still_arrive(
    case: Case, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Good chunks and garbage in one TCP read (a fast model, a busy proxy): the
    events before the offending one are valid output and reach the client, as
    they would have one read earlier; only the offending event onwards is cut.
    (On the real tiny model, greedy output that passes at max_tokens=32 with
    ~130 characters arrived as 0 characters at max_tokens=64 otherwise.)"""
    sent = [*case.good, *case.after]
    k, _ = first_trip(patient_policy(fake_upstream.url).guard, sent)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"".join(sent))  # one write: one region for the relay
        await asyncio.sleep(2)
        return resp

    fake_upstream.handlers[CHAT] = handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        raw = await resp.read()
    events = [e for e in split_events(raw) if not e.startswith(b":")]
    assert_error_then_done(events)
    assert sent[k] not in raw
    assert events[:-2] == sent[:k]


LAST_REGION_CASES = {
    # The upstream's last event lacks its blank line (SSEFramer.flush → feed_final).
    "unterminated_last_event": ev("x\x00y", 2)[:-2],
    # Garbage in the same write as the finish chunk and [DONE] (the last region).
    "garbage_with_done": ev("x\x00y", 2) + ev("", 3, finish="stop") + DONE_EVENT,
}


@pytest.mark.parametrize("tail", LAST_REGION_CASES.values(), ids=LAST_REGION_CASES.keys())
async def test_garbage_in_the_last_region_still_trips(
    tail: bytes, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    gate = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"".join(GOOD))
        await asyncio.wait_for(gate.wait(), 2)
        await resp.write(tail)
        return resp

    fake_upstream.handlers[CHAT] = handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    raw = b""
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        async for data in resp.content.iter_any():
            raw += data
            if len(split_events(raw)) >= len(GOOD):
                gate.set()
    events = [e for e in split_events(raw) if not e.startswith(b":")]
    assert_error_then_done(events)
    assert events[:-2] == list(GOOD)  # no finish chunk, no garbage
    assert b"\\u0000" not in raw
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {"control_chars": 1}


@pytest.fixture
async def second_upstream() -> AsyncIterator[FakeUpstream]:
    """A second scripted upstream (the fallback), like conftest's `fake_upstream`."""
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port).start()
    yield fake
    await runner.cleanup()


RESCUE_CASES = {
    "nul_in_continuation": (ev("brown", 2), ev(" fox\x00", 3), "control_chars"),
    # A leaked token split across the seam: the rules must see one answer.
    "token_split_at_seam": (ev("brown <|im_", 2), ev("start|>user", 3), "special_tokens"),
}


@pytest.mark.parametrize(
    ("last_primary", "continuation", "rule"),
    RESCUE_CASES.values(),
    ids=RESCUE_CASES.keys(),
)
async def test_rescued_continuation_is_guarded_too(
    last_primary: bytes,
    continuation: bytes,
    rule: str,
    fake_upstream: FakeUpstream,
    second_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    """A stream the primary drops mid-answer is continued on the fallback; what
    the fallback adds goes to the same client, so the guard must inspect it."""
    primary_events = (ev("The", 0), ev(" quick ", 1), last_primary)

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"".join(primary_events))
        await asyncio.sleep(0.05)  # let the proxy relay them first
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def continue_with_garbage(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(continuation + ev(" jumps.", 4) + ev("", 5, finish="stop") + DONE_EVENT)
        return resp

    fake_upstream.handlers[CHAT] = cut
    second_upstream.handlers[CHAT] = continue_with_garbage
    proxy = await start_proxy(patient_policy(fake_upstream.url, second_upstream.url))

    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert [p for p, _, _ in second_upstream.requests if p == CHAT] == [CHAT]  # rescued
    events = [e for e in split_events(raw) if not e.startswith(b":")]
    assert events[: len(primary_events)] == list(primary_events)
    assert continuation not in raw
    assert b"jumps" not in raw
    assert_error_then_done(events)
    trips = await metric_samples(proxy, "brownout_guard_trips_total")
    assert [(labels, v) for labels, v in trips if v] == [
        ({"rule": rule, "backend": "fallback"}, 1.0)
    ]


# --------------------------------------------------------------------------- log mode, drop


LOG_CASES = [c for c in CASES if c.name in ("nul_escape", "fffd_burst_raw", "im_start_split")]
LOG_CASES.append(
    Case(
        "loop_sentence",
        "repetition",
        tuple(ev(w, i) for i, w in enumerate(LOOP_WORDS * 30, start=2)),
    )
)


@pytest.mark.parametrize("case", LOG_CASES, ids=[c.name for c in LOG_CASES])
async def test_log_mode_rule_lets_the_stream_through_and_counts_a_note(
    case: Case, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    script = GarbageScript(case.good, case.after, finish=True)
    policy = patient_policy(fake_upstream.url, extra=f"guard:\n  {case.rule}: {{action: log}}\n")
    fake_upstream.handlers[CHAT] = script.handler
    proxy = await start_proxy(policy)
    sent = b"".join(script.sent) + ev("", 999, finish="stop") + DONE_EVENT

    script.arm(open_gate=True)
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b"".join(e for e in split_events(raw) if not e.startswith(b":")) == sent

    script.arm(open_gate=True)
    async with openai_client(proxy) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(texts) == "".join(content_of(e) for e in script.sent)

    # Noted once per stream (the rule is muted after its first finding).
    assert await counts_by_rule(proxy, "brownout_guard_notes_total") == {case.rule: 2}
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {}


async def test_malformed_event_is_dropped_by_default_and_stream_completes(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    bad = (b"data: {not json\n\n", b'data: {"object":"chat.completion.chunk"}\n\n')
    script = GarbageScript(GOOD, (*bad, ev(" More", 2), ev(" text.", 3)), finish=True)
    fake_upstream.handlers[CHAT] = script.handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))

    script.arm(open_gate=True)
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        assert resp.status == 200
        raw = await resp.read()
    events = [e for e in split_events(raw) if not e.startswith(b":")]
    kept = [e for e in script.sent if e not in bad]
    assert events == [*kept, ev("", 999, finish="stop"), DONE_EVENT]
    for b in bad:
        assert b not in raw

    # The SDK would choke on `{not json`; with the event dropped it completes.
    script.arm(open_gate=True)
    async with openai_client(proxy) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(texts) == "Hello there. More text."

    # Every dropped event is noted; nothing tripped.
    assert await counts_by_rule(proxy, "brownout_guard_notes_total") == {"malformed": 4}
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {}


# --------------------------------------------------------------------------- non-streaming


def chat_body(content: str) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-x",
            "object": "chat.completion",
            "created": 1,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()


BODY_CASES = [
    ("control_escape", "control_chars", chat_body("ab\x00cd"), b"ab\\u0000cd"),
    ("c1_escape", "control_chars", chat_body("ab\x9bcd"), b"ab\\u009bcd"),
    ("fffd_burst", "replacement_chars", chat_body("x" + "\ufffd" * 40), b"\\ufffd" * 40),
    ("special_token", "special_tokens", chat_body("Sure.<|im_end|>\nuser"), b"Sure."),
    ("repetition", "repetition", chat_body("Hi. " + "ha" * 400), b"haha" * 100),
    ("not_json", "malformed", b"this is not json", b"this is not json"),
    ("no_choices", "malformed", b'{"object": "chat.completion", "id": "x9"}', b"x9"),
]


@pytest.mark.parametrize(
    ("rule", "body", "needle"),
    [c[1:] for c in BODY_CASES],
    ids=[c[0] for c in BODY_CASES],
)
async def test_non_streaming_garbage_is_502_invalid_output(
    rule: str,
    body: bytes,
    needle: bytes,
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    fake_upstream.handlers[CHAT] = handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))

    async with openai_client(proxy) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}]
            )
    assert info.value.status_code == 502
    assert info.value.code == "invalid_output"
    assert_invalid_output_body(info.value.body)

    async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as resp:
        assert resp.status == 502
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.headers["X-Brownout-Backend"] == "primary"
        raw = await resp.read()
    assert_invalid_output_body(json.loads(raw)["error"])
    assert needle not in raw
    # One upstream call per client call: no retry of garbage on the same backend.
    assert [p for p, _, _ in fake_upstream.requests if p == CHAT] == [CHAT, CHAT]

    await check_session_not_saved(
        proxy, fake_upstream, handler, stream=False, sid=f"guard-body-{rule}"
    )
    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {rule: 3}


# --------------------------------------------------------------------------- ordinary text

ORDINARY = [
    "Hello,\tworld!\n",
    "Line one\r\nLine two\n\n",
    "Café, naïve façade — “quotes” … ",
    "日本語のテキスト、中文，한국어. ",
    "مرحبا بالعالم, שלום. ",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ",
    "Combining: e\u0301 a\u0308; ZWJ\u200d; NBSP\u00a0; soft\u00adhyphen. ",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159. ",
    "Code:\n    if a < 3 and b > 2:\n\treturn a <= b\n",
    "In C, '\\0' and \"\\u0000\" spell NUL; <b>bold</b>, a<|b, <|pipe|>.\n",
    "| a | b |\n| --- | --- |\n| 1 | 2 |\n",
    "-" * 60 + "\n",
    "0, " * 100 + "\n",
    "One odd byte: \ufffd and another: \ufffd.\n",
    "        indented\n" * 4,
]


async def test_ordinary_text_passes_byte_for_byte(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    events = [ev(t, i, ascii_only=i % 2 == 0) for i, t in enumerate(ORDINARY)]
    # Escapes a client decodes: `\/`, `\"`, `\\`, a surrogate pair.
    events.append(
        b'data: {"id":"cmpl-e","object":"chat.completion.chunk","created":1,"model":"tiny",'
        b'"choices":[{"index":0,"delta":{"content":"a\\/b \\"q\\" \\\\ \\ud83d\\ude00"},'
        b'"finish_reason":null}]}\n\n'
    )
    sent = b"".join(events) + ev("", 99, finish="stop") + DONE_EVENT
    expected_text = "".join(ORDINARY) + 'a/b "q" \\ 😀'

    async def stream_handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
        await resp.write(ev("", 99, finish="stop") + DONE_EVENT)
        return resp

    fake_upstream.handlers[CHAT] = stream_handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert raw.replace(b": ping\n\n", b"") == sent

    async with openai_client(proxy) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(texts) == expected_text

    body = chat_body(expected_text)
    body_raw = json.dumps(json.loads(body), ensure_ascii=False).encode()
    for payload in (body, body_raw):

        async def body_handler(request: web.Request, payload: bytes = payload) -> web.Response:
            return web.Response(body=payload, content_type="application/json")

        fake_upstream.handlers[CHAT] = body_handler
        async with proxy.session.post(
            proxy.url + CHAT, json={**CHAT_BODY, "stream": False}
        ) as resp:
            assert resp.status == 200
            assert await resp.read() == payload

    assert await counts_by_rule(proxy, "brownout_guard_trips_total") == {}
    assert await counts_by_rule(proxy, "brownout_guard_notes_total") == {}


# --------------------------------------------------------------------------- part 2: real vLLM

REAL_PROMPTS = [
    "Hello!",
    "Write a short poem about the sea.",
    "List three primary colors.",
    "Explain TCP in one sentence.",
    "Translate 'good morning' into French.",
]
REAL_MAX_TOKENS = [32, 64, 128, 256]
# Not the guard: keep every request on the primary so each one is measured
# (trips count as breaker failures, and most of this output trips).
REAL_EXTRA = """
ladder:
  breaker: {fail_max: 1000, failure_rate: 0}
  maintenance: {enabled: false}
"""
_CODEPOINT = re.compile(r"U\+([0-9A-F]{4})")


@dataclass
class RealResult:
    prompt: str
    temperature: float
    max_tokens: int
    outcome: str  # "passed" or the rule
    finish: str | None
    chars: int  # characters the client received
    detail: str = ""


def real_policy(base_url: str) -> Policy:
    policy = patient_policy(base_url, extra=REAL_EXTRA)
    primary = policy.backends.primary
    primary = replace(
        primary,
        model="tiny",
        timeouts=replace(primary.timeouts, first_byte_s=60, idle_s=30),
    )
    return replace(policy, backends=replace(policy.backends, primary=primary))


async def run_one(
    proxy: RunningProxy,
    client: openai.AsyncOpenAI,
    prompt: str,
    temperature: float,
    max_tokens: int,
) -> RealResult:
    before = await counts_by_rule(proxy, "brownout_guard_trips_total")
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        temperature=temperature,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert stream.response.headers["x-brownout-backend"] == "primary"
    text: list[str] = []
    finish: str | None = None
    error: openai.APIError | None = None
    try:
        async for c in stream:
            for ch in c.choices:
                text.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
    except openai.APIError as exc:
        error = exc
    after = await counts_by_rule(proxy, "brownout_guard_trips_total")
    new = after - before
    chars = len("".join(text))
    if error is None:
        # Never a silent truncation: a passing stream finished.
        assert finish in ("stop", "length"), (prompt, temperature, max_tokens, finish)
        assert not new, new
        return RealResult(prompt, temperature, max_tokens, "passed", finish, chars)
    assert error.code == "invalid_output", (error.code, error.message)
    assert_invalid_output_body(error.body)
    assert len(new) == 1 and sum(new.values()) == 1, new
    (rule,) = new
    assert rule in RULES
    m = _CODEPOINT.search(error.message)
    detail = m.group(0) if m else ""
    return RealResult(prompt, temperature, max_tokens, rule, finish, chars, detail)


def summary(results: list[RealResult]) -> str:
    temps = sorted({r.temperature for r in results})
    rows = ["passed", *RULES]
    head = f"{'outcome':<18}" + "".join(f"{f'temp {t:g}':>10}" for t in temps) + f"{'all':>8}"
    lines = [head, "-" * len(head)]
    for row in rows:
        n = [sum(1 for r in results if r.outcome == row and r.temperature == t) for t in temps]
        total = sum(n)
        lines.append(f"{row:<18}" + "".join(f"{x:>10}" for x in n) + f"{total:>8}")
    n_all = [sum(1 for r in results if r.temperature == t) for t in temps]
    lines.append(f"{'total':<18}" + "".join(f"{x:>10}" for x in n_all) + f"{len(results):>8}")
    lines.append("")
    lines.append("by max_tokens (stopped/total): " + ", ".join(
        f"{mt}: {sum(1 for r in results if r.max_tokens == mt and r.outcome != 'passed')}"
        f"/{sum(1 for r in results if r.max_tokens == mt)}"
        for mt in sorted({r.max_tokens for r in results})
    ))  # fmt: skip
    cps = Counter(r.detail for r in results if r.detail)
    if cps:
        lines.append("control characters named: " + ", ".join(f"{k} x{v}" for k, v in cps.items()))
    stopped = [r.chars for r in results if r.outcome != "passed"]
    if stopped:
        lines.append(
            f"characters delivered before a stop: min {min(stopped)}, "
            f"median {sorted(stopped)[len(stopped) // 2]}, max {max(stopped)}"
        )
    lines.append("temperature 0, per prompt (max_tokens: outcome @ characters delivered):")
    for prompt in dict.fromkeys(r.prompt for r in results):
        cells = [
            f"{r.max_tokens}: {'ok' if r.outcome == 'passed' else r.outcome}@{r.chars}"
            for r in results
            if r.prompt == prompt and r.temperature == 0
        ]
        lines.append(f"  {prompt[:30]:<30} " + ", ".join(cells))
    finishes = Counter(r.finish for r in results if r.outcome == "passed")
    lines.append("passed by finish_reason: " + ", ".join(f"{k}: {v}" for k, v in finishes.items()))
    return "\n".join(lines)


@pytest.mark.real
@pytest.mark.slow
async def test_default_guard_on_random_tiny_model_output(
    live_vllm_server: VLLMServer,
    start_proxy: ProxyFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy = real_policy(live_vllm_server.base_url)
    assert policy.guard == GuardPolicy()  # the default guard, untouched
    proxy = await start_proxy(policy)
    plan = [
        (prompt, temperature, max_tokens)
        for temperature in (0.0, 1.0)
        for prompt in REAL_PROMPTS
        for max_tokens in REAL_MAX_TOKENS
    ]
    results: list[RealResult] = []
    async with openai_client(proxy) as client:
        # One at a time, so each request's trip is the /metrics difference.
        for prompt, temperature, max_tokens in plan:
            results.append(await run_one(proxy, client, prompt, temperature, max_tokens))

    table = summary(results)
    with capsys.disabled():
        print(f"\n\nDefault guard on the random-weight tiny model ({len(results)} streams):")
        print(table + "\n")

    # The numbers add up: every request either passed or was stopped by one known rule.
    assert len(results) == len(plan)
    outcomes = Counter(r.outcome for r in results)
    assert set(outcomes) <= {"passed", *RULES}
    totals = await counts_by_rule(proxy, "brownout_guard_trips_total")
    assert totals == Counter({k: v for k, v in outcomes.items() if k != "passed"})
    assert sum(totals.values()) + outcomes["passed"] == len(plan)
