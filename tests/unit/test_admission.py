"""The admission limiter: limit, FIFO, priorities, deadlines, Retry-After."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.control.admission import MIN_SERVICE_S, Admission, Rejected
from proxy.policy import AdmissionPolicy, Priority


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(**kw: object) -> tuple[Admission, Clock]:
    clock = Clock()
    return Admission(AdmissionPolicy(**kw), clock), clock  # type: ignore[arg-type]


async def test_limit_then_fifo() -> None:
    adm, _ = make(max_inflight=2, queue_size=10, queue_timeout_s=5)
    await adm.acquire("normal")
    await adm.acquire("normal")
    order: list[int] = []

    async def wait(i: int) -> None:
        await adm.acquire("normal")
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(4)]
    await asyncio.sleep(0)
    assert adm.inflight == 2
    assert adm.queued == 4
    for _ in range(4):
        adm.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]
    assert adm.inflight == 2


async def test_priorities_are_served_first_and_shed_last() -> None:
    adm, _ = make(max_inflight=1, queue_size=2, queue_timeout_s=5)
    await adm.acquire("normal")
    got: list[str] = []

    async def wait(p: Priority) -> None:
        try:
            await adm.acquire(p)
            got.append(p)
        except Rejected as r:
            got.append(f"{p}:{r.reason}")

    t1 = asyncio.create_task(wait("sheddable"))
    t2 = asyncio.create_task(wait("normal"))
    await asyncio.sleep(0)
    # Queue full: a critical request evicts the newest sheddable waiter.
    t3 = asyncio.create_task(wait("critical"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert got == ["sheddable:evicted"]
    # Queue full again and nothing lower than sheddable: refused at once.
    with pytest.raises(Rejected) as info:
        await adm.acquire("sheddable")
    assert info.value.reason == "queue_full"
    adm.release()
    await asyncio.sleep(0)
    adm.release()
    await asyncio.gather(t1, t2, t3)
    assert got == ["sheddable:evicted", "critical", "normal"]


async def test_queue_timeout_and_expected_wait() -> None:
    adm, clock = make(max_inflight=1, queue_size=10, queue_timeout_s=0.05)
    await adm.acquire("normal")
    with pytest.raises(Rejected) as info:
        await adm.acquire("normal")
    assert info.value.reason == "queue_timeout"
    assert adm.queued == 0
    # With a measured drain rate of 1/s, 10 waiters can't make a 0.05 s deadline.
    clock.t += 1
    adm.release()
    await adm.acquire("normal")
    with pytest.raises(Rejected) as info:
        await adm.acquire("normal")
    assert info.value.reason == "deadline"
    assert 1 <= info.value.retry_after <= 60


async def test_throttle_sheds_sheddable_at_once() -> None:
    adm, _ = make(max_inflight=10)
    adm.shed_sheddable = True
    with pytest.raises(Rejected) as info:
        await adm.acquire("sheddable")
    assert info.value.reason == "shed"
    await adm.acquire("normal")


async def test_lower_limit_holds_new_requests() -> None:
    adm, _ = make(max_inflight=4, queue_timeout_s=5)
    for _ in range(3):
        await adm.acquire("normal")
    adm.set_limit(2)
    t = asyncio.create_task(adm.acquire("normal"))
    await asyncio.sleep(0)
    assert not t.done()
    adm.release()
    adm.release()
    await asyncio.sleep(0)
    assert t.done()
    assert adm.inflight == 2


def test_retry_after_follows_drain_rate() -> None:
    adm, clock = make(max_inflight=4, queue_timeout_s=10)
    assert adm.retry_after() == 10  # no rate measured yet: the deadline
    for _ in range(4):
        adm._take("")
    for _ in range(20):
        clock.t += 0.1  # 4 slots, one completes (and is replaced) every 0.1 s
        adm.release()
        adm._take("")
    assert adm.drain_rate() == pytest.approx(10)
    assert adm.retry_after(position=49) == 5


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.sampled_from(["critical", "normal", "sheddable"]), st.just("release")),
        max_size=60,
    ),
    limit=st.integers(min_value=1, max_value=4),
)
def test_never_exceeds_the_limit(ops: list[str], limit: int) -> None:
    async def run() -> None:
        adm, _ = make(max_inflight=limit, queue_size=3, queue_timeout_s=5)
        tasks: list[asyncio.Task[None]] = []
        for op in ops:
            if op == "release":
                if adm.inflight:
                    adm.release()
            else:
                tasks.append(asyncio.create_task(adm.acquire(op)))  # type: ignore[arg-type]
            await asyncio.sleep(0)
            assert adm.inflight <= adm.limit
            assert adm.queued <= 3
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


async def test_slot_handed_over_as_the_deadline_fires_is_not_leaked() -> None:
    """Release and queue timeout in the same event-loop step: the waiter owns
    the slot (it was handed over), so it must be admitted, not refused with
    the slot still counted in flight (which blocked all traffic at limit 1)."""
    adm, _ = make(max_inflight=1, queue_timeout_s=0.2)
    await adm.acquire("normal")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    waiter = asyncio.create_task(adm.acquire("normal"))
    await asyncio.sleep(0)
    assert adm.queued == 1
    # Block the loop across the deadline so the release (due just before it)
    # and the timeout run back to back in one step, release first.
    loop.call_at(t0 + 0.17, time.sleep, 0.08)
    loop.call_at(t0 + 0.195, adm.release)
    await asyncio.wait({waiter})
    assert waiter.exception() is None, "the handed-over slot was refused"
    assert adm.inflight == 1
    adm.release()
    assert adm.inflight == 0


async def test_idle_gap_does_not_refuse_queued_requests() -> None:
    """After an idle minute the drain-rate estimate must not read as 'nothing
    drains' and refuse the first queued request by the deadline rule."""
    adm, clock = make(max_inflight=2, queue_timeout_s=10)
    adm.inflight = 20
    for _ in range(20):
        clock.t += 0.5  # 2 completions per second
        adm.release()
    clock.t += 300  # idle
    await adm.acquire("normal")
    await adm.acquire("normal")
    queued = asyncio.create_task(adm.acquire("normal"))
    await asyncio.sleep(0)
    assert not queued.done(), "refused at once after an idle gap"
    adm.release()
    await queued
    # Busy with nothing completing: the estimate decays (refusals are real).
    clock.t += 40
    assert adm.drain_rate() < 0.05


