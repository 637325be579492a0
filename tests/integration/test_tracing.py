"""Traces (`telemetry.otlp_endpoint`): the SDK's OTLP/HTTP exporter talking
over a socket to a stand-in collector process (`otlp_receiver`), the real
proxy in front of scripted fakes.

What a user would notice: the request's span hangs under the client's
`traceparent`; each backend attempt is a child span, and the backend gets
that attempt's context as its own `traceparent` (so vLLM's spans join the
same trace); GenAI attributes say model and tokens; a collector that is
down or never answers costs serving nothing, and its lost spans are counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    chunk,
    free_port,
    make_policy,
)
from tests.integration.test_pipeline import metrics, total
from tests.integration.test_rescue_capabilities import cut_after
from tests.integration.test_token_telemetry import PROMPT_TOKENS, content, vllm_stream

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
SSE = {"Content-Type": "text/event-stream"}
DONE = b"data: [DONE]\n\n"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
ANSWER = {
    "id": "chatcmpl-42",
    "object": "chat.completion",
    "model": "tiny-served",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
}


class Collector:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def spans(self, n: int, limit_s: float = 10.0) -> list[dict[str, Any]]:
        """The spans received, once there are at least `n`."""
        deadline = time.monotonic() + limit_s
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(self.url + "/spans") as r:
                    got: list[dict[str, Any]] = await r.json()
                if len(got) >= n or time.monotonic() > deadline:
                    return got
                await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.otlp_receiver", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]])},
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, "the OTLP receiver did not start"
                assert time.monotonic() < deadline, "the OTLP receiver did not start"
                time.sleep(0.05)
        yield Collector(port)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def fresh(collector: Collector) -> Collector:
    async with aiohttp.ClientSession() as s, s.delete(collector.url + "/spans") as r:
        assert r.status == 204
    return collector


def telemetry(endpoint: str, **extra: Any) -> str:
    knobs = {"otlp_endpoint": endpoint, "batch_delay_s": 0.05, "sample_ratio": 1, **extra}
    return "telemetry:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in knobs.items())


def traceparent(trace: str = CLIENT_TRACE, span: str = CLIENT_SPAN, flags: str = "01") -> str:
    return f"00-{trace}-{span}-{flags}"


def sampled(header: str) -> bool:
    return bool(int(header.rsplit("-", 1)[1], 16) & 1)


def parents(headers: list[str]) -> list[tuple[str, str, bool]]:
    """(trace id, parent span id, sampled) of each `traceparent`."""
    out = []
    for h in headers:
        version, trace, span, _flags = h.split("-")
        assert version == "00"
        out.append((trace, span, sampled(h)))
    return out


def backend_traceparents(fake: FakeUpstream) -> list[str]:
    return [h.get("traceparent", "") for p, h, _ in fake.requests if p == CHAT]


def by_name(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        out.setdefault(s["kind"], []).append(s)
    return out


async def stream_words(request: web.Request, words: list[str]) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE)
    await resp.prepare(request)
    for w in words:
        await resp.write(chunk(w))
    await resp.write(chunk("", "stop") + DONE)
    return resp


async def test_request_and_attempt_spans_continue_the_clients_trace_to_the_backend(
    fresh: Collector, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(ANSWER)

    fake_upstream.handlers[CHAT] = answer
    # No path on the endpoint: /v1/traces is added (as OTEL_EXPORTER_OTLP_ENDPOINT does).
    pol = make_policy(fake_upstream.url, extra=telemetry(fresh.url, service_name="edge-gw"))
    proxy = await start_proxy(pol)
    body = {**CHAT_BODY, "stream": False, "max_tokens": 32, "temperature": 0.5}
    headers = {"traceparent": traceparent(), "tracestate": "vendor=abc"}
    async with proxy.session.post(proxy.url + CHAT, json=body, headers=headers) as r:
        assert r.status == 200
        rid = r.headers["X-Request-Id"]
        assert (await r.json())["usage"]["completion_tokens"] == 7

    spans = by_name(await fresh.spans(2))
    [server], [client] = spans["SERVER"], spans["CLIENT"]
    # The request span hangs under the client's span, in the client's trace.
    assert server["trace_id"] == CLIENT_TRACE
    assert server["parent_span_id"] == CLIENT_SPAN
    assert server["name"] == "POST /v1/chat/completions"
    assert server["resource"]["service.name"] == "edge-gw"
    a = server["attributes"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 32
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == 11
    assert a["gen_ai.usage.output_tokens"] == 7
    assert a["http.response.status_code"] == 200
    assert a["brownout.request_id"] == rid
    assert a["brownout.backend"] == "primary"
    assert a["brownout.tier"] == "normal"
    assert a["brownout.outcome"] == "complete"
    assert a["brownout.attempts"] == 1
    # The attempt is its child, named as GenAI's conventions name an inference call.
    assert client["trace_id"] == CLIENT_TRACE
    assert client["parent_span_id"] == server["span_id"]
    assert client["name"] == "chat tiny"
    c = client["attributes"]
    assert c["brownout.backend"] == "primary"
    assert c["gen_ai.system"] == "vllm"
    assert c["gen_ai.request.model"] == "tiny"
    assert c["gen_ai.response.model"] == "tiny-served"
    assert c["gen_ai.response.id"] == "chatcmpl-42"
    assert c["gen_ai.response.finish_reasons"] == ["stop"]
    assert c["gen_ai.usage.output_tokens"] == 7
    assert c["server.address"] == "127.0.0.1"
    assert c["server.port"] == fake_upstream.port
    assert c["brownout.admission"] == "admitted"
    assert c["brownout.admission.wait_s"] >= 0
    assert c["http.response.status_code"] == 200
    assert server["start_ns"] <= client["start_ns"] <= client["end_ns"] <= server["end_ns"]
    # The backend got the attempt's context: its spans hang under the attempt.
    assert parents(backend_traceparents(fake_upstream)) == [(CLIENT_TRACE, client["span_id"], True)]
    [sent] = [h for p, h, _ in fake_upstream.requests if p == CHAT]
    assert sent["tracestate"] == "vendor=abc"
    async with proxy.session.get(proxy.url + "/metrics") as r:
        text = await r.text()
    assert 'brownout_trace_spans_total{result="exported"} 2.0' in text


async def test_a_streamed_answers_usage_is_on_its_attempt_and_request_spans(
    fresh: Collector, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A stream's token counts (the usage chunk Brownout asks vLLM for) land
    on the attempt and the request span as they do for a JSON answer."""
    fake_upstream.handlers[CHAT] = vllm_stream(["a ", "b ", "c"])
    knobs = telemetry(fresh.url + "/v1/traces", otlp_headers=["X-Scope-OrgID=team-a"])
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=knobs))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        assert r.status == 200
        raw = await r.read()
    assert b'"usage"' not in raw  # the client did not ask: the chunk was Brownout's
    spans = by_name(await fresh.spans(2))
    [server], [client] = spans["SERVER"], spans["CLIENT"]
    for span in (server, client):
        a = span["attributes"]
        assert a["gen_ai.usage.input_tokens"] == PROMPT_TOKENS, span["kind"]
        assert a["gen_ai.usage.output_tokens"] == 3, span["kind"]
    assert server["attributes"]["brownout.stream"] is True
    assert server["headers"]["X-Scope-OrgID"] == "team-a"  # the policy's otlp_headers


