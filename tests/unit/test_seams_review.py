"""Seams between the breakers, the runtime and the ladder (review of main at
fd452ac): decisions on the injectable clock, no sockets."""

from __future__ import annotations

from typing import Any

import yaml

from proxy.backends.upstream import Upstream
from proxy.control.breaker import BackendBreaker
from proxy.control.ladder import Ramp
from proxy.policy import parse_policy
from proxy.runtime.generation import Runtime
from proxy.telemetry.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def runtime(primary_kind: str = "vllm") -> tuple[Runtime, Clock]:
    doc: dict[str, Any] = {
        "backends": {
            "primary": {"url": "http://127.0.0.1:1", "kind": primary_kind},
            "fallback": {"url": "http://127.0.0.1:2", "kind": "transformers"},
        },
        "ladder": {"breaker": {"fail_max": 2, "reset_timeout_s": 10}},
    }
    pol = parse_policy(yaml.safe_dump(doc), "seams.yaml")
    clock = Clock()
    rt = Runtime(policy=pol, metrics=Metrics(), clock=clock)
    for name, bp in (("primary", pol.backends.primary), ("fallback", pol.backends.fallback)):
        assert bp is not None
        b = BackendBreaker(name, pol.ladder.breaker, clock)
        rt.add_upstream(Upstream(name, bp, None, b))  # type: ignore[arg-type]  # no I/O here
    return rt, clock


def on_primary_ramp(rt: Runtime, clock: Clock) -> None:
    rt.ladder.tier = "throttle"
    rt.ladder.ramp = Ramp("primary", 0, clock.t, "fallback")


def test_a_failure_admitted_before_the_recovery_never_rolls_the_ramp_back() -> None:
    """A request admitted while the primary was still closed (a hung call,
    timing out 60 s later) fails after the primary recovered: its breaker
    ignores it (stale epoch), and on main the ladder still rolled the ramp
    back to failover (ramp_max_failures 1)."""
    rt, clock = runtime()
    p = rt.upstreams["primary"]
    hung = p.breaker_for(None).allow()  # in flight since before the outage
    assert hung is not None
    for _ in range(2):
        permit = p.breaker_for(None).allow()
        assert permit is not None
        rt.report_failure(p, "http_500", permit=permit)
    assert p.breaker.state == "open"
    clock.t += 10
    trial = p.breaker_for(None).allow()
    assert trial is not None
    rt.report_success(p, permit=trial)
    assert p.breaker.state == "closed"
    on_primary_ramp(rt, clock)

    rt.report_failure(p, "first_byte_timeout", permit=hung)

    assert p.breaker.state == "closed"
    assert rt.ladder.tier == "throttle" and rt.ladder.ramp is not None
    # A failure of this epoch still rolls the ramp back.
    fresh = p.breaker_for(None).allow()
    assert fresh is not None
    rt.report_failure(p, "http_500", permit=fresh)
    assert rt.ladder.tier == "failover" and rt.ladder.ramp is None


def test_one_models_failure_never_rolls_back_the_ramp_of_the_others() -> None:
    """Per-model breakers (kind openai, several models): model-a still broken
    during the primary's ramp must not send model-b's traffic back to the
    fallback (on main its first failure rolled the whole ramp back)."""
    rt, clock = runtime("openai")
    p = rt.upstreams["primary"]
    p.served_models = ("model-a", "model-b")
    on_primary_ramp(rt, clock)
    permit = p.breaker_for("model-a").allow()
    assert permit is not None and permit.owner is p.model_breakers["model-a"]
    rt.report_failure(p, "http_500", permit=permit)
    assert rt.ladder.tier == "throttle" and rt.ladder.ramp is not None
    assert p.model_breakers["model-a"].outcomes == 1
    assert p.breaker.state == "closed"