async def test_a_burst_after_an_idle_start_is_not_refused_by_the_deadline() -> None:
    """Issue 14 item 9: the rate divided by idle time. A fresh pool idle for
    20 s, then a burst of 1 s requests: the third got 429 `deadline` with
    Retry-After 21 while its real wait was about 1 s."""
    adm, clock = make(max_inflight=1, queue_size=10, queue_timeout_s=10)
    clock.t += 20  # idle since start
    await adm.acquire("normal")
    second = asyncio.create_task(adm.acquire("normal"))
    await asyncio.sleep(0)
    clock.t += 1  # the first takes a second
    adm.release()
    await second
    assert adm.drain_rate() == pytest.approx(1.0)
    third = asyncio.create_task(adm.acquire("normal"))
    await asyncio.sleep(0)
    assert not third.done(), third.exception()
    assert adm.queued == 1
    assert adm.retry_after() == 2  # two ahead of a newcomer, one per second
    clock.t += 1
    adm.release()
    await third


async def test_simultaneous_completions_do_not_inflate_the_rate() -> None:
    """Issue 14 item 9: eight completions in the same instant read as
    1,000/s each, so the deadline rule stopped refusing a queue that would
    take 20 s to drain."""
    adm, clock = make(max_inflight=8, queue_size=64, queue_timeout_s=10)
    for _ in range(8):
        await adm.acquire("normal")
    clock.t += 2  # a batch of eight that all finish together after 2 s: 4/s
    for _ in range(8):
        adm.release()
    assert adm.drain_rate() == pytest.approx(4.0)
    for _ in range(8):
        await adm.acquire("normal")
    waiting: list[asyncio.Task[None]] = []
    refused: list[Rejected] = []
    for _ in range(64):
        try:
            waiting.append(asyncio.create_task(adm.acquire("normal")))
            await asyncio.sleep(0)
            if waiting[-1].done():
                waiting[-1].result()
        except Rejected as r:
            refused.append(r)
    # 40 fit in 10 s at 4/s; the rest are told at once when to come back.
    assert adm.queued == 40
    assert len(refused) == 24 and {r.reason for r in refused} == {"deadline"}
    assert {r.retry_after for r in refused} == {11}  # ⌈41 ÷ 4⌉: the 41st place
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


