"""No client bytes reach a response header unescaped (issue 20).

Before, the names of body fields dropped for a backend that does not honour
them (policy `ladder.failover.unsupported_fields: drop`) went raw into
`X-Brownout-Dropped`: a field named `"a\\r\\nb"` made aiohttp refuse the
response head (`ValueError: Forbidden control character`), the client got an
empty reply, the log a traceback — and the access log said 200. Field names
are now HTTP tokens or a 400 naming them (`proxy.ingress.validate`), and the
header is escaped and bounded (`proxy.openai.headers.dropped_value`).

Then a property test drives the real app, on the real listening path
(`proxy.server.start_site`), with hostile values in everything a client
controls that Brownout reads — `X-Request-Id`, `X-Session-Id`, `X-Priority`,
`Authorization`, body field names, content part types, model names — and
parses every reply strictly: a well-formed HTTP/1.1 response, every header
line a token, `: ` and visible ASCII (no CR, LF, NUL, no byte outside
ASCII), the status the inputs call for (400 naming the bad input, never an
empty reply, never a 500), in the normal, throttle and maintenance tiers.
Every header Brownout sets is covered: X-Request-Id, X-Brownout-Tier,
X-Brownout-Backend, X-Brownout-Session, X-Brownout-Dropped, Retry-After,
x-should-retry, Content-Type, Cache-Control, X-Accel-Buffering, Allow,
Location, and the status page's.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.app import create_app
from proxy.openai.capabilities import PLAIN
from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from proxy.server import start_site
from tests.integration.conftest import FakeUpstream, chunk, free_port

TOKEN = "s3cret"
# RFC 9110 §5.6.2, spelled out here (not imported: this is the oracle).
TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9]{2}) [\x20-\x7e]*\Z")
# A header line: a token, a colon, a value of visible ASCII, space and tab.
HEADER_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\x20-\x7e\t]*)\Z")
FRESH_ID = re.compile(r"[0-9a-f]{32}\Z")
SANE_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}\Z")
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")


# -- a strict reader of one HTTP/1.1 response ---------------------------------------


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def get(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.lower()]
        assert len(found) <= 1, (name, found)
        return found[0] if found else None

    def error(self) -> dict[str, Any]:
        ctype = self.get("Content-Type") or ""
        assert ctype.startswith("application/json"), (self.status, ctype, self.body[:200])
        err = json.loads(self.body)["error"]
        assert isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys()
        return err


def parse_reply(data: bytes) -> Reply:
    """The response, or an AssertionError saying what is malformed."""
    assert data, "empty reply"
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, f"no end of head in {data[:300]!r}"
    lines = head.split(b"\r\n")
    m = STATUS_LINE.match(lines[0])
    assert m, f"bad status line {lines[0]!r}"
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        hm = HEADER_LINE.match(line)
        assert hm, f"bad header line {line!r}"
        assert b"\x00" not in line and b"\r" not in line and b"\n" not in line
        headers.append((hm.group(1).decode(), hm.group(2).decode().strip()))
    reply = Reply(int(m.group(1)), headers, b"")
    te = reply.get("Transfer-Encoding")
    if te is not None:
        assert te == "chunked", te
        reply.body = _dechunk(rest)
    else:
        length = reply.get("Content-Length")
        if length is not None:
            assert len(rest) == int(length), (length, len(rest))
        reply.body = rest
    return reply


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, sep, data = data.partition(b"\r\n")
        assert sep, "chunked body cut before its last chunk"
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out
        out += data[:size]
        assert data[size : size + 2] == b"\r\n", "chunk not followed by CRLF"
        data = data[size + 2 :]


# -- the proxy, its fake backend, an event loop of their own ------------------------


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    if not body.get("stream"):
        choice = {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        return web.json_response(
            {
                "object": "chat.completion",
                "choices": [{**choice, "index": 0, "finish_reason": "stop"}],
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk("ok"))
    await resp.write(chunk("", "stop"))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(request: web.Request) -> web.StreamResponse:
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


def _policy(upstream: str, tier: str) -> Policy:
    status = "503" if tier == "maintenance" else "200"
    return parse_policy(
        f"""