async def test_a_rescued_streams_usage_is_on_each_leg_and_summed_on_the_request(
    fresh: Collector,
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    fake_upstream.handlers[CHAT] = cut_after(content("The ") + content("answer "))
    fallback_upstream.handlers[CHAT] = vllm_stream(["is ", "42."])
    pol = make_policy(fake_upstream.url, fallback_upstream.url, telemetry(fresh.url))
    proxy = await start_proxy(pol)
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        assert b"42." in await r.read()
    spans = by_name(await fresh.spans(3))
    [server] = spans["SERVER"]
    cut, rescue = sorted(spans["CLIENT"], key=lambda s: s["attributes"]["brownout.attempt"])
    # The cut leg sent no usage; the fallback's leg did.
    assert "gen_ai.usage.output_tokens" not in cut["attributes"]
    r = rescue["attributes"]
    assert r["brownout.rescue"] is True and r["gen_ai.usage.output_tokens"] == 2
    assert server["attributes"]["gen_ai.usage.output_tokens"] == r["gen_ai.usage.output_tokens"]
    assert server["attributes"]["gen_ai.usage.input_tokens"] == r["gen_ai.usage.input_tokens"]


async def test_each_attempt_is_a_span_and_each_backend_gets_its_own_parent(
    fresh: Collector,
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    """A 500 retried on the primary, then the fallback: three attempt spans,
    the failed ones marked as errors with their fault and the retry reason."""

    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)

    fake_upstream.handlers[CHAT] = broken
    fallback_upstream.handlers[CHAT] = lambda r: stream_words(r, ["from ", "fallback"])
    extra = telemetry(fresh.url) + "ladder:\n  failover:\n    retry_backoff_s: 0.01\n"
    proxy = await start_proxy(make_policy(fake_upstream.url, fallback_upstream.url, extra))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "fallback"
        await r.read()

    spans = by_name(await fresh.spans(4))
    [server] = spans["SERVER"]
    attempts = sorted(spans["CLIENT"], key=lambda s: s["attributes"]["brownout.attempt"])
    assert [s["attributes"]["brownout.backend"] for s in attempts] == [
        "primary",
        "primary",
        "fallback",
    ]
    assert all(s["parent_span_id"] == server["span_id"] for s in attempts)
    first, retry, last = (s["attributes"] for s in attempts)
    assert first["brownout.fault"] == "http_500" and first["brownout.next"] == "retry"
    assert retry["brownout.retry"] == 1 and retry["brownout.retry_reason"] == "http_500"
    assert retry["brownout.next"] == "next"
    assert last["brownout.retry_reason"] == "http_500"
    assert last["gen_ai.system"] == "transformers"
    assert last["brownout.outcome"] == "complete"
    assert [s["status"] for s in attempts] == [2, 2, 0]  # ERROR, ERROR, UNSET
    assert server["attributes"]["brownout.backend"] == "fallback"
    assert server["attributes"]["brownout.attempts"] == 3
    # Each backend call carried its own attempt's span as the parent.
    assert parents(backend_traceparents(fake_upstream)) == [
        (server["trace_id"], s["span_id"], True) for s in attempts[:2]
    ]
    assert parents(backend_traceparents(fallback_upstream)) == [
        (server["trace_id"], attempts[2]["span_id"], True)
    ]


async def test_a_rescued_stream_has_a_rescue_span(
    fresh: Collector,
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("The answer "))
        assert request.transport is not None
        request.transport.close()
        return resp

    fake_upstream.handlers[CHAT] = cut
    fallback_upstream.handlers[CHAT] = lambda r: stream_words(r, ["is 42."])
    pol = make_policy(fake_upstream.url, fallback_upstream.url, telemetry(fresh.url))
    proxy = await start_proxy(pol)
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        raw = await r.read()
    assert b"is 42." in raw

    spans = by_name(await fresh.spans(3))
    [server] = spans["SERVER"]
    cut_span, rescue = sorted(spans["CLIENT"], key=lambda s: s["attributes"]["brownout.attempt"])
    assert cut_span["attributes"]["brownout.fault"] == "upstream_disconnect"
    assert cut_span["status"] == 2
    assert rescue["attributes"]["brownout.rescue"] is True
    assert rescue["attributes"]["brownout.rescue_from"] == "primary"
    assert rescue["attributes"]["brownout.backend"] == "fallback"
    assert rescue["attributes"]["brownout.outcome"] == "complete"
    assert rescue["status"] == 0
    assert server["attributes"]["brownout.rescued"] is True
    assert parents(backend_traceparents(fallback_upstream)) == [
        (server["trace_id"], rescue["span_id"], True)
    ]


async def test_an_unsampled_client_trace_is_continued_but_not_exported(
    fresh: Collector, fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["hi"])
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=telemetry(fresh.url)))
    headers = {"traceparent": traceparent(flags="00")}
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY, headers=headers) as r:
        await r.read()
    # Without a traceparent: a new trace, sampled (sample_ratio 1).
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        await r.read()
    spans = await fresh.spans(2)
    await asyncio.sleep(0.3)  # a batch of the unsampled request would have come by now
    spans = await fresh.spans(2)
    assert len(spans) == 2
    assert {s["trace_id"] for s in spans} != {CLIENT_TRACE}
    unsampled, fresh_root = backend_traceparents(fake_upstream)
    # The backend still joins the client's trace, as unsampled, under a span of ours.
    assert unsampled.startswith(f"00-{CLIENT_TRACE}-") and not sampled(unsampled)
    assert unsampled != traceparent(flags="00")
    server = next(s for s in spans if s["kind"] == "SERVER")
    assert server["parent_span_id"] == ""
    assert fresh_root.startswith(f"00-{server['trace_id']}-") and sampled(fresh_root)