def test_the_drain_rate_is_bounded() -> None:
    adm, _ = make(max_inflight=4)
    for _ in range(4):
        adm._take("")
    for _ in range(4):
        adm.release()  # instant completions: no busy time at all
    assert 0 < adm.drain_rate() <= 4 / 0.005


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.just("take"), st.just("release"), st.floats(min_value=0, max_value=30)),
        max_size=80,
    ),
    limit=st.integers(min_value=1, max_value=8),
)
def test_drain_rate_bounds_and_idle_invariance(ops: list[object], limit: int) -> None:
    """Any schedule: the rate is finite, within [0, slots ÷ 5 ms], and idle
    time (nothing in flight) never changes it."""
    adm, clock = make(max_inflight=limit)
    for op in ops:
        if op == "take":
            adm._take("")
        elif op == "release":
            if adm.inflight:
                adm.release()
        else:
            before = adm.drain_rate()
            clock.t += float(op)  # type: ignore[arg-type]
            if adm.inflight == 0:
                assert adm.drain_rate() == before
        rate = adm.drain_rate()
        assert math.isfinite(rate) and rate >= 0
        assert rate <= max(adm.limit, adm.inflight) / MIN_SERVICE_S + 1e-9


# -- fair share (chaos drill 8: one client's long answers held every slot) ----


async def _queue(adm: Admission, client: str, order: list[str], priority: Priority = "normal"):
    async def wait() -> None:
        try:
            await adm.acquire(priority, client)
            order.append(client)
        except Rejected as r:
            order.append(f"{client}:{r.reason}")

    t = asyncio.create_task(wait())
    await asyncio.sleep(0)
    return t


async def test_a_freed_slot_goes_to_the_client_holding_the_fewest() -> None:
    adm, _ = make(max_inflight=4, queue_size=10, queue_timeout_s=5)
    for _ in range(3):
        await adm.acquire("normal", "hog")  # grabbed while the pool was idle
    await adm.acquire("normal", "b")
    order: list[str] = []
    tasks = [await _queue(adm, c, order) for c in ("hog", "hog", "b", "c")]
    assert adm.held == {"hog": 3, "b": 1}
    adm.release("hog")
    await asyncio.sleep(0)
    assert order == ["c"]  # holds none: first, though it queued last
    adm.release("hog")
    await asyncio.sleep(0)
    assert order == ["c", "hog"]  # hog 1, b 1: equals go first in, first out
    adm.release("c")
    await asyncio.sleep(0)
    assert order == ["c", "hog", "b"]  # b holds 1, hog 2: b, though it queued later
    adm.release("b")
    await asyncio.gather(*tasks)
    assert order == ["c", "hog", "b", "hog"]
    assert adm.held == {"hog": 3, "b": 1}
    assert adm.inflight == 4


async def test_fair_share_off_is_first_in_first_out() -> None:
    adm, _ = make(max_inflight=2, queue_size=10, queue_timeout_s=5, fair_share=False)
    await adm.acquire("normal", "hog")
    await adm.acquire("normal", "hog")
    order: list[str] = []
    tasks = [await _queue(adm, c, order) for c in ("hog", "b")]
    adm.release("hog")
    adm.release("hog")
    await asyncio.gather(*tasks)
    assert order == ["hog", "b"]


async def test_priority_still_comes_before_the_fair_share() -> None:
    adm, _ = make(max_inflight=2, queue_size=10, queue_timeout_s=5)
    await adm.acquire("normal", "hog")
    await adm.acquire("normal", "hog")
    order: list[str] = []
    tasks = [
        await _queue(adm, "b", order, "sheddable"),
        await _queue(adm, "hog", order, "critical"),
    ]
    adm.release("hog")
    await asyncio.sleep(0)
    assert order == ["hog"]
    adm.release("hog")
    await asyncio.gather(*tasks)
    assert order == ["hog", "b"]