server:
  admin_token: {TOKEN}
backends:
  primary:
    url: {upstream}
    kind: transformers
    health: {{interval_s: 30}}
ladder:
  failover:
    unsupported_fields: drop
  maintenance:
    status_code: {status}
""",
        env={},
    )


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    port: int
    tier: str

    def send(self, raw: bytes) -> bytes:
        return self.loop.run_until_complete(self._send(raw))

    async def _send(self, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(raw)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()


async def _start(tier: str) -> AsyncIterator[Served]:
    fake = FakeUpstream(free_port())
    fake.handlers["/v1/chat/completions"] = _answer
    fake.handlers["/v1/completions"] = _answer
    fake.handlers["/v1/models"] = _models
    upstream = web.Application()
    upstream.router.add_route("*", "/{tail:.*}", fake.dispatch)
    up_runner = web.AppRunner(upstream, access_log=None)
    await up_runner.setup()
    await web.TCPSite(up_runner, "127.0.0.1", fake.port).start()
    app = create_app(_policy(fake.url, tier))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await start_site(runner, app, "127.0.0.1", port)
    rt = app[STATE].current
    if tier != "normal":
        rt.force_tier(tier)  # type: ignore[arg-type]
        rt.evaluate()  # the tier's admission rules (shedding) from the first request on
    try:
        yield Served(asyncio.get_running_loop(), port, tier)
    finally:
        await runner.cleanup()
        await up_runner.cleanup()


def _serve(tier: str) -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    gen = _start(tier)
    try:
        yield loop.run_until_complete(gen.__anext__())
    finally:
        loop.run_until_complete(gen.aclose())
        loop.close()


@pytest.fixture(scope="module", params=["normal", "throttle", "maintenance"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    yield from _serve(request.param)


@pytest.fixture(scope="module")
def normal() -> Iterator[Served]:
    yield from _serve("normal")


# -- what a client sends -------------------------------------------------------------

# Bytes a header value can hold on the wire (CR and LF would end the line):
# NUL and other controls, DEL, obs-text, UTF-8 of non-ASCII text and of a
# lone surrogate (not UTF-8 at all), separators, and plain token characters.
_NASTY = [b"\x00", b"\x01", b"\x1f", b"\x7f", b"\x80", b"\xff", b"\xed\xa0\x80", b"\t", b" "]
_NASTY += [b",", b";", b'"', b"%0D%0A", "é".encode(), "\u2028".encode(), "🙂".encode()]
header_bytes = st.lists(
    st.one_of(
        st.sampled_from(_NASTY),
        st.sampled_from([b"critical", b"normal", b"sheddable", b"abc", b"A-1.b:c", b"/+="]),
        st.binary(max_size=3).filter(lambda b: b"\r" not in b and b"\n" not in b),
    ),
    max_size=6,
).map(b"".join)
sane_token = st.text(alphabet=sorted(TCHAR), min_size=1, max_size=12)
# Text a JSON string can hold: any code point, lone surrogates and controls included.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
field_names = st.one_of(
    sane_token,
    any_text,
    st.sampled_from(["a\r\nSet-Cookie: x=1", "x\x00", "a b", "a,b", "é", "\ud800", ""]),
    st.integers(120, 300).map(lambda n: "f" * n),
)
# Names the proxy reads itself (a value "x" in one of them is a type error).
_READ = {"model", "messages", "prompt", "stream", "stream_options", "max_tokens"}
_READ |= {"max_completion_tokens", "n", "temperature", "top_p"}


def sometimes(hostile: st.SearchStrategy[Any], benign: st.SearchStrategy[Any]) -> Any:
    """A hostile value one time in four (several hostile slots at once still
    come up, but most examples get through to a backend)."""
    return st.integers(0, 3).flatmap(lambda i: hostile if i == 0 else benign)


@dataclass(frozen=True)
class Ask:
    route: str
    request_id: bytes | None
    session_id: bytes | None
    priority: bytes | None
    authorization: bytes | None
    model: str
    field: str | None
    part_type: str | None


asks = st.builds(
    Ask,
    route=st.sampled_from(
        [
            "chat",
            "chat_stream",
            "completions",
            "completions_stream",
            "models",
            "status",
            "healthz",
            "metrics",
            "tier_get",
            "tier_post",
            "page",
            "page_redirect",
        ]
    ),
    request_id=sometimes(header_bytes, st.none() | st.sampled_from([b"rid-1", b"a/b+c=d:e.f"])),
    session_id=sometimes(header_bytes, st.none() | st.sampled_from([b"sess-1", b"a" * 129])),
    priority=sometimes(header_bytes, st.none() | st.sampled_from([b"sheddable", b"critical"])),
    authorization=sometimes(header_bytes, st.none() | st.just(b"Bearer " + TOKEN.encode())),
    model=sometimes(any_text, st.just("tiny")),
    field=sometimes(field_names, st.none() | sane_token),
    part_type=sometimes(field_names, st.none() | st.sampled_from(["text", "image_url"])),
)


def _body(ask: Ask, tier: str) -> bytes | None:
    if ask.route == "tier_post":
        return json.dumps({"tier": None if tier == "normal" else tier}).encode()
    if not ask.route.startswith(("chat", "completions")):
        return None
    body: dict[str, Any] = {"model": ask.model, "stream": ask.route.endswith("_stream")}
    if ask.route.startswith("chat"):
        content: Any = "hi"
        if ask.part_type is not None:
            content = [{"type": ask.part_type, "text": "hi"}]
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = "hi"
    sent = sent_field(ask)
    if sent is not None:
        body[sent] = "x"
    return json.dumps(body).encode()  # ASCII: a lone surrogate is sent as its \\u escape


_TARGETS = {
    "chat": ("POST", "/v1/chat/completions"),
    "chat_stream": ("POST", "/v1/chat/completions"),
    "completions": ("POST", "/v1/completions"),
    "completions_stream": ("POST", "/v1/completions"),
    "models": ("GET", "/v1/models"),
    "status": ("GET", "/brownout/status"),
    "healthz": ("GET", "/healthz"),
    "metrics": ("GET", "/metrics"),
    "tier_get": ("GET", "/brownout/tier"),
    "tier_post": ("POST", "/brownout/tier"),
    "page": ("GET", "/brownout/"),
    "page_redirect": ("GET", "/brownout"),
}


def sent_field(ask: Ask) -> str | None:
    """The extra field's name as sent (none when it names a field already
    there; `x-` before one the proxy reads, whose value "x" is a type error)."""
    if ask.field is None or ask.field in ("model", "stream"):
        return None
    if ask.field == ("messages" if ask.route.startswith("chat") else "prompt"):
        return None
    return ask.field if ask.field not in _READ else "x-" + ask.field


def _wire(ask: Ask, body: bytes | None) -> bytes:
    method, path = _TARGETS[ask.route]
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: test", b"Connection: close"]
    for name, value in (
        (b"X-Request-Id", ask.request_id),
        (b"X-Session-Id", ask.session_id),
        (b"X-Priority", ask.priority),
        (b"Authorization", ask.authorization),
    ):
        if value is not None:
            head.append(name + b": " + value)
    if body is not None:
        head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + (body or b"")


# -- what the client should get -------------------------------------------------------


def _has_ctl(value: bytes | None) -> bool:
    return value is not None and any((b < 0x20 and b != 0x09) or b == 0x7F for b in value)


def _text(value: bytes) -> str:
    # aiohttp's decoding of a header value (surrogate escapes for non-UTF-8).
    return value.decode("utf-8", "surrogateescape").strip(" \t")


def _is_token(name: str) -> bool:
    return 1 <= len(name) <= 128 and all(c in TCHAR for c in name)


def _has_surrogate(s: str | None) -> bool:
    return s is not None and any(0xD800 <= ord(c) <= 0xDFFF for c in s)


@dataclass(frozen=True)
class Expected:
    status: int | tuple[int, ...]
    code: str | None = None
    param: str | None = None


def expected(ask: Ask, tier: str) -> Expected:
    """The status (and error) the inputs call for, from the documented rules."""
    if any(_has_ctl(v) for v in (ask.request_id, ask.session_id, ask.priority, ask.authorization)):
        return Expected(400, "bad_request")  # the HTTP parser: invalid header value
    _method, path = _TARGETS[ask.route]
    if ask.route == "tier_get":
        return Expected(405, "method_not_allowed")
    needs_auth = path.startswith("/v1/") or ask.route == "tier_post"
    if needs_auth and ask.authorization is not None:
        try:
            ask.authorization.decode("utf-8")
        except UnicodeDecodeError:
            return Expected(400, "invalid_header", "Authorization")
    if ask.route == "tier_post":
        if ask.authorization is None or _text(ask.authorization) != f"Bearer {TOKEN}":
            return Expected(401, "unauthorized")
        return Expected(200)
    if ask.route == "page_redirect":
        return Expected(301)
    shed = tier == "throttle" and ask.priority is not None and _text(ask.priority) == "sheddable"
    if not ask.route.startswith(("chat", "completions")):
        if ask.route == "models" and tier == "maintenance":
            return Expected(503, "service_unavailable")
        if ask.route == "models" and shed:
            return Expected(429, "rate_limit_exceeded")
        return Expected(200)
    chat = ask.route.startswith("chat")
    part = ask.part_type if chat else None
    field = sent_field(ask)
    if _has_surrogate(ask.model) or _has_surrogate(field) or _has_surrogate(part):
        return Expected(400, "invalid_json")
    if field is not None and not _is_token(field):
        return Expected(400, "invalid_field_name", field[:128])
    if part is not None and not _is_token(part):
        return Expected(400, "invalid_field_name", "messages[0].content[0].type")
    if ask.session_id is not None:
        if not chat:
            return Expected(400, "invalid_session", "X-Session-Id")
        if not SESSION_ID.match(_text(ask.session_id)):
            return Expected(400, "invalid_session_id", "X-Session-Id")
        if part is not None and part != "text":
            return Expected(400, "invalid_session", "messages")  # no text: no question
    if tier == "maintenance":
        return Expected(503)
    if shed:
        return Expected(429, "rate_limit_exceeded")
    return Expected(200)


def _dropped(ask: Ask) -> set[str]:
    chat = ask.route.startswith("chat")
    known = PLAIN.chat if chat else PLAIN.completions
    out: set[str] = set()
    name = sent_field(ask)
    if name is not None and name not in known:
        out.add(name)
    if chat and ask.part_type is not None and ask.part_type != "text":
        out.add(f"messages[].content[type={ask.part_type}]")
    return out


# -- the properties -------------------------------------------------------------------


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ask=asks)
def test_every_response_is_well_formed_and_its_status_is_what_the_input_calls_for(
    served: Served, ask: Ask
) -> None:
    reply = parse_reply(served.send(_wire(ask, _body(ask, served.tier))))
    want = expected(ask, served.tier)
    event(f"{ask.route}: {reply.status} {want.code or ''}")
    allowed = want.status if isinstance(want.status, tuple) else (want.status,)
    assert reply.status in allowed, (ask, reply.status, reply.body[:300])
    assert reply.status < 500 or reply.status == 503, reply.body[:300]
    if want.code is not None:
        err = reply.error()
        assert err["code"] == want.code, (ask, err)
        if want.param is not None:
            assert err["param"] == want.param, (ask, err)

    # Every response names its request: the client's id when it is sane.
    rid = reply.get("X-Request-Id")
    assert rid is not None
    sent = None if ask.request_id is None else _text(ask.request_id)
    if want.code == "bad_request" or sent is None or not SANE_ID.match(sent):
        assert FRESH_ID.match(rid), rid
    else:
        assert rid == sent

    _method, path = _TARGETS[ask.route]
    if path.startswith("/v1/"):
        assert reply.get("X-Brownout-Tier") in (
            None,
            "normal",
            "throttle",
            "failover",
            "maintenance",
        )
    if reply.status in (200, 503, 429) and path.startswith("/v1/") and want.code != "bad_request":
        assert reply.get("X-Brownout-Tier") == served.tier
        assert reply.get("X-Brownout-Backend") in ("primary", "maintenance")
    if reply.status == 200 and ask.route.endswith("_stream"):
        assert (reply.get("Content-Type") or "").startswith("text/event-stream")
        assert reply.get("X-Accel-Buffering") == "no"
        assert reply.get("Cache-Control") == "no-cache"
        assert b"data: [DONE]" in reply.body
    if reply.status in (503, 429):
        assert (reply.get("Retry-After") or "").isdigit()
    if reply.status == 405:
        assert reply.get("Allow") == "POST"

    dropped = reply.get("X-Brownout-Dropped")
    if (
        reply.status == 200
        and served.tier != "maintenance"
        and ask.route.startswith(("chat", "comp"))
    ):
        want_dropped = _dropped(ask)
        if want_dropped:
            assert dropped is not None and set(dropped.split(",")) == want_dropped, (ask, dropped)
        else:
            assert dropped is None, (ask, dropped)
    if ask.session_id is not None and reply.status == 200 and ask.route.startswith("chat"):
        assert reply.get("X-Brownout-Session") in ("used", "unavailable")


# -- the defect, named -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a\r\nSet-Cookie: x=1", "a\nb", "a\rb", "x\x00y", "\x7f", "a b", "a,b", "é", "f" * 129, ""],
    ids=["crlf", "lf", "cr", "nul", "del", "space", "comma", "non-ascii", "129-chars", "empty"],
)
@pytest.mark.parametrize("route", ["chat", "chat_stream", "completions"])
def test_a_field_name_that_is_not_a_token_is_a_400_naming_it(
    normal: Served, name: str, route: str
) -> None:
    ask = Ask(route, b"rid-1", None, None, None, "tiny", name, None)
    reply = parse_reply(normal.send(_wire(ask, _body(ask, "normal"))))
    assert reply.status == 400, reply.body[:300]
    err = reply.error()
    assert err["code"] == "invalid_field_name" and err["param"] == name[:128]
    assert json.dumps(name[:64])[1:-1] in err["message"]  # escaped, readable
    assert err["message"].isascii() and err["message"].isprintable()
    assert reply.get("X-Request-Id") == "rid-1"


def test_a_content_part_type_that_is_not_a_token_is_a_400_naming_it(normal: Served) -> None:
    ask = Ask("chat", None, None, None, None, "tiny", None, "image\r\nX-Evil: 1")
    reply = parse_reply(normal.send(_wire(ask, _body(ask, "normal"))))
    assert reply.status == 400
    err = reply.error()
    assert err["code"] == "invalid_field_name"
    assert err["param"] == "messages[0].content[0].type"


def test_a_token_field_is_dropped_and_named(normal: Served) -> None:
    ask = Ask("chat", None, None, None, None, "tiny", "best_of", "input_audio")
    reply = parse_reply(normal.send(_wire(ask, _body(ask, "normal"))))
    assert reply.status == 200
    assert reply.get("X-Brownout-Dropped") == "best_of,messages[].content[type=input_audio]"
