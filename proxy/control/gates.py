"""Rollout gates (interface; the statistics land with the `gates` work).

A minimal evaluator with the final interface: hard gates on the first
event, ratio gates on point estimates once both arms have `min_samples`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.policy.rollout import GatesPolicy

Arm = Literal["primary", "candidate"]
Verdict = Literal["pass", "fail", "wait"]


@dataclass(frozen=True, slots=True)
class GateValue:
    gate: str
    verdict: Verdict
    value: float | None
    limit: float
    arms: dict[str, float | None]
    low: float | None = None
    high: float | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class GateReport:
    at: float
    gates: tuple[GateValue, ...]
    failed: GateValue | None
    ready: bool
    samples: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "ready": self.ready,
            "failed": self.failed.gate if self.failed else None,
            "samples": dict(self.samples),
            "gates": [
                {
                    "gate": g.gate,
                    "verdict": g.verdict,
                    "value": g.value,
                    "limit": g.limit,
                    "low": g.low,
                    "high": g.high,
                    "arms": dict(g.arms),
                    "detail": g.detail,
                }
                for g in self.gates
            ],
        }


@dataclass
class _Arm:
    latency: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    ttft: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    requests: collections.deque[tuple[float, bool, bool]] = field(default_factory=collections.deque)
    quality: tuple[int, int] | None = None


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


class Gates:
    def __init__(self, policy: GatesPolicy, *, quality_required: bool = False) -> None:
        self.policy = policy
        self.quality_required = quality_required
        self._arms: dict[str, _Arm] = {"primary": _Arm(), "candidate": _Arm()}
        self._health: GateValue | None = None

    def reset(self) -> None:
        self._arms = {"primary": _Arm(), "candidate": _Arm()}
        self._health = None

    def observe(
        self,
        arm: Arm,
        at: float,
        *,
        latency_s: float | None,
        ttft_s: float | None,
        failed: bool = False,
        oom: bool = False,
    ) -> GateValue | None:
        a = self._arms[arm]
        a.requests.append((at, failed, oom))
        if latency_s is not None:
            a.latency.append((at, latency_s))
        if ttft_s is not None:
            a.ttft.append((at, ttft_s))
        if arm == "candidate":
            for g in self._hard():
                if g.verdict == "fail":
                    return g
        return None

    def quality(self, arm: Arm, passed: int, total: int, at: float) -> None:
        self._arms[arm].quality = (passed, total)

    def unhealthy(self, at: float, reason: str) -> GateValue:
        self._health = GateValue("health", "fail", None, 0.0, {}, detail=reason)
        return self._health

    def _hard(self) -> list[GateValue]:
        c = self._arms["candidate"].requests
        n = len(c)
        fails = sum(1 for _, f, _ in c if f)
        ooms = sum(1 for _, _, o in c if o)
        rate = fails / n if n else 0.0
        p = self.policy
        return [
            GateValue("oom", "fail" if ooms > p.oom_max else "pass", float(ooms), p.oom_max, {}),
            GateValue(
                "error_rate",
                "fail" if rate > p.error_rate_max else "pass",
                rate,
                p.error_rate_max,
                {"candidate": rate},
            ),
        ]

    def evaluate(self, now: float) -> GateReport:
        horizon = now - self.policy.window_s
        for a in self._arms.values():
            for q in (a.latency, a.ttft, a.requests):
                while q and q[0][0] < horizon:
                    q.popleft()
        gates: list[GateValue] = []
        if self._health is not None:
            gates.append(self._health)
        gates += self._hard()
        p = self.policy
        for name, series, limit in (
            ("ttft_ratio", "ttft", p.ttft_ratio_max),
            ("p99_ratio", "latency", p.p99_ratio_max + p.p99_tolerance),
        ):
            base = [v for _, v in getattr(self._arms["primary"], series)]
            cand = [v for _, v in getattr(self._arms["candidate"], series)]
            mb, mc = _median(base), _median(cand)
            if len(base) < p.min_samples or len(cand) < p.min_samples or not mb or mc is None:
                gates.append(GateValue(name, "wait", None, limit, {"primary": mb, "candidate": mc}))
                continue
            r = mc / mb
            gates.append(
                GateValue(
                    name,
                    "pass" if r <= limit else "wait",
                    r,
                    limit,
                    {"primary": mb, "candidate": mc},
                )
            )
        failed = next((g for g in gates if g.verdict == "fail"), None)
        ready = failed is None and all(g.verdict == "pass" for g in gates)
        samples = {k: len(a.requests) for k, a in self._arms.items()}
        return GateReport(now, tuple(gates), failed, ready, samples)
