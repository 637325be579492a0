"""Sessions end to end: `X-Session-Id` through the proxy, over real sockets.

What a client sees (status, `X-Brownout-Session`, bodies), what the upstream
receives (the merged, trimmed `messages`) and what the store holds (Redis
hashes read back with a raw client) for:

1. a three-turn conversation (memory:// and redis://, streaming and not);
2. the Redis layout: `history`, `last_active`, TTL refreshed on use, max_turns;
3. unfinished answers are never saved (errors, cut streams, client gone, 500s);
4. 20 concurrent turns on one session, none lost;
5. a Redis outage: served statelessly, counted, reported; back when Redis is;
6. session id validation and API-key scoping;
7. token trimming with the tiny model's real tokenizer (block trimming);
8. a real vLLM: the history reaches the engine, and block trimming's effect on
   its prefix cache compared with a sliding window.

The shared Redis on 127.0.0.1:6379 has other users: each test writes under its
own `brownout-test:{uuid}:` prefix and deletes it afterwards. Outage tests run
a private `redis-server` they stop and restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.openai.sse import SSEParser
from proxy.policy import Policy, parse_policy
from tests.harness.vllm import VLLMServer
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy, chunk, free_port

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SYSTEM: dict[str, str] = {"role": "system", "content": "You are a terse assistant."}
ROLE_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"

Msg = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# =========================================================================== helpers


def redis_answers(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def key_prefix() -> str:
    return f"brownout-test:{uuid.uuid4().hex}:"


@contextlib.asynccontextmanager
async def shared_redis_client(key_prefix: str) -> AsyncIterator[aioredis.Redis]:
    """A raw client on the shared Redis; every key under `key_prefix` is deleted at the end."""
    if not redis_answers(6379):
        pytest.skip("no Redis on 127.0.0.1:6379")
    client = aioredis.Redis.from_url(SHARED_REDIS_URL, decode_responses=True)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{key_prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
async def shared_redis(key_prefix: str) -> AsyncIterator[aioredis.Redis]:
    async with shared_redis_client(key_prefix) as client:
        yield client


class PrivateRedis:
    """A throw-away redis-server on its own port (no persistence), stoppable and restartable."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        with (self.workdir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while not redis_answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGCONT)  # in case it was paused
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def policy(
    primary: str,
    *,
    fallback: str | None = None,
    sessions: dict[str, Any] | None = None,
    primary_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Policy:
    """Like conftest's make_policy (short timeouts, fast probes), plus the session knobs;
    maintenance answers off so failures reach the client as errors."""
    backend = {
        "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1},
        "health": {"interval_s": 0.2, "timeout_s": 0.5},
    }
    doc: dict[str, Any] = {
        "server": {"heartbeat_s": 0.3},
        "backends": {"primary": _merge({"url": primary, **backend}, primary_extra or {})},
        "ladder": {"maintenance": {"enabled": False}},
        "sessions": sessions or {},
    }
    if fallback is not None:
        doc["backends"]["fallback"] = {"url": fallback, "kind": "transformers", **backend}
    return parse_policy(yaml.safe_dump(_merge(doc, extra or {})), "sessions-test.yaml")


def redis_sessions(prefix: str, url: str = SHARED_REDIS_URL, **knobs: Any) -> dict[str, Any]:
    return {"store": url, "key_prefix": prefix, **knobs}


def user(text: str) -> Msg:
    return {"role": "user", "content": text}


def assistant(text: str) -> Msg:
    return {"role": "assistant", "content": text}


def answer_for(question: str) -> str:
    # Non-ASCII on purpose: streamed pieces are split inside it.
    return f"Réponse ✓ to «{question}»: noted, all good 🚀."


def pieces(text: str, n: int = 3) -> list[str]:
    step = max(1, -(-len(text) // n))
    return [text[i : i + step] for i in range(0, len(text), step)]


def completion(text: str, finish: str | None = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


async def stream_text(request: web.Request, text: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(ROLE_CHUNK)
    for p in pieces(text):
        await resp.write(chunk(p))
    await resp.write(chunk("", "stop"))
    await resp.write(DONE)
    return resp


class ChatFake:
    """The fake upstream's chat endpoint: records every body, answers `answer(question)`
    (streamed in pieces or as one JSON body, as asked). `script` holds one-shot
    handlers used, in order, for the next requests instead."""

    def __init__(
        self,
        fake: FakeUpstream,
        answer: Callable[[str], str] = answer_for,
        delay: Callable[[], float] | None = None,
    ) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answered: dict[str, str] = {}
        self.script: list[Handler] = []
        self.answer = answer
        self.delay = delay
        fake.handlers["/v1/chat/completions"] = self.handle

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        if self.script:
            return await self.script.pop(0)(request)
        question = body["messages"][-1]["content"]
        text = self.answer(question)
        self.answered[question] = text
        if self.delay is not None:
            await asyncio.sleep(self.delay())
        if body.get("stream"):
            return await stream_text(request, text)
        return web.json_response(completion(text))

    def messages(self, i: int = -1) -> list[Msg]:
        return cast(list[Msg], self.bodies[i]["messages"])


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    raw: bytes

    @property
    def session(self) -> str | None:
        return self.headers.get("X-Brownout-Session")

    @property
    def is_stream(self) -> bool:
        return self.headers.get("Content-Type", "").startswith("text/event-stream")

    def events(self) -> list[bytes]:
        return [e.data for e in SSEParser().feed(self.raw) if e.data is not None]

    @property
    def text(self) -> str:
        """The assistant text the client got (stream deltas joined)."""
        if not self.is_stream:
            content = json.loads(self.raw)["choices"][0]["message"]["content"]
            return cast(str, content)
        out = []
        for data in self.events():
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            assert "error" not in obj, f"in-band error: {obj}"
            for ch in obj.get("choices", []):
                out.append(ch.get("delta", {}).get("content") or "")
        return "".join(out)

    def error(self) -> dict[str, Any]:
        """The error object: the JSON body's, or the in-band error event's."""
        if not self.is_stream:
            return cast(dict[str, Any], json.loads(self.raw)["error"])
        for data in self.events():
            if data != b"[DONE]" and "error" in (obj := json.loads(data)):
                return cast(dict[str, Any], obj["error"])
        raise AssertionError(f"no error in {self.raw!r}")


async def ask(
    proxy: RunningProxy,
    question: str,
    *,
    sid: str | None,
    stream: bool = True,
    system: Msg | None = SYSTEM,
    headers: dict[str, str] | None = None,
    max_tokens: int = 32,
    path: str = "/v1/chat/completions",
) -> Reply:
    messages = ([system] if system is not None else []) + [user(question)]
    body = {"model": "tiny", "messages": messages, "stream": stream, "max_tokens": max_tokens}
    h = dict(headers or {})
    if sid is not None:
        h["X-Session-Id"] = sid
    async with proxy.session.post(proxy.url + path, json=body, headers=h) as resp:
        raw = await resp.read()
        return Reply(resp.status, CIMultiDict(resp.headers), raw)


async def metric(proxy: RunningProxy, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the proxy's /metrics (0 when the labelled child does not exist yet)."""
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    want = labels or {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                return float(s.value)
    return 0.0


async def get_status(proxy: RunningProxy) -> dict[str, Any]:
    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        assert resp.status == 200
        return cast(dict[str, Any], await resp.json())


async def wait_for(
    check: Callable[[], Awaitable[bool]], what: str, within: float = 5.0, every: float = 0.02
) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(every)


async def idle(proxy: RunningProxy) -> bool:
    return bool((await get_status(proxy))["concurrency"]["inflight"] == 0)


async def stored(client: aioredis.Redis, key: str) -> list[Msg] | None:
    raw = await client.hget(key, "history")
    return None if raw is None else cast(list[Msg], json.loads(raw))


def anon_key(prefix: str, sid: str) -> str:
    return f"{prefix}session:anon:{sid}"


def new_sid() -> str:
    return f"conv-{uuid.uuid4().hex[:12]}"


# =========================================================================== 1, 2


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.real)])
async def store_knobs(
    request: pytest.FixtureRequest, key_prefix: str
) -> AsyncIterator[dict[str, Any]]:
    """The `sessions` policy section of each store kind (Redis: own prefix, cleaned up)."""
    if request.param == "memory":
        yield {}
        return
    async with shared_redis_client(key_prefix):
        yield redis_sessions(key_prefix)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_three_turn_conversation_forwards_the_merged_history(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    store_knobs: dict[str, Any],
    stream: bool,
) -> None:
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(policy(fake_upstream.url, sessions=store_knobs))
    sid = new_sid()
    questions = ["What is the capital of France?", "And of Italy?", "Which one is bigger?"]
    replies = []
    for q in questions:
        r = await ask(proxy, q, sid=sid, stream=stream)
        assert r.status == 200, r.raw
        assert r.session == "used"
        assert r.headers["X-Brownout-Backend"] == "primary"
        assert r.is_stream is stream
        replies.append(r)
    answers = [chat.answered[q] for q in questions]
    # The client got exactly what the upstream said (streamed pieces joined).
    assert [r.text for r in replies] == answers
    u1, u2, u3 = (user(q) for q in questions)
    a1, a2, _ = (assistant(a) for a in answers)
    assert chat.messages(0) == [SYSTEM, u1]
    assert chat.messages(1) == [SYSTEM, u1, a1, u2]
    assert chat.messages(2) == [SYSTEM, u1, a1, u2, a2, u3]
    # Everything else in the body is the client's.
    for body in chat.bodies:
        assert body["model"] == "tiny"
        assert body["max_tokens"] == 32
        assert body["stream"] is stream
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "ok"}) == 3
    assert await metric(proxy, "brownout_session_ops_total", {"op": "load", "result": "ok"}) == 3


async def test_a_long_stream_read_in_big_regions_is_saved_whole(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The saved answer of a stream the relay reads in big regions (runs of
    text chunks, whose text is taken from the relay's cut: issue 24) is the
    whole answer, escapes and all."""
    chat = ChatFake(fake_upstream)
    words = [f"w{i}" + (' "q" ' if i % 7 == 0 else " é ") for i in range(600)]

    async def big_reads(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        events = [ROLE_CHUNK, *(chunk(w) for w in words), chunk("", "stop"), DONE]
        for i in range(0, len(events), 150):
            await resp.write(b"".join(events[i : i + 150]))
        return resp

    chat.script.append(big_reads)
    proxy = await start_proxy(policy(fake_upstream.url, sessions={}))
    sid = new_sid()
    r = await ask(proxy, "long one", sid=sid)
    assert r.status == 200 and r.text == "".join(words)
    r = await ask(proxy, "next", sid=sid)
    assert chat.messages() == [SYSTEM, user("long one"), assistant("".join(words)), user("next")]


@pytest.mark.real
async def test_redis_holds_history_and_last_active_with_ttl_refreshed_and_max_turns(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    ttl = 600
    proxy = await start_proxy(
        policy(fake_upstream.url, sessions=redis_sessions(key_prefix, ttl_s=ttl, max_turns=3))
    )
    sid = new_sid()
    key = anon_key(key_prefix, sid)
    t0 = int(time.time())
    r = await ask(proxy, "turn 1", sid=sid)
    assert r.status == 200 and r.session == "used"
    h = await shared_redis.hgetall(key)
    assert set(h) == {"history", "last_active", "turn_ids"}  # turn_ids: idempotent retried saves
    assert json.loads(h["history"]) == [user("turn 1"), assistant(answer_for("turn 1"))]
    assert t0 <= int(h["last_active"]) <= time.time() + 1
    assert ttl - 5 <= await shared_redis.ttl(key) <= ttl

    # A load refreshes the TTL and last_active even when nothing gets saved (upstream 400).
    await shared_redis.expire(key, 30)
    await shared_redis.hset(key, "last_active", "1")

    async def bad_request(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "nope", "type": "BadRequestError", "param": None, "code": 400}},
            status=400,
        )

    chat.script.append(bad_request)
    r = await ask(proxy, "rejected question", sid=sid, stream=False)
    assert r.status == 400 and r.session == "used"
    assert ttl - 5 <= await shared_redis.ttl(key) <= ttl
    assert int(await shared_redis.hget(key, "last_active") or 0) >= t0
    assert await stored(shared_redis, key) == [user("turn 1"), assistant(answer_for("turn 1"))]

    # A saved turn leaves it at ttl_s too.
    await shared_redis.expire(key, 30)
    r = await ask(proxy, "turn 2", sid=sid)
    assert r.status == 200
    assert ttl - 5 <= await shared_redis.ttl(key) <= ttl

    # max_turns = 3: only the last three turns are kept, and only those are forwarded.
    for q in ("turn 3", "turn 4"):
        assert (await ask(proxy, q, sid=sid)).status == 200
    kept = [m for q in ("turn 2", "turn 3", "turn 4") for m in (user(q), assistant(answer_for(q)))]
    assert await stored(shared_redis, key) == kept
    r = await ask(proxy, "turn 5", sid=sid, stream=False)
    assert r.status == 200
    assert chat.messages() == [SYSTEM, *kept, user("turn 5")]
    assert await stored(shared_redis, key) == [*kept[2:], user("turn 5"), assistant(r.text)]


# =========================================================================== 3


def cut_after(prefix: bytes, *, abort: bool) -> Handler:
    """A stream that sends `prefix`, then dies: RST (abort) or a clean EOF, never finished."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(prefix)
        if abort:
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
        return resp

    return handler


def status_error(status: int) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "error": {
                    "message": "EngineCore encountered an issue.",
                    "type": "InternalServerError",
                    "param": None,
                    "code": status,
                }
            },
            status=status,
        )

    return handler


async def error_event_first(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    await resp.write(
        b'data: {"error": {"message": "EngineCore encountered an issue.", '
        b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
    )
    await resp.write(DONE)
    return resp


@pytest.mark.real
async def test_nothing_is_saved_unless_the_answer_finished(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix),
            # Failures must not open the breaker: every request reaches the fake.
            extra={
                "ladder": {
                    "breaker": {"fail_max": 1000, "failure_rate": 0},
                    "failover": {"rescue_streams": False, "retry_max": 0},
                }
            },
        )
    )
    sid = new_sid()
    key = anon_key(key_prefix, sid)
    assert (await ask(proxy, "first", sid=sid)).status == 200
    first = [user("first"), assistant(answer_for("first"))]
    assert await stored(shared_redis, key) == first

    async def unchanged(what: str) -> None:
        assert await stored(shared_redis, key) == first, f"{what}: history changed"

    # Upstream error before the first byte (stream): an HTTP error, nothing saved.
    chat.script.append(status_error(500))
    r = await ask(proxy, "error before first byte", sid=sid)
    assert r.status == 500 and r.session == "used"
    assert r.error()["message"] == "EngineCore encountered an issue."
    await unchanged("500 before the first byte")

    # An error event as the first event: also an HTTP error, nothing saved.
    chat.script.append(error_event_first)
    r = await ask(proxy, "error event first", sid=sid)
    assert r.status == 500
    await unchanged("error event first")

    # Stream cut mid-answer (RST), rescue disabled: in-band error, nothing saved.
    partial = ROLE_CHUNK + chunk("Half an ") + chunk("answ")
    chat.script.append(cut_after(partial, abort=True))
    r = await ask(proxy, "cut by a reset", sid=sid)
    assert r.status == 200 and r.session == "used"
    assert r.error()["code"] in ("upstream_disconnect", "upstream_truncated")
    assert r.events()[-1] == b"[DONE]"
    await unchanged("stream reset mid-answer")

    # Stream that ends cleanly without finish_reason / [DONE]: truncated, nothing saved.
    chat.script.append(cut_after(partial, abort=False))
    r = await ask(proxy, "cut by a clean EOF", sid=sid)
    assert r.status == 200
    assert r.error()["code"] == "upstream_truncated"
    await unchanged("stream truncated")

    # [DONE] without any finish_reason: the design saves only answers whose
    # finish_reason was seen.
    chat.script.append(cut_after(partial + DONE, abort=False))
    r = await ask(proxy, "done without finish", sid=sid)
    assert r.status == 200
    await unchanged("[DONE] without finish_reason")

    # The client leaves mid-stream. Had the proxy kept relaying, the fake would
    # finish the answer after 3 s — and a buggy proxy would save it.
    upstream_saw_close = asyncio.Event()

    async def long_answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            await resp.write(ROLE_CHUNK + chunk("Never "))
            end = time.monotonic() + 3
            while time.monotonic() < end:
                await asyncio.sleep(0.02)
                await resp.write(chunk("more "))
            await resp.write(chunk("", "stop") + DONE)
        except (ConnectionError, asyncio.CancelledError):
            upstream_saw_close.set()
            raise
        return resp

    chat.script.append(long_answer)
    body = {"model": "tiny", "messages": [user("client leaves")], "stream": True}
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}
    ) as resp:
        assert resp.status == 200
        assert b"Never" in await resp.content.readuntil(b"Never")
        resp.close()
    await asyncio.wait_for(upstream_saw_close.wait(), 2)
    await wait_for(lambda: idle(proxy), "the proxy to finish the abandoned request")
    await unchanged("client disconnect")

    # Non-streaming 500: the error reaches the client, nothing saved.
    chat.script.append(status_error(500))
    r = await ask(proxy, "json 500", sid=sid, stream=False)
    assert r.status == 500 and r.session == "used"
    await unchanged("non-streaming 500")

    # A non-streaming 200 without finish_reason is not a finished answer either.
    async def unfinished_json(request: web.Request) -> web.StreamResponse:
        return web.json_response(completion("cut short", finish=None))

    chat.script.append(unfinished_json)
    r = await ask(proxy, "json without finish", sid=sid, stream=False)
    assert r.status == 200
    await unchanged("non-streaming answer without finish_reason")

    # Output the guard stops (a control character) is no answer either: stream and JSON.
    chat.script.append(cut_after(ROLE_CHUNK + chunk("bad \u0017 output") + DONE, abort=False))
    r = await ask(proxy, "guarded stream", sid=sid)
    assert r.status == 200
    assert r.error()["code"] == "invalid_output"
    await unchanged("guard trip mid-stream")

    async def bad_json(request: web.Request) -> web.StreamResponse:
        return web.json_response(completion("bad \u0017 output"))

    chat.script.append(bad_json)
    r = await ask(proxy, "guarded json", sid=sid, stream=False)
    assert r.status == 502
    assert r.error()["code"] == "invalid_output"
    await unchanged("guard trip in a JSON answer")

    # The next finished turn sees only the finished history, and is saved after it.
    r = await ask(proxy, "last", sid=sid, stream=False)
    assert r.status == 200
    assert chat.messages() == [SYSTEM, *first, user("last")]
    assert await stored(shared_redis, key) == [*first, user("last"), assistant(answer_for("last"))]
    assert await metric(proxy, "brownout_session_ops_total", {"op": "save", "result": "ok"}) == 2


