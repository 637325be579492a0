"""Synthetic traces: standard incidents to check a policy against before
there is any recording (`brownout replay --scenario NAME --seed N`).

Every scenario is 600 s of chat traffic: Poisson arrivals at 2 requests/s
(`RATE`), priorities 10 % critical, 70 % normal, 20 % sheddable, 90 %
streamed, 50–300 tokens out, 40 clients; each request's latency is its
backend's model times a lognormal factor (σ 0.3). The primary is a vLLM
with 16 sequence slots (0.15 s to the first token, 20 ms a token, a queue
beyond 16: about 7 requests in flight at the normal rate); the fallback a
slower server with 16 (0.5 s, 30 ms a token). The incident starts at t = 120 s (`T0`):

    engine-death   the primary's engine dies: streams in flight are cut; for
                   4 s the API server answers 500 (its /health 503), then it
                   is gone (connection refused) until it is back at t = 210 s
    overload-burst arrivals × 10 for 60 s
    slow-prefill   the primary's time to the first token × 6 for 180 s
    flapping       the primary refuses connections for 10 s of every 30, for 180 s
    fallback-down  the primary is gone for 180 s; the fallback too, from
                   t = 180 s to 240 s

The same seed gives the same trace.
"""

from __future__ import annotations

import random
from typing import Any

from proxy.policy import Policy, parse_policy
from proxy.replay.names import SCENARIOS
from proxy.replay.trace import Trace

DURATION_S = 600.0
RATE = 2.0
T0 = 120.0
START = 1_767_225_600.0  # 2026-01-01T00:00:00Z: synthetic traces start here

PRIMARY_MODEL = {"ttft_s": 0.15, "tpot_s": 0.02, "capacity": 16.0}
FALLBACK_MODEL = {"ttft_s": 0.5, "tpot_s": 0.03, "capacity": 16.0}


def _cond(t: float, b: str, state: str, **kw: Any) -> dict[str, Any]:
    return {"k": "cond", "t": START + t, "b": b, "state": state, **kw}


def _conditions(name: str) -> list[dict[str, Any]]:
    if name == "engine-death":
        return [
            _cond(T0, "primary", "down", fault="upstream_error"),
            _cond(T0 + 4, "primary", "down", fault="connect"),
            _cond(T0 + 90, "primary", "up"),
        ]
    if name == "slow-prefill":
        return [_cond(T0, "primary", "slow", factor=6.0), _cond(T0 + 180, "primary", "up")]
    if name == "flapping":
        out = []
        for k in range(6):
            out.append(_cond(T0 + 30 * k, "primary", "down", fault="connect"))
            out.append(_cond(T0 + 30 * k + 10, "primary", "up"))
        return out
    if name == "fallback-down":
        return [
            _cond(T0, "primary", "down", fault="connect"),
            _cond(T0 + 180, "primary", "up"),
            _cond(T0 + 60, "fallback", "down", fault="connect"),
            _cond(T0 + 120, "fallback", "up"),
        ]
    return []


def _rate(name: str, t: float) -> float:
    if name == "overload-burst" and T0 <= t < T0 + 60:
        return RATE * 10
    return RATE


def scenario_records(name: str, seed: int = 0) -> list[dict[str, Any]]:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r} (one of {', '.join(SCENARIOS)})")
    rng = random.Random(f"{name}:{seed}")
    recs: list[dict[str, Any]] = [
        {"k": "model", "t": START, "b": "primary", **PRIMARY_MODEL},
        {"k": "model", "t": START, "b": "fallback", **FALLBACK_MODEL},
        _cond(0.0, "primary", "up"),
        _cond(0.0, "fallback", "up"),
        *_conditions(name),
    ]
    t = 0.0
    while True:
        t += rng.expovariate(_rate(name, t))
        if t >= DURATION_S:
            break
        u = rng.random()
        pri = "critical" if u < 0.1 else "normal" if u < 0.8 else "sheddable"
        recs.append(
            {
                "k": "req",
                "t": START + t,
                "ep": "chat",
                "pri": pri,
                "st": rng.random() < 0.9,
                "cl": f"client-{rng.randrange(40)}",
                "pt": rng.randrange(50, 800),
                "mt": 512,
                "n": rng.randrange(50, 301),
                "att": [],
                "be": "none",
                "s": 0,
                "o": "",
                "d": 0.0,
                "scale": round(rng.lognormvariate(0.0, 0.3), 4),
            }
        )
    return recs


def scenario_trace(name: str, seed: int = 0) -> Trace:
    tr = Trace.from_records(scenario_records(name, seed), source=f"scenario {name} (seed {seed})")
    tr.end = DURATION_S
    tr.synthetic = True
    return tr


def scenario_policy() -> Policy:
    """The baseline of a scenario without `--baseline`: the built-in defaults
    with a vLLM primary and a Transformers fallback."""
    return parse_policy(
        "backends:\n  primary:\n    url: http://primary.invalid\n    kind: vllm\n"
        "  fallback:\n    url: http://fallback.invalid\n    kind: transformers\n",
        "<scenario baseline: the built-in defaults>",
        env={},
    )
