"""Issue 20: a client can't break it for others — failures attributed to the
request, not the engine (real proxy on real sockets, scripted fakes).

On 8c097b4 every scenario here opened a healthy backend's breaker: a poison
parameter's 500s, retries counted once each, a long non-streaming answer
counted as a first-byte timeout, a request that fails on both backends.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_pipeline import (
    CHAT,
    fallback_answer,
    metrics,
    policy,
    total,
    wait_until,
)

POISON = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "top_p": 1e-300,
}
PLAIN = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def poisoned_by(field: str) -> Any:
    """A backend that is fine, except that a request carrying `field`
    makes it answer 500 (inf/nan in sampling); its probe (no such field) passes."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if field in body:
            return web.json_response(
                {"error": {"message": "probability tensor contains either inf, nan"}},
                status=500,
            )
        return await fallback_answer(request)

    return chat


async def post(proxy: Any, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, Any], Any]:
    async with proxy.session.post(proxy.url + CHAT, json=body, headers=headers) as r:
        return r.status, dict(r.headers), json.loads(await r.read())


async def test_one_clients_poison_requests_never_open_a_healthy_backends_breaker(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """20 poison requests, each failing on both backends: answered 502 naming
    the request (not maintenance), charged to no one; both breakers stay
    closed, the tier normal, and another client's request goes to the primary."""
    fake_upstream.handlers[CHAT] = poisoned_by("top_p")
    fallback_upstream.handlers[CHAT] = poisoned_by("top_p")
    extra = {"ladder": {"breaker": {"fail_max": 3}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    rt = proxy.app[STATE].current
    for _ in range(20):
        status, headers, body = await post(proxy, POISON)
        assert status == 502, body
        assert body["error"]["code"] == "request_failed_everywhere"
        assert "primary" in body["error"]["message"] and "fallback" in body["error"]["message"]
        assert headers["x-should-retry"] == "false"
        assert headers["X-Brownout-Tier"] == "normal"
    for up in rt.upstreams.values():
        assert up.breaker.state == "closed", up.name
    assert rt.tier == "normal"
    status, headers, _ = await post(proxy, PLAIN)
    assert (status, headers["X-Brownout-Backend"]) == (200, "primary")
    m = await metrics(proxy)
    assert total(m, "brownout_failures_total", attribution="backend") == 0
    assert total(m, "brownout_failures_total", backend="primary", attribution="request") >= 20
    assert total(m, "brownout_failures_total", backend="fallback", attribution="request") >= 20


async def test_a_poison_request_that_the_fallback_answers_is_absolved_by_the_probe(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The primary chokes on a parameter the fallback takes: each request is
    answered by the fallback; when the streak reaches fail_max the recovery
    probe goes out, passes, and the breaker stays closed (status says why)."""
    fake_upstream.handlers[CHAT] = poisoned_by("top_p")
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"breaker": {"fail_max": 3}, "failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    rt = proxy.app[STATE].current
    primary = rt.upstreams["primary"]
    for _ in range(10):
        status, headers, _ = await post(proxy, POISON)
        assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    await wait_until(lambda: not primary.judge.ledger(primary.breaker).probing)
    assert primary.breaker.state == "closed"
    assert rt.tier == "normal"
    async with proxy.session.get(proxy.url + "/brownout/status") as r:
        st = await r.json()
    att = st["backends"]["primary"]["attribution"]
    assert att["probes"] >= 1 and att["absolved"] >= 1 and att["corroborated"] == 0
    m = await metrics(proxy)
    assert total(m, "brownout_corroborations_total", backend="primary", result="absolved") >= 1
    assert total(m, "brownout_failures_total", backend="primary", attribution="request") >= 8


async def test_a_really_broken_backend_still_opens_at_fail_max(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The negative control: a primary that answers 500 to everything (its probe
    too) opens once the probe confirms, and traffic goes to the fallback."""

    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    fake_upstream.handlers[CHAT] = broken
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"breaker": {"fail_max": 3}, "failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    rt = proxy.app[STATE].current
    primary = rt.upstreams["primary"]
    for _ in range(3):
        status, headers, _ = await post(proxy, PLAIN)
        assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    await wait_until(lambda: primary.breaker.state == "open")
    await wait_until(lambda: rt.tier == "failover")
    m = await metrics(proxy)
    assert total(m, "brownout_corroborations_total", backend="primary", result="confirmed") == 1
    assert total(m, "brownout_failures_total", backend="primary", attribution="backend") == 3


async def test_retries_of_one_request_count_as_one_failure(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Three bad requests, each retried twice on the primary (500 is
    transient): three failures, not nine — with corroboration off, the
    breaker (fail_max 5) stays closed (it opened on 8c097b4)."""
    fake_upstream.handlers[CHAT] = poisoned_by("top_p")
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {
        "ladder": {
            "breaker": {"fail_max": 5, "corroborate": False},
            "failover": {"retry_max": 2, "retry_budget_ratio": 1, "retry_budget_min": 100},
        }
    }
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    primary = proxy.app[STATE].current.upstreams["primary"]
    for _ in range(3):
        status, headers, _ = await post(proxy, POISON)
        assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    calls = [p for p, _, _ in fake_upstream.requests if p == CHAT]
    assert len(calls) == 9  # every retry was made
    assert primary.breaker.state == "closed"
    assert primary.breaker.snapshot()["consecutive_failures"] == 3


async def test_a_long_non_streaming_answer_is_not_a_backend_fault(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A non-streaming answer's first byte comes after the whole generation:
    one slower than first_byte_s (2 s here) is answered, not failed over (the
    probe sent at first_byte_s passes); one past timeouts.total_s is a 504
    charged to the request, never opening the breaker (fail_max 1)."""
    delay = [2.5]

    async def slow(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if body.get("max_tokens") != 1:  # the probe's 1-token answer is quick
            await asyncio.sleep(delay[0])
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = slow
    primary_extra = {"timeouts": {"total_s": 3.5}}
    extra = {"ladder": {"breaker": {"fail_max": 1}}}
    proxy = await start_proxy(
        policy(fake_upstream.url, None, primary_extra=primary_extra, extra=extra)
    )
    rt = proxy.app[STATE].current
    status, headers, body = await post(proxy, PLAIN)
    assert (status, headers["X-Brownout-Backend"]) == (200, "primary"), body
    delay[0] = 4.0
    status, headers, body = await post(proxy, PLAIN)
    assert status == 504
    assert body["error"]["code"] == "total_timeout"
    assert "max_tokens" in body["error"]["message"]
    assert headers["x-should-retry"] == "false"
    up = rt.upstreams["primary"]
    await wait_until(lambda: not up.judge.ledger(up.breaker).probing, 6.0)
    assert up.breaker.state == "closed"
    m = await metrics(proxy)
    assert total(m, "brownout_failures_total", attribution="request", fault="total_timeout") == 1
    assert total(m, "brownout_failures_total", attribution="backend") == 0


async def test_a_hung_engine_behind_non_streaming_requests_is_still_found(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The timeout's probe (its 1-token chat) hangs too: the engine is hung,
    and the breaker opens."""

    async def hung(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = hung
    primary_extra = {"timeouts": {"total_s": 1.0}}
    proxy = await start_proxy(policy(fake_upstream.url, None, primary_extra=primary_extra))
    up = proxy.app[STATE].current.upstreams["primary"]
    status, _, body = await post(proxy, PLAIN)
    assert status == 504 and body["error"]["code"] == "total_timeout"
    await wait_until(lambda: up.breaker.state == "open", 6.0)


async def test_failures_from_two_client_keys_open_without_a_second_probe(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Within reset_timeout_s of a probe that passed, a streak from one API
    key is absolved; the same streak from two keys opens the breaker (a
    failure that hits more than one client is not one client's doing)."""
    fake_upstream.handlers[CHAT] = poisoned_by("top_p")
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {
        "server": {"api_keys": ["key-a", "key-b"]},
        "ladder": {
            "breaker": {"fail_max": 2, "reset_timeout_s": 60},
            "failover": {"retry_max": 0},
        },
    }
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    primary = proxy.app[STATE].current.upstreams["primary"]
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    for _ in range(2):  # reaches fail_max: the probe goes out and passes
        await post(proxy, POISON, **a)
    await wait_until(lambda: primary.judge.ledger(primary.breaker).probes == 1)
    await wait_until(lambda: not primary.judge.ledger(primary.breaker).probing)
    for _ in range(6):  # one key again: absolved, no second probe
        await post(proxy, POISON, **a)
    assert primary.breaker.state == "closed"
    assert primary.judge.ledger(primary.breaker).probes == 1
    await post(proxy, POISON, **b)  # a streak of one, from key-b
    assert primary.breaker.state == "closed"
    await post(proxy, POISON, **a)  # and key-a: two clients, fail_max reached
    assert primary.breaker.state == "open"
    m = await metrics(proxy)
    assert total(m, "brownout_failures_total", backend="primary", attribution="backend") == 2


async def test_the_probe_asks_for_the_model_of_the_traffic_that_failed(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The primary lists `other` first; the traffic that fails asks for
    `tiny`: the corroboration probe asks for `tiny` too (on 8c097b4 every
    probe asked for the first model its /v1/models lists)."""

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"object": "list", "data": [{"id": "other"}, {"id": "tiny", "max_model_len": 4096}]}
        )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if body.get("max_tokens") == 1:  # the probe
            return await fallback_answer(request)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    fake_upstream.handlers["/v1/models"] = models
    fake_upstream.handlers[CHAT] = chat
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"breaker": {"fail_max": 2}, "failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    primary = proxy.app[STATE].current.upstreams["primary"]
    await wait_until(lambda: primary.served_models == ("other", "tiny"))
    for _ in range(2):
        await post(proxy, PLAIN)
    await wait_until(lambda: primary.judge.ledger(primary.breaker).probes == 1)
    await wait_until(lambda: not primary.judge.ledger(primary.breaker).probing)
    probes = [json.loads(b) for p, _, b in fake_upstream.requests if p == CHAT and b"ping" in b]
    assert [p["model"] for p in probes] == ["tiny"]


async def test_a_stalled_engine_behind_a_non_streaming_request_fails_over_at_first_byte_s(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Nothing comes back, not even the probe's 1-token answer: at
    first_byte_s the request goes to the fallback (it does not wait total_s)."""

    async def stalled(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = stalled
    fallback_upstream.handlers[CHAT] = fallback_answer
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    t0 = asyncio.get_running_loop().time()
    status, headers, _ = await post(proxy, PLAIN)
    took = asyncio.get_running_loop().time() - t0
    assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    assert took < 10  # first_byte_s 2 + the probe's 2, not total_s 600


async def test_one_client_holds_at_most_its_share_of_the_engines_slots(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """ladder.throttle.max_inflight_per_client 2: a third long request of
    one client is shed (429 client_limit) while another client (its own
    X-Forwarded-For through a loopback proxy) still gets a slot."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await request.read()
        await release.wait()
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = slow
    extra = {"ladder": {"throttle": {"max_inflight_per_client": 2, "max_inflight": 8}}}
    proxy = await start_proxy(policy(fake_upstream.url, None, extra=extra))
    hostile = {"X-Forwarded-For": "6.6.6.6"}
    held = [asyncio.create_task(post(proxy, PLAIN, **hostile)) for _ in range(2)]
    await wait_until(lambda: len([p for p, _, _ in fake_upstream.requests if p == CHAT]) == 2)
    status, headers, body = await post(proxy, PLAIN, **hostile)
    assert status == 429 and "max_inflight_per_client" in body["error"]["message"]
    assert headers["Retry-After"] == "1"
    other = asyncio.create_task(post(proxy, PLAIN, **{"X-Forwarded-For": "10.0.0.1"}))
    await wait_until(lambda: len([p for p, _, _ in fake_upstream.requests if p == CHAT]) == 3)
    release.set()
    assert (await other)[0] == 200
    assert [(await t)[0] for t in held] == [200, 200]
    assert proxy.app[STATE].current.client_slots.held == {}


async def test_a_client_that_grabbed_the_idle_pool_gives_slots_to_the_others_first(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The fair share (on by default, no cap configured): one client's long
    requests took all 4 slots while the pool was idle and it queued 4 more;
    another client's requests, queued after them, get the slots as they free
    (the hog's queued ones wait), its waits are not engine pressure, and the
    tier stays normal. Failed on main before the fair share: FIFO served the
    hog's queue first."""
    gates = {"hog": asyncio.Event(), "other": asyncio.Event()}
    served: list[str] = []

    async def slow(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        who = body["messages"][0]["content"]
        served.append(who)
        await gates[who].wait()
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = slow
    extra = {"ladder": {"throttle": {"max_inflight": 4, "queue_timeout_s": 30}}}
    proxy = await start_proxy(policy(fake_upstream.url, None, extra=extra))
    rt = proxy.app[STATE].current

    def ask(who: str, addr: str) -> asyncio.Task[tuple[int, dict[str, Any], Any]]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": who}]}
        return asyncio.create_task(post(proxy, body, **{"X-Forwarded-For": addr}))

    hog = [ask("hog", "6.6.6.6") for _ in range(4)]
    await wait_until(lambda: len(served) == 4)
    hog += [ask("hog", "6.6.6.6") for _ in range(4)]
    await wait_until(lambda: rt.admission.queued == 4)
    others = [ask("other", f"10.0.0.{i}") for i in range(1, 3)]
    await wait_until(lambda: rt.admission.queued == 6)
    # The hog's long answers end: the first freed slots go to the other clients.
    first_two = hog[:4]
    gates["hog"].set()
    gates["other"].set()
    await asyncio.gather(*first_two)
    results = await asyncio.gather(*others, *hog[4:])
    assert [r[0] for r in results] == [200] * 6
    assert served[4:6] == ["other", "other"], served
    assert rt.admission.held == {} and rt.admission.inflight == 0
    assert rt.ladder.tier == "normal"


async def test_a_poison_request_as_the_half_open_trial_does_not_keep_a_recovered_backend_out(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Without recovery probes a real request is the half-open trial. The
    primary really broke (its probe failed too) and recovered; one client's
    poison request is the trial: corroborated like a closed breaker's failure
    (the probe passes: the request's), the breaker does not reopen, the next
    request closes it, and the primary is charged with its real outage only.
    (Found by the ladder simulation, 2026-12-04: the trial's 500 reopened a
    healthy backend's breaker and was charged to it.)"""

    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    fake_upstream.handlers[CHAT] = broken
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {
        "ladder": {
            "breaker": {"fail_max": 3, "reset_timeout_s": 0.5},
            "failover": {"retry_max": 0, "recovery_probe": False},
        }
    }
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    rt = proxy.app[STATE].current
    primary = rt.upstreams["primary"]
    for _ in range(3):
        status, headers, _ = await post(proxy, PLAIN)
        assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    await wait_until(lambda: primary.breaker.state == "open")
    fake_upstream.handlers[CHAT] = poisoned_by("top_p")  # recovered
    await asyncio.sleep(0.6)  # past reset_timeout_s: the next request is the trial
    status, headers, _ = await post(proxy, POISON)
    assert status == 200 and headers["X-Brownout-Backend"] == "fallback"
    led = primary.judge.ledger(primary.breaker)
    await wait_until(lambda: not led.probing)
    assert primary.breaker.state == "half-open", primary.breaker.last_reason
    status, headers, _ = await post(proxy, PLAIN)
    assert (status, headers["X-Brownout-Backend"]) == (200, "primary")
    assert primary.breaker.state == "closed"
    m = await metrics(proxy)
    assert total(m, "brownout_failures_total", backend="primary", attribution="backend") == 3
    assert total(m, "brownout_failures_total", backend="primary", attribution="request") == 1


async def test_a_poison_request_held_while_a_failing_probe_is_out_is_judged_by_the_next(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The primary really broke: its third failure sends the corroboration
    probe, which hangs and then fails. While it is out the primary recovers
    and one client's poison request fails there: that failure came after the
    probe started, so the failed probe does not judge it — a probe of its own
    does, passes, and it is the request's. The outage's failures are the
    backend's, and its breaker opens."""
    state = {"broken": True}
    probe_out = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if "top_p" in body:  # poison, in any state
            return web.json_response({"error": {"message": "inf, nan"}}, status=500)
        if state["broken"]:
            if body.get("max_tokens") == 1:  # the recovery probe (1-token chat)
                probe_out.set()
                await asyncio.sleep(0.5)
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return await fallback_answer(request)

    fake_upstream.handlers[CHAT] = chat
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"breaker": {"fail_max": 3}, "failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    rt = proxy.app[STATE].current
    primary = rt.upstreams["primary"]
    for _ in range(3):
        status, headers, _ = await post(proxy, PLAIN)
        assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    await asyncio.wait_for(probe_out.wait(), 5)
    state["broken"] = False  # recovered while the probe is out
    status, headers, _ = await post(proxy, POISON)
    assert (status, headers["X-Brownout-Backend"]) == (200, "fallback")
    led = primary.judge.ledger(primary.breaker)
    await wait_until(lambda: primary.breaker.state == "open")
    await wait_until(lambda: not led.probing and not led.held)
    m = await metrics(proxy)
    assert total(m, "brownout_failures_total", backend="primary", attribution="backend") == 3
    assert total(m, "brownout_failures_total", backend="primary", attribution="request") == 1
    assert total(m, "brownout_corroborations_total", backend="primary", result="absolved") == 1