def test_model_breakers_get_real_trials_when_the_probe_cannot_test_them() -> None:
    """Kind openai with two models, both models' breakers open, the recovery
    probe refused as a request (misconfigured: real requests are the trial).
    On main `trial_due` looked at the backend's own breaker only (closed), so
    in maintenance no request ever went to the primary and it never came
    back; in failover the primary was tried only behind the fallback."""
    rt, clock = runtime("openai")
    p = rt.upstreams["primary"]
    p.served_models = ("model-a", "model-b")
    p.probe_misconfigured = "POST /v1/chat/completions answered HTTP 422"
    for model in p.served_models:
        for _ in range(2):
            permit = p.breaker_for(model).allow()
            assert permit is not None
            rt.report_failure(p, "http_500", permit=permit)
    assert not p.available and p.breaker.state == "closed"
    rt.ladder.tier = "maintenance"
    assert rt.route() == ("maintenance", [])  # not due yet
    clock.t += 10
    assert rt.route() == ("primary", [p])
    rt.ladder.tier = "failover"
    assert rt.route() == ("fallback", [p, rt.upstreams["fallback"]])


def test_an_open_backend_breaker_gates_every_model_and_real_requests_close_it() -> None:
    """Kind openai with two models; the backend's own breaker opened by
    another replica (shared state). On main breaker_for(model) handed out the
    model's closed breaker: requests went through the open backend, and with
    a misconfigured probe real requests were never the backend breaker's
    trial, so it stayed open and the tier never came home."""
    rt, clock = runtime("openai")
    p = rt.upstreams["primary"]
    p.served_models = ("model-a", "model-b")
    p.probe_misconfigured = "POST /v1/chat/completions answered HTTP 422"
    p.breaker.force_open("opened by replica r2: http_500")
    assert p.breaker_for("model-a").allow() is None  # open: not now
    clock.t += 10
    trial = p.breaker_for("model-a").allow()
    assert trial is not None and trial.owner is p.breaker and trial.trial
    assert p.breaker_for("model-b").allow() is None  # one trial at a time
    rt.report_success(p, permit=trial)
    assert p.breaker.state == "closed" and p.available
    # Closed again: each model has its own breaker.
    permit = p.breaker_for("model-b").allow()
    assert permit is not None and permit.owner is p.model_breakers["model-b"]


async def test_a_half_open_breaker_whose_real_trial_left_is_probed() -> None:
    """A real request moved the primary's breaker open → half-open (allow()
    after reset_timeout_s) and then ended without an outcome (shed, client
    gone): its slot went back, and on main the evaluator probed only *open*
    breakers, while in failover real requests reach the primary only when the
    fallback fails — half-open for good, the healthy primary never used."""
    import asyncio

    from proxy.runtime.loops import Evaluator
    from proxy.runtime.state import ProxyState
    from tests.integration.conftest import free_port, make_policy

    clock = Clock()
    state = ProxyState(make_policy(f"http://127.0.0.1:{free_port()}"), Metrics(), clock)
    await state.start()
    try:
        rt = state.current
        up = rt.upstreams["primary"]
        probes: list[int] = []

        async def healthy_probe() -> str | None:
            probes.append(1)
            return None

        up.recovery_probe = healthy_probe  # type: ignore[method-assign]
        up.breaker.force_open("test")
        clock.t += rt.policy.ladder.breaker.reset_timeout_s + 1
        real = up.breaker_for(None).allow()  # a real request's trial ...
        assert real is not None and up.breaker.state == "half-open"
        evaluator = Evaluator(state)
        evaluator.tick()
        assert probes == []  # ... while it is out, no probe
        up.release_trial(real)  # ... and it ends without an outcome
        evaluator.tick()
        for _ in range(20):
            await asyncio.sleep(0)
        assert probes == [1]
        assert up.breaker.state == "closed"
    finally:
        await state.close()


def test_a_forced_maintenance_sends_no_real_trial_to_a_backend() -> None:
    """The probe is misconfigured, so real requests are the primary's
    half-open trial (Runtime.route). On main that held under a forced
    maintenance too: an operator who forced maintenance (to work on the
    primary) still had client requests sent to it."""
    rt, clock = runtime()
    p = rt.upstreams["primary"]
    p.probe_misconfigured = "POST /v1/chat/completions answered HTTP 404"
    p.breaker.force_open("test")
    clock.t += 10
    rt.ladder.tier = "maintenance"
    assert rt.route() == ("primary", [p])  # not forced: the real request is the trial
    rt.force_tier("maintenance")
    assert rt.route() == ("maintenance", [])
    rt.force_tier("failover")
    assert rt.route() == ("fallback", [rt.upstreams["fallback"], p])
