"""Issue 21: what a rollback bundle's errors.jsonl holds (proxy.runtime.canary),
the canary driven directly with an injected clock; the bundle written to a
temporary directory."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from proxy.pipeline.record import Terminal
from proxy.policy import parse_policy
from proxy.runtime.canary import Canary
from proxy.telemetry.metrics import Metrics


class Rig:
    def __init__(self, tmp: Path) -> None:
        doc = {
            "backends": {
                "primary": {"url": "http://127.0.0.1:1"},
                "candidate": {"url": "http://127.0.0.1:2"},
            },
            "rollout": {
                "steps": [1.0],
                "step_s": 3600,
                "snapshot_dir": str(tmp),
                "gates": {"error_rate_max": 1.0},  # only the health gate rolls back
            },
        }
        self.now = 100.0
        self.spawned: list[Coroutine[Any, Any, None]] = []
        self.canary = Canary(
            parse_policy(yaml.safe_dump(doc), "t.yaml"),
            lambda: self.now,
            Metrics(),
            lambda coro, name: self.spawned.append(coro),
        )
        self.cand = SimpleNamespace(
            down=False,
            health=SimpleNamespace(last_error=None),
            breaker=SimpleNamespace(state="closed", last_reason=""),
        )
        self.root = tmp

    async def settle(self) -> None:
        """Run what the canary spawned (the bundle's write, state saves)."""
        while self.spawned:
            await self.spawned.pop(0)

    def tick(self) -> None:
        self.canary.tick(self.cand)  # type: ignore[arg-type]

    def candidate_fails(self, rid: str) -> None:
        """A request's attempt on the candidate failed (the inbox's report);
        the request goes on to the primary."""
        self.canary.attempt_failed(rid, "candidate", 500, "http_500", "sampler crashed", "backend")

    def finish(self, rid: str, backend: str = "primary", status: int = 200) -> None:
        rec = SimpleNamespace(rid=rid, candidate_fault="http_500", stream=False)
        self.canary.finished(rec, Terminal(backend, status, "complete"), 0.5)  # type: ignore[arg-type]

    def bundles(self) -> list[Path]:
        return sorted(p.parent for p in self.root.glob("*/verdict.json"))

    def errors(self, bundle: Path) -> list[dict[str, Any]]:
        lines = (bundle / "errors.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]


async def test_failures_before_a_health_rollback_are_in_its_bundle_and_later_ones_are_not(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    assert rig.canary.act("start") == ""
    rig.candidate_fails("r1")
    rig.finish("r1")  # answered by the primary: counted against the candidate
    rig.candidate_fails("r2")  # still being answered by the primary...
    rig.cand.down = True
    rig.cand.health.last_error = "health returned HTTP 503"
    rig.tick()  # ... when /health rolls back
    snap = rig.canary.snapshot()
    assert snap["state"] == "rolled_back"
    assert snap["reason"] == "candidate unhealthy: health returned HTTP 503"
    rig.finish("r2")  # after the rollback
    rig.candidate_fails("r3")  # a failure known only after it
    rig.finish("r3")
    await rig.settle()
    (bundle,) = rig.bundles()  # written once
    errors = rig.errors(bundle)
    assert [(e["request_id"], e["arm"]) for e in errors] == [
        ("r1", "candidate"),
        ("r2", "candidate"),
    ]
    r1, r2 = errors
    assert (r1["status"], r1["fault"], r1["detail"]) == (500, "http_500", "sampler crashed")
    assert (r1["answered_by"], r1["client_status"], r1["counted"]) == ("primary", 200, True)
    # In flight at the rollback: how it ended is not known to the bundle.
    assert (r2["answered_by"], r2["counted"]) == (None, None)
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["detail"] == "candidate unhealthy: health returned HTTP 503"


async def test_a_breaker_rollback_names_the_cause_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.canary.act("start")
    rig.cand.breaker.state = "open"
    rig.cand.breaker.last_reason = "http_500"
    rig.tick()
    assert rig.canary.snapshot()["reason"] == "candidate unhealthy: breaker open: http_500"
    await rig.settle()


async def test_a_new_rollouts_bundle_holds_only_its_own_errors(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.canary.act("start")
    rig.candidate_fails("old")
    rig.cand.down = True
    rig.tick()
    await rig.settle()
    rig.cand.down = False
    rig.now += 60
    assert rig.canary.act("start") == ""
    rig.candidate_fails("new")
    rig.cand.breaker.state = "open"
    rig.tick()
    await rig.settle()
    first, second = sorted(
        rig.bundles(), key=lambda b: json.loads((b / "verdict.json").read_text())["started_at"]
    )
    assert [e["request_id"] for e in rig.errors(first)] == ["old"]
    assert [e["request_id"] for e in rig.errors(second)] == ["new"]