async def test_tracing_off_passes_the_clients_traceparent_through_and_loads_no_sdk(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["hi"])
    proxy = await start_proxy(make_policy(fake_upstream.url))
    assert proxy.app[STATE].current.tracing is None
    async with proxy.session.post(
        proxy.url + CHAT, json=CHAT_BODY, headers={"traceparent": traceparent()}
    ) as r:
        await r.read()
    assert backend_traceparents(fake_upstream) == [traceparent()]
    # The SDK is an optional extra: a policy without a collector never loads
    # the tracing module or the exporter (redis-py may import the API itself).
    code = (
        "import sys; from proxy.app import create_app; from proxy.policy import parse_policy;"
        "create_app(parse_policy('backends: {primary: {url: \"http://127.0.0.1:9\"}}', 'p'));"
        "mods = [m for m in sys.modules if m.startswith(('opentelemetry.exporter', "
        "'opentelemetry.sdk.trace', 'proxy.telemetry.tracing'))];"
        "assert not mods, mods"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


async def test_tracing_follows_policy_reloads(
    fresh: Collector, fake_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["hi"])
    base = (
        f"backends:\n  primary:\n    url: {fake_upstream.url}\n"
        "    health: {interval_s: 0.2, timeout_s: 0.5}\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(base)
    from proxy.policy import load_policy

    proxy = await start_proxy(load_policy(path))
    state = proxy.app[STATE]
    assert state.current.tracing is None
    path.write_text(base + telemetry(fresh.url))
    assert (await state.reload("test"))["ok"]
    tracing = state.current.tracing
    assert tracing is not None
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        await r.read()
    assert len(await fresh.spans(2)) == 2
    # An unrelated change keeps the tracer (and its queue); turning it off closes it.
    path.write_text(base.replace("0.2", "0.3") + telemetry(fresh.url))
    assert (await state.reload("test"))["ok"]
    assert state.current.tracing is tracing
    path.write_text(base)
    assert (await state.reload("test"))["ok"]
    assert state.current.tracing is None
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        await r.read()
    for _ in range(100):
        if len(state.live) == 1:
            break
        await asyncio.sleep(0.1)
    assert len(await fresh.spans(3, limit_s=0.5)) == 2


class Blackhole:
    """A collector that takes connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"


@pytest.fixture
def blackhole() -> Iterator[Blackhole]:
    b = Blackhole()
    yield b
    b.sock.close()


async def latencies(session: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    out = []
    loop = asyncio.get_running_loop()
    for _ in range(n):
        t = loop.time()
        async with session.post(url + CHAT, json=CHAT_BODY) as r:
            await r.read()
            assert r.status == 200
        out.append(loop.time() - t)
    return out


@pytest.mark.parametrize("collector_kind", ["refused", "blackhole"])
async def test_an_unreachable_collector_does_not_slow_serving(
    collector_kind: str,
    blackhole: Blackhole,
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    """Spans end into a bounded queue; the export thread waits on the
    collector, never the event loop. Latency with the collector unreachable
    is that of tracing off (same run, interleaved), and the lost spans are
    counted, not retried forever."""
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["a", "b", "c"])
    endpoint = blackhole.url if collector_kind == "blackhole" else f"http://127.0.0.1:{free_port()}"
    knobs = telemetry(
        endpoint, max_queue_spans=16, max_batch_spans=8, export_timeout_s=2, batch_delay_s=0.05
    )
    on = await start_proxy(make_policy(fake_upstream.url, extra=knobs))
    off = await start_proxy(make_policy(fake_upstream.url))
    await latencies(on.session, on.url, 20)  # warm-up, and the queue fills
    await latencies(off.session, off.url, 20)
    t_on: list[float] = []
    t_off: list[float] = []
    for _ in range(4):
        t_off += await latencies(off.session, off.url, 40)
        t_on += await latencies(on.session, on.url, 40)
    med_on, med_off = statistics.median(t_on), statistics.median(t_off)
    p90_on = statistics.quantiles(t_on, n=10)[-1]
    p90_off = statistics.quantiles(t_off, n=10)[-1]
    print(
        f"{collector_kind}: median {med_on * 1e3:.2f} ms on vs {med_off * 1e3:.2f} ms off, "
        f"p90 {p90_on * 1e3:.2f} vs {p90_off * 1e3:.2f} ms"
    )
    # Tracing costs some microseconds a request; a blocked export would cost
    # the export timeout (2 s). Generous bounds: a shared 2-core machine.
    assert med_on < med_off * 1.5 + 0.002
    assert p90_on < p90_off * 1.5 + 0.005
    assert max(t_on) < 1.0
    m = await metrics(on)
    lost = total(m, "brownout_trace_spans_total", result="failed") + total(
        m, "brownout_trace_spans_total", result="dropped"
    )
    assert lost > 0
    assert total(m, "brownout_trace_spans_total", result="exported") == 0


def test_a_collector_without_the_sdk_installed_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.policy.telemetry import TelemetryPolicy
    from proxy.runtime.state import open_tracing
    from proxy.telemetry.metrics import Metrics

    monkeypatch.setitem(sys.modules, "proxy.telemetry.tracing", None)
    with pytest.raises(RuntimeError, match=r"pip install 'brownout\[otel\]'"):
        open_tracing(TelemetryPolicy(otlp_endpoint="http://127.0.0.1:4318"), Metrics())