async def test_maintenance_answer_is_not_saved(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            extra={"ladder": {"maintenance": {"enabled": True}, "failover": {"retry_max": 0}}},
        )
    )
    sid = new_sid()
    assert (await ask(proxy, "first", sid=sid)).status == 200
    chat.script.append(status_error(500))
    r = await ask(proxy, "during the outage", sid=sid)
    assert r.headers["X-Brownout-Backend"] == "maintenance"
    assert r.session == "used"
    r = await ask(proxy, "after", sid=sid)
    assert r.status == 200
    assert chat.messages() == [SYSTEM, user("first"), assistant(answer_for("first")), user("after")]


async def test_rescued_stream_saves_the_whole_answer(
    start_proxy: ProxyFactory, fake_upstream: FakeUpstream
) -> None:
    # Rescue on: the turn stored is the primary's partial text + the fallback's continuation.
    fallback = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fallback.dispatch)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fallback.port).start()
    try:
        chat = ChatFake(fake_upstream)
        continued: list[dict[str, Any]] = []

        async def continuation(request: web.Request) -> web.StreamResponse:
            continued.append(json.loads(await request.read()))
            return await stream_text(request, "brown fox.")

        fallback.handlers["/v1/chat/completions"] = continuation
        proxy = await start_proxy(policy(fake_upstream.url, fallback=fallback.url))
        sid = new_sid()
        assert (await ask(proxy, "first", sid=sid)).status == 200
        chat.script.append(cut_after(ROLE_CHUNK + chunk("The ") + chunk("quick "), abort=True))
        r = await ask(proxy, "second", sid=sid)
        assert r.status == 200
        assert r.text == "The quick brown fox."
        first = [user("first"), assistant(answer_for("first"))]
        assert continued[0]["messages"] == [
            SYSTEM,
            *first,
            user("second"),
            assistant("The quick "),
        ]
        await ask(proxy, "third", sid=sid)
        assert chat.messages() == [
            SYSTEM,
            *first,
            user("second"),
            assistant("The quick brown fox."),
            user("third"),
        ]
    finally:
        await runner.cleanup()


