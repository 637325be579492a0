"""Issue 20: the attribution of failures (proxy.control.attribution), decisions only."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.control.attribution import Held, Ledger, classify, definitive
from proxy.pipeline.attempts import next_step
from proxy.pipeline.record import AttemptResult
from proxy.policy import parse_policy

ENGINE_DEAD = b'{"error": {"message": "EngineCore encountered an issue.", "code": 500}}'
CUDA_OOM = b'{"error": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB"}}'
QUEUE_FULL = b'{"error": {"message": "Request queue full", "code": 503}}'
POISON = b'{"error": {"message": "probability tensor contains either inf, nan"}}'


@pytest.mark.parametrize(
    ("fault", "status", "text", "retry_after", "want"),
    [
        ("connect", 502, b"", False, ("backend", "connect", False)),
        ("http_500", 500, ENGINE_DEAD, False, ("backend", "engine_dead", False)),
        ("upstream_error", 500, ENGINE_DEAD, False, ("backend", "engine_dead", False)),
        ("http_500", 500, CUDA_OOM, False, ("backend", "oom", False)),
        ("http_503", 503, QUEUE_FULL, False, ("load", "queue_full", False)),
        ("", 429, b"", False, ("load", "http_429", False)),
        ("", 503, b"", True, ("load", "http_503", False)),
        ("total_timeout", 504, b"", False, ("request", "total_timeout", False)),
        # What a client can shape: suspect until the probe says so.
        ("http_500", 500, POISON, False, ("backend", "http_500", True)),
        ("first_byte_timeout", 504, b"", False, ("backend", "first_byte_timeout", True)),
        ("connect_timeout", 504, b"", False, ("backend", "connect_timeout", True)),
        ("invalid_output", 502, b"", False, ("backend", "invalid_output", True)),
        ("truncated", 200, b"", False, ("backend", "truncated", True)),
        ("slow_ttft", 200, b"", False, ("backend", "slow_ttft", True)),
    ],
)
def test_classify(
    fault: str, status: int, text: bytes, retry_after: bool, want: tuple[str, str, bool]
) -> None:
    v = classify(fault, status, text, retry_after)
    assert (v.attribution, v.fault, v.suspect) == want


@given(st.binary(max_size=300), st.sampled_from(["http_500", "upstream_error", "truncated"]))
def test_classify_never_raises_and_only_a_definitive_body_skips_the_probe(
    text: bytes, fault: str
) -> None:
    v = classify(fault, 500, text)
    assert v.attribution in ("backend", "load")
    assert v.suspect or definitive(text) or v.attribution == "load"


def held(client: str, rid: str = "r") -> Held:
    return Held("http_500", "", client, rid)


def test_ledger_probes_once_per_window_then_needs_two_clients() -> None:
    led = Ledger(window_s=10.0, min_clients=2)
    assert led.decide(0.0, "a", would_open=False) == "record"
    assert led.decide(0.0, "a", would_open=True) == "probe"
    led.start_probe(0.0)
    assert led.decide(0.5, "a", would_open=True) == "hold"
    led.held.append(held("a"))
    assert [h.client for h in led.probe_done(ok=True)] == ["a"]
    # A probe passed 1 s ago: one client's streak is absolved, two clients' counts.
    led.suspect(held("a"))
    assert led.decide(1.0, "a", would_open=True) == "absolve"
    assert len(led.absolve(held("a"))) == 2 and led.streak == []
    led.suspect(held("b"))
    assert led.decide(2.0, "a", would_open=True) == "record"
    # The window over: the next would-open failure is probed again.
    assert led.decide(11.0, "a", would_open=True) == "probe"


def test_ledger_after_a_failed_probe_records() -> None:
    led = Ledger(window_s=10.0)
    led.start_probe(0.0)
    led.probe_done(ok=False)
    assert led.corroborated == 1
    assert led.decide(1.0, "a", would_open=True) == "record"


def test_a_failed_probe_judges_only_the_failures_held_when_it_started() -> None:
    """A failure held while the probe is out may come after the backend
    recovered: a failed probe leaves it held for a probe of its own."""
    led = Ledger(window_s=10.0)
    led.suspect(held("a", "s1"))
    led.held.append(held("a", "r1"))
    led.start_probe(0.0)
    led.held.append(held("b", "late"))  # while the probe is out
    assert [h.rid for h in led.probe_done(ok=False)] == ["s1", "r1"]
    assert [h.rid for h in led.held] == ["late"] and led.streak == []
    led.start_probe(1.0)
    assert [h.rid for h in led.probe_done(ok=True)] == ["late"] and led.held == []
    # Shutting down: every held failure is judged at once.
    led.held.append(held("a", "x"))
    led.start_probe(2.0)
    led.held.append(held("a", "y"))
    assert [h.rid for h in led.probe_done(ok=False, all_held=True)] == ["x", "y"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.booleans()), max_size=60))
def test_one_client_never_opens_a_breaker_whose_probe_passes(
    steps: list[tuple[float, bool]],
) -> None:
    """Property: whatever the timing, one client's suspect failures, against a
    probe that always passes, are never recorded at the threshold — only
    probed, held or absolved."""
    led = Ledger(window_s=3.0)
    now = 0.0
    for dt, would_open in steps:
        now += dt
        d = led.decide(now, "one", would_open)
        if d == "probe":
            led.start_probe(now)
            led.held.append(held("one"))
            led.probe_done(ok=True)
        elif d == "absolve":
            led.absolve(held("one"))
        elif d == "record":
            assert not would_open
            led.suspect(held("one"))


def test_an_engine_death_is_not_retried_on_the_same_backend() -> None:
    pol = parse_policy("backends: {primary: {url: 'http://x'}}", "p.yaml").ladder.failover
    dead = AttemptResult("failed", "primary", 500, "error", fault="http_500", retry="http_500")
    d = next_step(
        dead._replace(body=ENGINE_DEAD),
        pol,
        retries=0,
        remaining_s=60,
        larger_window_next=False,
        rand=random.random,
    )
    assert d.step == "next"
    d = next_step(
        dead._replace(body=POISON),
        pol,
        retries=0,
        remaining_s=60,
        larger_window_next=False,
        rand=random.random,
    )
    assert d.step == "retry"


def test_client_identity() -> None:
    from proxy.ingress.identity import client_identity

    # Behind nginx (a loopback peer): the address nginx appended, not the client's claims.
    assert client_identity("127.0.0.1", None, "6.6.6.6, 10.0.0.7", keyed=False) == "addr:10.0.0.7"
    # A remote peer's X-Forwarded-For is not believed.
    assert client_identity("10.1.1.1", None, "1.2.3.4", keyed=False) == "addr:10.1.1.1"
    assert client_identity(None, None, None, keyed=False) == "addr:unknown"
    # With client keys, the key is the identity, whatever the address.
    a = client_identity("10.1.1.1", "key-a", None, keyed=True)
    assert a == client_identity("10.9.9.9", "key-a", "x", keyed=True) == "key:key-a"
    # Without configured keys a bearer identifies no one.
    assert client_identity("10.1.1.1", "made-up", None, keyed=False) == "addr:10.1.1.1"
