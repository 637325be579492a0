"""Supervised background work: a loop that raises is logged, counted and run again."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, generate_latest

from proxy.runtime.supervise import Supervisor
from proxy.telemetry.metrics import Metrics


class FakeSleep:
    """Records each backoff and returns at once (no wall-clock waits)."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


def _exposition(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


async def _until(check: object, turns: int = 1000) -> None:
    for _ in range(turns):
        if callable(check) and check():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_a_failing_loop_is_counted_and_runs_again_with_backoff() -> None:
    m = Metrics()
    sleep = FakeSleep()
    sup = Supervisor(m.loop_errors, backoff_s=0.5, max_backoff_s=4.0, sleep=sleep)
    runs: list[int] = []
    release = asyncio.Event()

    async def body() -> None:
        runs.append(1)
        if len(runs) <= 4:
            raise RuntimeError(f"boom {len(runs)}")
        await release.wait()  # the fifth run works and keeps running

    task = sup.start("injected", body)
    await _until(lambda: len(runs) == 5)
    assert not task.done()
    text = _exposition(m)
    assert 'brownout_loop_errors_total{loop="injected"} 4.0' in text
    assert sleep.delays == [0.5, 1.0, 2.0, 4.0]  # doubling, capped
    assert sup.errors() == {"injected": {"count": 4, "last": "RuntimeError: boom 4"}}
    release.set()
    await task  # a body that returns has finished on purpose
    await sup.close()


async def test_reconcile_starts_the_wanted_loops_and_stops_the_others() -> None:
    sup = Supervisor(Counter("x_loop_errors", "x", ["loop"], registry=CollectorRegistry()))
    started: list[str] = []

    def forever(name: str):  # type: ignore[no-untyped-def]
        async def body() -> None:
            started.append(name)
            await asyncio.Event().wait()

        return body

    sup.reconcile({"evaluate": forever("evaluate"), "shared_sync": forever("shared_sync")})
    await _until(lambda: len(started) == 2)
    assert sup.running() == ["evaluate", "shared_sync"]
    # A reload that drops `ladder.shared`: its loop stops, the other keeps running.
    sup.reconcile({"evaluate": forever("evaluate")})
    await asyncio.sleep(0)
    assert sup.running() == ["evaluate"]
    assert started == ["evaluate", "shared_sync"]  # not restarted
    sup.reconcile({"evaluate": forever("evaluate"), "watch_policy": forever("watch_policy")})
    await _until(lambda: len(started) == 3)
    assert sup.running() == ["evaluate", "watch_policy"]
    await sup.close()
    assert sup.running() == []


async def test_spawned_work_is_referenced_and_its_failure_counted() -> None:
    m = Metrics()
    sup = Supervisor(m.loop_errors)

    async def publish() -> None:
        await asyncio.sleep(0)
        raise ConnectionError("redis went away")

    task = sup.spawn("shared_publish", publish())
    await _until(task.done)
    await asyncio.sleep(0)
    assert 'brownout_loop_errors_total{loop="shared_publish"} 1.0' in _exposition(m)
    assert sup.errors()["shared_publish"]["last"] == "ConnectionError: redis went away"
    await sup.close()