# =========================================================================== 4


@pytest.mark.real
async def test_concurrent_turns_on_one_session_are_all_kept(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    rng = random.Random(7)
    ChatFake(fake_upstream, delay=lambda: rng.uniform(0, 0.05))
    # A generous Redis deadline: this checks atomicity, not latency on a busy box.
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix, max_turns=30, redis_timeout_s=2.0),
        )
    )
    sid = new_sid()
    questions = [f"parallel question {i}" for i in range(20)]
    replies = await asyncio.gather(
        *(ask(proxy, q, sid=sid, stream=i % 2 == 0) for i, q in enumerate(questions))
    )
    assert [r.status for r in replies] == [200] * 20
    assert {r.session for r in replies} == {"used"}
    history = await stored(shared_redis, anon_key(key_prefix, sid))
    assert history is not None
    assert len(history) == 40, "a concurrent turn was lost"
    users = history[0::2]
    answers = history[1::2]
    assert all(m["role"] == "user" for m in users)
    assert sorted(m["content"] for m in users) == sorted(questions)
    # Each question is followed by its own answer.
    assert [a for a in answers] == [assistant(answer_for(u["content"])) for u in users]


# =========================================================================== 5


@pytest.mark.real
async def test_redis_outage_is_served_statelessly_and_recovers(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    private_redis: PrivateRedis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix, private_redis.url, redis_timeout_s=0.3),
        )
    )
    sid = new_sid()
    r = await ask(proxy, "before", sid=sid)
    assert r.status == 200 and r.session == "used"

    # Redis dies between the load and the save: the answer still reaches the client.
    async def redis_dies_then_answers(request: web.Request) -> web.StreamResponse:
        await asyncio.to_thread(private_redis.stop)
        return web.json_response(completion("saved nowhere"))

    chat.script.append(redis_dies_then_answers)
    r = await ask(proxy, "redis dies meanwhile", sid=sid, stream=False)
    assert r.status == 200 and r.text == "saved nowhere"
    # The answer was promised to the session: its turn waits for Redis, in order.
    save_queued = {"op": "save", "result": "queued"}
    assert await metric(proxy, "brownout_session_ops_total", save_queued) == 1
    assert await metric(proxy, "brownout_session_saves_waiting") == 1

    t0 = time.monotonic()
    r = await ask(proxy, "during the outage", sid=sid)
    assert time.monotonic() - t0 < 2.0
    assert r.status == 200
    assert r.session == "unavailable"
    assert r.text == answer_for("during the outage")
    assert chat.messages() == [SYSTEM, user("during the outage")]  # served without history
    ops = {"op": "load", "result": "unavailable"}
    assert await metric(proxy, "brownout_session_ops_total", ops) == 1
    assert await metric(proxy, "brownout_session_store_up") == 0
    st = (await get_status(proxy))["sessions"]
    assert st["healthy"] is False
    assert st["last_error"]

    # A hung Redis (SIGSTOP, port open) costs at most the deadline, not a hang.
    await asyncio.to_thread(private_redis.start)
    private_redis.pause()
    try:
        t0 = time.monotonic()
        r = await ask(proxy, "while hung", sid=sid, stream=False)
        assert time.monotonic() - t0 < 2.0
        assert r.status == 200 and r.session == "unavailable"
        assert await metric(proxy, "brownout_session_ops_total", ops) == 2
    finally:
        private_redis.resume()

    # Back: the waiting turn is written (the restarted Redis was empty), then
    # requests work again, save, and merge — nothing finished was lost.
    deadline = time.monotonic() + 5
    while await metric(proxy, "brownout_session_saves_waiting") != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    late = {"op": "save", "result": "late"}
    assert await metric(proxy, "brownout_session_ops_total", late) == 1
    r = await ask(proxy, "after", sid=sid)
    assert r.status == 200 and r.session == "used"
    earlier = [user("redis dies meanwhile"), assistant("saved nowhere")]
    assert chat.messages() == [SYSTEM, *earlier, user("after")]
    r = await ask(proxy, "after again", sid=sid)
    assert r.session == "used"
    assert chat.messages() == [
        SYSTEM,
        *earlier,
        user("after"),
        assistant(answer_for("after")),
        user("after again"),
    ]
    st = (await get_status(proxy))["sessions"]
    assert st["healthy"] is True
    assert await metric(proxy, "brownout_session_store_up") == 1
    raw = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    try:
        history = await stored(raw, anon_key(key_prefix, sid))
    finally:
        await raw.aclose()
    assert history is not None and len(history) == 6