async def test_a_full_queue_sheds_the_heaviest_clients_newest_waiter() -> None:
    adm, _ = make(max_inflight=2, queue_size=2, queue_timeout_s=5)
    await adm.acquire("normal", "hog")
    await adm.acquire("normal", "hog")
    order: list[str] = []
    tasks = [await _queue(adm, "hog", order), await _queue(adm, "hog", order)]
    # b holds nothing (under its share of 1): the hog's newest waiter makes room.
    t_b = await _queue(adm, "b", order)
    await asyncio.sleep(0)
    assert order == ["hog:evicted"]
    # The hog itself, over its share, is refused when the queue is full.
    with pytest.raises(Rejected) as info:
        await adm.acquire("normal", "hog")
    assert info.value.reason == "queue_full"
    adm.release("hog")
    await asyncio.sleep(0)
    assert order == ["hog:evicted", "b"]
    adm.release("hog")
    await asyncio.gather(*tasks, t_b)
    assert order == ["hog:evicted", "b", "hog"]


async def test_waits_beyond_a_clients_share_are_not_engine_pressure() -> None:
    seen: list[tuple[str, bool]] = []
    clock = Clock()
    who: list[str] = []
    adm = Admission(
        AdmissionPolicy(max_inflight=2, queue_size=10, queue_timeout_s=5),
        clock,
        lambda s, counts: seen.append((who.pop(0), counts)),
    )
    await adm.acquire("normal", "hog")
    await adm.acquire("normal", "hog")
    order: list[str] = []
    # hog holds 2 = the whole pool, alone: its wait is real pressure (one client).
    t1 = await _queue(adm, "hog", order)
    # b holds nothing, share 1 of 2, but the hog holds 2: b waits behind the
    # hog's excess, not the engine; the hog's next one (holding 2, share 1,
    # another client waiting) is its own excess demand: neither counts.
    t2 = await _queue(adm, "b", order)
    t3 = await _queue(adm, "hog", order)
    who.extend(["b", "hog", "hog"])
    for _ in range(3):
        adm.release("hog")
        await asyncio.sleep(0)
    await asyncio.gather(t1, t2, t3)
    assert order == ["b", "hog", "hog"]
    # Served b first (t2), then t1 (queued when hog was alone), then t3.
    assert seen == [("b", False), ("hog", True), ("hog", False)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["acquire", "release"]), st.sampled_from(["a", "b", "c"])),
        max_size=60,
    ),
    st.integers(1, 4),
)
def test_slots_held_per_client_always_add_up(ops: list[tuple[str, str]], limit: int) -> None:
    """Whatever the order of arrivals and departures: the clients' holdings sum
    to the slots in flight, never above the limit; everyone queued is served
    once the others leave (liveness), and an idle pool holds nothing."""

    async def run() -> None:
        adm, _ = make(max_inflight=limit, queue_size=100, queue_timeout_s=1000)
        holding: list[str] = []
        waiting: list[tuple[str, asyncio.Task[None]]] = []
        for op, c in ops:
            if op == "acquire":
                waiting.append((c, asyncio.create_task(adm.acquire("normal", c))))
            elif holding:
                adm.release(holding.pop(holding.index(c)) if c in holding else holding.pop(0))
            await asyncio.sleep(0)
            for c2, t in [w for w in waiting if w[1].done()]:
                waiting.remove((c2, t))
                holding.append(c2)
            assert sum(adm.held.values()) == adm.inflight == len(holding) <= limit
        while waiting:
            adm.release(holding.pop(0))
            await asyncio.sleep(0)
            for c2, t in [w for w in waiting if w[1].done()]:
                waiting.remove((c2, t))
                holding.append(c2)
        while holding:
            adm.release(holding.pop())
        assert adm.held == {} and adm.inflight == 0 and adm.queued == 0

    asyncio.run(run())


async def test_a_wait_behind_a_client_past_its_share_is_not_engine_pressure() -> None:
    """The hog holds 3 of 4 slots (share 2 with two clients): b's wait is the
    hog's doing, not the engine's; once nobody is past its share, b's next
    wait counts again."""
    seen: list[bool] = []
    clock = Clock()
    adm = Admission(
        AdmissionPolicy(max_inflight=4, queue_size=10, queue_timeout_s=5),
        clock,
        lambda s, counts: seen.append(counts),
    )
    for _ in range(3):
        await adm.acquire("normal", "hog")
    await adm.acquire("normal", "b")
    order: list[str] = []
    t = await _queue(adm, "b", order)
    adm.release("hog")
    await t
    assert seen == [False]  # queued while the hog held 3 > 2
    adm.release("hog")
    await adm.acquire("normal", "c")  # hog 1, b 2, c 1: nobody past 2 (share ⌈4/3⌉)
    t = await _queue(adm, "c", order)
    adm.release("b")
    await t
    assert seen == [False, True]
