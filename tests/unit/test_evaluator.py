"""The ladder's window never waits on a recovery probe (issue 13).

A hung primary used to stall dwell, ramps and AIMD for up to `first_byte_s`:
its recovery probe was awaited inside the evaluation loop. Now the probe runs
as its own task and its result arrives as a breaker transition.
"""

from __future__ import annotations

import asyncio

from proxy.runtime.loops import Evaluator
from proxy.runtime.state import ProxyState
from proxy.telemetry.metrics import Metrics
from tests.integration.conftest import free_port, make_policy


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Windows:
    """The evaluator's sleep: counts windows, returns at once."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, seconds: float) -> None:
        self.count += 1
        await asyncio.sleep(0)


async def _turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_hung_recovery_probe_does_not_delay_the_next_evaluation() -> None:
    clock = Clock()
    state = ProxyState(make_policy(f"http://127.0.0.1:{free_port()}"), Metrics(), clock)
    await state.start()
    try:
        rt = state.current
        up = rt.upstreams["primary"]
        answer = asyncio.Event()
        probes: list[int] = []

        async def hung_probe() -> str | None:  # a primary that never answers
            probes.append(1)
            await answer.wait()
            return None

        up.recovery_probe = hung_probe  # type: ignore[method-assign]
        evaluations: list[bool] = []
        evaluate = rt.evaluate

        def counting(window: bool = False) -> object:
            evaluations.append(window)
            return evaluate(window)

        rt.evaluate = counting  # type: ignore[method-assign,assignment]
        up.breaker.force_open("test: primary hung")
        clock.now += rt.policy.ladder.breaker.reset_timeout_s + 1

        windows = Windows()
        loop = asyncio.create_task(Evaluator(state, sleep=windows).run())
        await _turns()
        # Windows keep coming while the probe hangs: one probe, many evaluations.
        assert windows.count >= 10
        assert evaluations.count(True) >= 9
        assert probes == [1]
        assert up.breaker.state == "half-open"

        # The probe's answer arrives as a signal: the breaker closes.
        answer.set()
        await _turns()
        assert up.breaker.state == "closed"
        assert probes == [1]
        loop.cancel()
    finally:
        await state.close()


async def test_a_probe_that_raises_ends_its_trial_and_is_counted() -> None:
    clock = Clock()
    m = Metrics()
    state = ProxyState(make_policy(f"http://127.0.0.1:{free_port()}"), m, clock)
    await state.start()
    try:
        rt = state.current
        up = rt.upstreams["primary"]

        async def broken_probe() -> str | None:
            raise KeyError("a defect in the probe")

        up.recovery_probe = broken_probe  # type: ignore[method-assign]
        up.breaker.force_open("test")
        clock.now += rt.policy.ladder.breaker.reset_timeout_s + 1
        evaluator = Evaluator(state, sleep=Windows())
        evaluator.tick()
        await _turns()
        assert up.breaker.state == "open"  # the trial failed; a later window tries again
        assert evaluator.probing() == []
        text = m.exposition().decode()
        assert 'brownout_loop_errors_total{loop="recovery_probe_primary"} 1.0' in text
    finally:
        await state.close()
