"""`Deadline` (the request path's first-byte deadline, issue 24) behaves as
`asyncio.timeout_at` does, case for case: what comes out of the block, and
the task's cancellation count after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.pipeline.deadline import Deadline

Scope = Callable[[float], Any]


@contextlib.asynccontextmanager
async def lean(when: float) -> AsyncIterator[None]:
    with Deadline(asyncio.get_running_loop(), when):
        yield


def stdlib(when: float) -> Any:
    return asyncio.timeout_at(when)


async def outcome(
    scope: Scope, body: Callable[[float], Awaitable[None]], delay: float
) -> tuple[str, int]:
    """Run `body` under `scope(now + delay)` in a task of its own: what came
    out of the block ("ok" or the exception's name) and `cancelling()` after."""

    async def run() -> tuple[str, int]:
        task = asyncio.current_task()
        assert task is not None
        when = asyncio.get_running_loop().time() + delay
        try:
            async with scope(when):
                await body(when)
        except BaseException as exc:
            return type(exc).__name__, task.cancelling()
        return "ok", task.cancelling()

    return await asyncio.create_task(run())


def _sleep(s: float) -> Callable[[float], Awaitable[None]]:
    async def body(when: float) -> None:
        await asyncio.sleep(s)

    return body


async def _no_suspension(when: float) -> None:
    pass


async def _raises(when: float) -> None:
    await asyncio.sleep(0)
    raise ValueError("inside")


async def _cancelled_soon(when: float) -> None:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_later(0.01, task.cancel)
    await asyncio.sleep(1)


async def _cancelled_at_the_deadline(when: float) -> None:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_at(when, task.cancel)  # the same loop step
    await asyncio.sleep(1)


CASES = {
    "done in time": (_sleep(0.01), 0.5),
    "too slow": (_sleep(1), 0.05),
    "deadline already past": (_sleep(0.5), -1.0),
    "past, but no suspension": (_no_suspension, -1.0),
    "own exception": (_raises, 0.5),
    "cancelled from outside first": (_cancelled_soon, 0.5),
    "cancelled from outside at the deadline": (_cancelled_at_the_deadline, 0.05),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_deadline_is_an_asyncio_timeout(case: str) -> None:
    make, delay = CASES[case]
    want = await outcome(stdlib, make, delay)
    got = await outcome(lean, make, delay)
    assert got == want


async def test_an_outer_timeout_still_sees_its_own_cancellation() -> None:
    loop = asyncio.get_running_loop()

    async def run() -> str:
        try:
            async with asyncio.timeout(0.05):
                with Deadline(loop, loop.time() + 10):
                    await asyncio.sleep(1)
        except TimeoutError:
            return "outer timeout"
        return "ok"

    assert await asyncio.create_task(run()) == "outer timeout"