async def test_each_request_is_one_redis_round_trip_to_load_and_one_to_save(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    private_redis: PrivateRedis,
    key_prefix: str,
) -> None:
    """Issue 24, seen from Redis (MONITOR): a request with a session sends
    one EVALSHA to load it and one to save its turn — no other command, for
    a new session and for one with history, streamed or not."""
    ChatFake(fake_upstream)
    sessions = redis_sessions(key_prefix, private_redis.url, max_turns=2)
    proxy = await start_proxy(policy(fake_upstream.url, sessions=sessions))
    assert (await ask(proxy, "warm-up", sid=new_sid())).status == 200  # connect, load scripts
    admin = aioredis.Redis.from_url(private_redis.url, decode_responses=True)
    seen: list[str] = []
    started, ended = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        async with admin.monitor() as m:
            await admin.echo("rt-start")
            while True:
                cmd = await m.next_command()
                if cmd["command"] == "ECHO rt-start":
                    started.set()
                elif cmd["command"] == "ECHO rt-end":
                    ended.set()
                    return
                elif started.is_set() and cmd["client_type"] != "lua":
                    seen.append(cmd["command"].split(" ", 1)[0].upper())

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(started.wait(), 5)
        sids = [new_sid(), new_sid()]
        asked = 0
        for turn in range(3):  # new, with history, then trimmed to max_turns
            for sid, stream in zip(sids, (True, False), strict=True):
                r = await ask(proxy, f"turn {turn}", sid=sid, stream=stream)
                assert r.status == 200 and r.session == "used"
                asked += 1
        await admin.echo("rt-end")
        await asyncio.wait_for(ended.wait(), 5)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await admin.aclose()
    assert seen == ["EVALSHA"] * (2 * asked)


