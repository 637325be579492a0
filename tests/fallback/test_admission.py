"""Bounded concurrency with a bounded FIFO queue."""

from __future__ import annotations

import asyncio

import pytest

from proxy.fallback.engines.admission import Admission, QueueFull


async def test_slots_then_queue_then_full() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    await admission.acquire()
    queued = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    assert (admission.running, admission.waiting) == (1, 1)
    assert admission.is_full()
    with pytest.raises(QueueFull):
        await admission.acquire()
    admission.release()  # hands the slot to the queued request
    await queued
    assert (admission.running, admission.waiting) == (1, 0)
    admission.release()
    assert (admission.running, admission.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    admission = Admission(max_running=1, max_waiting=2)
    await admission.acquire()
    first = asyncio.create_task(admission.acquire())
    second = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert admission.waiting == 1
    admission.release()
    await second  # FIFO among the ones still waiting
    assert (admission.running, admission.waiting) == (1, 0)


async def test_slot_handed_to_a_waiter_cancelled_meanwhile_is_not_lost() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    await admission.acquire()
    waiter = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    admission.release()  # resolves the waiter's future...
    waiter.cancel()  # ...but the task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (admission.running, admission.waiting) == (0, 0)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_running"):
        Admission(max_running=0, max_waiting=0)