# =========================================================================== 6


BAD_IDS = [
    "",
    "has space",
    "../../etc/passwd",
    "a/b",
    "x" * 129,
    "semi;colon",
    "tab\there",
    'quote"d',
    "star*",
    "%0d%0aX-Evil:%201",
    "{braces}",
]


async def test_invalid_session_ids_are_rejected_before_the_upstream(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    ChatFake(fake_upstream)
    proxy = await start_proxy(policy(fake_upstream.url))
    for sid in BAD_IDS:
        r = await ask(proxy, "hi", sid=sid)
        assert r.status == 400, sid
        err = r.error()
        assert err["code"] == "invalid_session_id", sid
        assert err["param"] == "X-Session-Id"
        assert "X-Brownout-Session" not in r.headers
    # Limits that are fine: 128 characters of the allowed alphabet.
    ok = "A-z_0.9:" * 16
    assert (await ask(proxy, "hi", sid=ok)).status == 200
    assert await metric(proxy, "brownout_bad_requests_total", {"reason": "invalid_session_id"}) == (
        len(BAD_IDS)
    )

    # Raw bytes an HTTP client library would refuse to send: folded lines, bare
    # CR, NUL, non-ASCII. Whatever layer refuses them, the answer is a 400.
    port = int(proxy.url.rsplit(":", 1)[1])
    payload = json.dumps({"model": "tiny", "messages": [user("hi")]}).encode()
    for header in (
        b"X-Session-Id: abc\r\n def",
        b"X-Session-Id: abc\rdef",
        b"X-Session-Id: abc\x00def",
        "X-Session-Id: séssion".encode(),
        b"X-Session-Id: abc\r\n\tX-Evil: 1",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + header
            + b"\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + payload
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        await writer.wait_closed()
        assert status_line.split(b" ")[1] == b"400", (header, status_line)

    # A session turn needs a user message with text (the turn it stores).
    body = {"model": "tiny", "messages": [SYSTEM]}
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "fine"}
    ) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert (err["code"], err["param"]) == ("invalid_session", "messages")

    # The session header only works on chat completions.
    async with proxy.session.post(
        proxy.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi"},
        headers={"X-Session-Id": "fine"},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_session"
    sent = [p for p, _, _ in fake_upstream.requests if p.endswith("completions")]
    assert sent == ["/v1/chat/completions"]  # only the valid one reached the upstream


@pytest.mark.real
async def test_sessions_are_scoped_by_api_key(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    shared_redis: aioredis.Redis,
    key_prefix: str,
) -> None:
    chat = ChatFake(fake_upstream)
    k1, k2 = f"sk-one-{uuid.uuid4().hex}", f"sk-two-{uuid.uuid4().hex}"
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions=redis_sessions(key_prefix),
            extra={"server": {"api_keys": [k1, k2]}},
        )
    )
    sid = "shared-id"

    def auth(k: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {k}"}

    assert (await ask(proxy, "I am one", sid=sid, headers=auth(k1))).status == 200
    assert (await ask(proxy, "I am two", sid=sid, headers=auth(k2))).status == 200
    assert chat.messages() == [SYSTEM, user("I am two")]  # k1's turn is not k2's history
    r = await ask(proxy, "one again", sid=sid, headers=auth(k1))
    assert r.status == 200
    assert chat.messages() == [
        SYSTEM,
        user("I am one"),
        assistant(answer_for("I am one")),
        user("one again"),
    ]
    await ask(proxy, "two again", sid=sid, headers=auth(k2))
    assert chat.messages() == [
        SYSTEM,
        user("I am two"),
        assistant(answer_for("I am two")),
        user("two again"),
    ]
    # No key, or an unknown one: 401 before any session work.
    n = len(chat.bodies)
    for headers in ({}, auth("sk-wrong")):
        r = await ask(proxy, "who am i", sid=sid, headers=headers)
        assert r.status == 401
    assert len(chat.bodies) == n
    everything = sorted([k async for k in shared_redis.scan_iter(match=f"{key_prefix}*")])
    # Besides the sessions: each key's set of its sessions (max_sessions_per_client).
    keys = [k for k in everything if not k.startswith(f"{key_prefix}client:")]
    assert len(keys) == 2 and len(everything) == 4
    assert all(k1 not in k and k2 not in k for k in everything)
    for k in keys:
        assert k.startswith(f"{key_prefix}session:") and k.endswith(f":{sid}")
        assert ":anon:" not in k
        assert k1 not in k and k2 not in k  # the raw API key never lands in Redis


# =========================================================================== 7

WINDOW = 256
MAX_TOKENS = 24
MARGIN = 16
BUDGET = WINDOW - MAX_TOKENS - MARGIN
# Water marks for the fake-upstream test: a block (0.3 × budget) worth several
# of the tiny tokenizer's long turns; the real-vLLM test uses the defaults.
HIGH, LOW = 0.9, 0.6
LOREM_TEXT = (
    "the package left our warehouse on monday morning and should arrive on thursday "
    "please share your order number so that i can check the status refunds are usually "
    "processed within five to seven business days"
)
LOREM = LOREM_TEXT.split(" ")


def long_answer(question: str) -> str:
    seed = sum(question.encode())
    return f"About {question[:14]}: " + " ".join(
        LOREM[(seed + k * 5) % len(LOREM)] for k in range(8)
    )


class PromptCounter:
    """Token counts the way the engine sees the prompt: chat template + generation prompt."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def __call__(self, messages: list[Msg]) -> int:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(self.tok.encode(str(text), add_special_tokens=False))


def models_handler(max_model_len: int) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "tiny", "object": "model", "max_model_len": max_model_len}],
            }
        )

    return handler


async def test_trimming_with_the_real_tokenizer_keeps_a_stable_prefix(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tiny_model_dir: Path
) -> None:
    pytest.importorskip("transformers")
    count = PromptCounter(tiny_model_dir)
    chat = ChatFake(fake_upstream, answer=long_answer)
    fake_upstream.handlers["/v1/models"] = models_handler(WINDOW)
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            sessions={
                "max_turns": 50,
                "trimming": {"margin_tokens": MARGIN, "high_water": HIGH, "low_water": LOW},
            },
            primary_extra={"tokenizer": str(tiny_model_dir)},
        )
    )

    async def discovered() -> bool:
        return bool((await get_status(proxy))["backends"]["primary"]["max_model_len"] == WINDOW)

    await wait_for(discovered, "max_model_len discovered from /v1/models")

    sid = new_sid()
    turns: list[tuple[str, str]] = []  # what the session holds: (question, answer)
    cut = 0  # turns dropped, by the block rule (stateful here; the proxy replays it)
    cuts: list[int] = []
    for i in range(14):
        q = f"Q{i}: where is parcel {1000 + i}?"

        def prompt(c: int, q: str = q) -> list[Msg]:
            return [SYSTEM, *(m for u, a in turns[c:] for m in (user(u), assistant(a))), user(q)]

        size = count(prompt(cut))
        if size > HIGH * BUDGET:
            while cut < len(turns) and size > LOW * BUDGET:
                cut += 1
                size = count(prompt(cut))
        assert size <= BUDGET
        r = await ask(proxy, q, sid=sid, max_tokens=MAX_TOKENS, stream=i % 2 == 1)
        assert r.status == 200, r.raw
        assert r.session == "used"
        sent = chat.messages()
        assert sent[0] == SYSTEM and sent[-1] == user(q)
        assert count(sent) <= BUDGET, f"request {i}: {count(sent)} tokens > budget {BUDGET}"
        assert sent == prompt(cut), f"request {i}: expected {cut} turns dropped"
        turns.append((q, r.text))
        cuts.append(cut)

    trimmed = [c for c in cuts if c > 0]
    assert len(trimmed) >= 4, f"trimming never really happened: cuts {cuts}"
    # Block trimming: the cut moves in jumps, and between them each request's
    # prompt extends the previous one (vLLM's prefix cache hits).
    assert len(set(trimmed)) < len(trimmed), f"the cut moved on every request: {cuts}"
    assert any(len(set(trimmed[k : k + 2])) == 1 for k in range(len(trimmed) - 1))
    for k in range(1, len(cuts)):
        prev, cur = chat.messages(k - 1), chat.messages(k)
        shares = cur[: len(prev)] == prev
        assert shares == (cuts[k] == cuts[k - 1]), f"request {k}: prefix {shares}, cuts {cuts}"
    labels = {"backend": "primary"}
    assert await metric(proxy, "brownout_trimmed_requests_total", labels) == len(trimmed)
    assert await metric(proxy, "brownout_trimmed_turns_total", labels) == sum(trimmed)
    assert await metric(proxy, "brownout_token_count_estimates_total", labels) == 0

    # A question longer than the whole window: 400, nothing sent, nothing saved.
    n = len(chat.bodies)
    huge = " ".join(f"w{k}" for k in range(WINDOW))
    assert count([SYSTEM, user(huge)]) > BUDGET
    r = await ask(proxy, huge, sid=sid, max_tokens=MAX_TOKENS, stream=False)
    assert r.status == 400
    err = r.error()
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "messages"
    assert len(chat.bodies) == n

    # System + question need more than the budget but fit the window with
    # max_tokens: only the safety margin is exceeded, so the backend is the
    # judge — but of system + question, not of the stored history on top.
    words: list[str] = []
    while count([SYSTEM, user(" ".join(words))]) <= BUDGET + MARGIN // 2:
        words.append(f"v{len(words)}")
    edge = " ".join(words)
    assert BUDGET < count([SYSTEM, user(edge)]) <= WINDOW - MAX_TOKENS
    r = await ask(proxy, edge, sid=sid, max_tokens=MAX_TOKENS, stream=False)
    assert r.status == 200, r.raw
    sent = chat.messages()
    assert count(sent) + MAX_TOKENS <= WINDOW, (
        f"{len(sent)} messages, {count(sent)} prompt tokens sent to a {WINDOW}-token window"
    )
    assert sent == [SYSTEM, user(edge)]

    # The session goes on.
    q = "Question 14: one more?"
    r = await ask(proxy, q, sid=sid, max_tokens=MAX_TOKENS)
    assert r.status == 200
    sent = chat.messages()
    assert all(m["content"] != huge for m in sent)
    assert sent[-1] == user(q) and count(sent) <= BUDGET


# =========================================================================== 8


async def vllm_prefix_counters(
    server: VLLMServer, session: aiohttp.ClientSession
) -> tuple[float, float]:
    async with session.get(server.base_url + "/metrics") as resp:
        text = await resp.text()
    hits = queries = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "vllm:prefix_cache_queries_total":
                queries += s.value
    return hits, queries


def real_policy(
    server: VLLMServer, primary_extra: dict[str, Any] | None = None, **sessions: Any
) -> Policy:
    return policy(
        server.base_url,
        sessions=sessions,
        primary_extra={"timeouts": {"first_byte_s": 60, "idle_s": 30}, **(primary_extra or {})},
        # The random-weight model writes control characters: the output guard
        # would stop its answers, and this is about sessions.
        extra={"guard": {"enabled": False}},
    )


@pytest.mark.real
@pytest.mark.slow
async def test_real_vllm_receives_the_merged_history(
    live_vllm_server: VLLMServer, start_proxy: ProxyFactory
) -> None:
    proxy = await start_proxy(real_policy(live_vllm_server))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    sid = new_sid()
    questions = ["Hello, who are you?", "What can you do for me?", "Summarise our chat."]
    answers: list[str] = []
    last_usage = None
    try:
        for q in questions:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=[SYSTEM, user(q)],  # type: ignore[list-item]
                max_tokens=8,
                temperature=0,
                extra_headers={"X-Session-Id": sid},
            )
            assert raw.headers["x-brownout-session"] == "used"
            done = raw.parse()
            answers.append(done.choices[0].message.content or "")
            last_usage = done.usage
    finally:
        await client.close()
    merged = [
        SYSTEM,
        user(questions[0]),
        assistant(answers[0]),
        user(questions[1]),
        assistant(answers[1]),
        user(questions[2]),
    ]
    async with proxy.session.post(
        live_vllm_server.base_url + "/tokenize",
        json={"model": "tiny", "messages": merged, "add_generation_prompt": True},
    ) as resp:
        assert resp.status == 200
        expected = (await resp.json())["count"]
    assert last_usage is not None
    assert last_usage.prompt_tokens == expected


async def prefix_cache_run(
    server: VLLMServer,
    start_proxy: ProxyFactory,
    *,
    high: float,
    low: float,
    turns: int,
    tag: str,
) -> tuple[float, list[int]]:
    """One session of `turns` requests; returns vLLM's prefix-cache hit rate over
    it and each request's prompt tokens (as vLLM counted them)."""
    window, max_tokens, margin = 320, 12, 16
    proxy = await start_proxy(
        real_policy(
            server,
            {"max_model_len": window},
            max_turns=50,
            trimming={"margin_tokens": margin, "high_water": high, "low_water": low},
        )
    )

    async def model_known() -> bool:
        return bool((await get_status(proxy))["backends"]["primary"]["model"] == "tiny")

    # The /tokenize counter needs the served model name.
    await wait_for(model_known, "the served model discovered", within=10)
    # A different system prompt per run: no cache hits across runs.
    system = {"role": "system", "content": f"Session {tag}: you answer questions about parcels."}
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    sid = new_sid()
    prompts: list[int] = []
    before = await vllm_prefix_counters(server, proxy.session)
    try:
        for i in range(turns):
            done = await client.chat.completions.create(
                model="tiny",
                messages=[system, user(f"Question {i}: where is parcel {4000 + i} now?")],  # type: ignore[list-item]
                max_tokens=max_tokens,
                temperature=0,
                extra_headers={"X-Session-Id": sid},
            )
            assert done.usage is not None
            prompts.append(done.usage.prompt_tokens)
    finally:
        await client.close()
    after = before

    async def counted() -> bool:
        # vLLM counts every prompt token as one prefix-cache query.
        nonlocal after
        after = await vllm_prefix_counters(server, proxy.session)
        return after[1] - before[1] >= sum(prompts)

    await wait_for(counted, "vLLM's prefix-cache counters to cover the run", every=0.1)
    budget = window - max_tokens - margin
    assert max(prompts) <= budget, f"prompt over the budget {budget}: {prompts}"
    assert await metric(proxy, "brownout_trimmed_requests_total", {"backend": "primary"}) > 0
    hits, queries = after[0] - before[0], after[1] - before[1]
    assert queries > 0
    return hits / queries, prompts


@pytest.mark.real
@pytest.mark.slow
async def test_real_vllm_block_trimming_keeps_prefix_cache_hits(
    live_vllm_server: VLLMServer, start_proxy: ProxyFactory
) -> None:
    turns = 16
    block, block_prompts = await prefix_cache_run(
        live_vllm_server, start_proxy, high=0.9, low=0.7, turns=turns, tag="block"
    )
    sliding, sliding_prompts = await prefix_cache_run(
        live_vllm_server, start_proxy, high=0.99, low=0.98, turns=turns, tag="sliding"
    )
    print(
        f"\nvLLM prefix-cache hit rate over a {turns}-turn session: "
        f"block trimming (0.9/0.7) {block:.1%}, sliding window (0.99/0.98) {sliding:.1%}"
        f"\n  block prompt tokens:   {block_prompts}\n  sliding prompt tokens: {sliding_prompts}"
    )
    assert block >= sliding
