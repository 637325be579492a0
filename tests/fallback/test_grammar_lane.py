"""The grammar-compile lane and the schema limits, without a model.

The compile function is a fake that blocks on an event the test sets, so the
lane's bounds (threads, line, deadline), its cache and what happens to a
request whose client goes away are checked exactly, with no timing guesswork
beyond the deadline itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import pytest

from proxy.fallback.api.errors import APIError
from proxy.fallback.features.grammarlane import CompileTimeout, GrammarLane, LaneFull, LaneLimits
from proxy.fallback.features.schemalimits import (
    MAX_ENUM_VALUES,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    check_schema,
)


class FakeCompiler:
    """compile(key) blocks until `release(key)`; records every compile started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def gate(self, key: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(key, threading.Event())

    def __call__(self, key: str) -> str:
        with self._lock:
            self.started.append(key)
        self.gate(key).wait(10)
        if key.startswith("bad"):
            raise APIError(400, f"cannot compile {key}", param="response_format")
        return f"grammar({key})"


async def _until(predicate: Callable[[], bool]) -> None:
    """Let the loop and the compile threads run until `predicate` holds (5 s at most)."""
    async with asyncio.timeout(5.0):
        while not predicate():  # noqa: ASYNC110 - the state changes on other threads
            await asyncio.sleep(0.001)


def _lane(fake: FakeCompiler, **limits: float) -> GrammarLane[str, str]:
    return GrammarLane(fake, LaneLimits(**limits))  # type: ignore[arg-type]


async def test_a_compiled_grammar_is_cached_by_key() -> None:
    fake = FakeCompiler()
    lane = _lane(fake)
    fake.gate("a").set()
    assert await lane.get("a") == "grammar(a)"
    assert await lane.get("a") == "grammar(a)"
    assert fake.started == ["a"]
    assert lane.counts.hits == 1


async def test_a_compile_error_is_cached_too() -> None:
    fake = FakeCompiler()
    lane = _lane(fake)
    fake.gate("bad").set()
    for _ in range(2):
        with pytest.raises(APIError) as err:
            await lane.get("bad")
        assert err.value.status == 400
    assert fake.started == ["bad"]


async def test_the_cache_is_a_bounded_lru() -> None:
    fake = FakeCompiler()
    lane = _lane(fake, cache_entries=2)
    for key in "abc":
        fake.gate(key).set()
        await lane.get(key)
    await lane.get("c")
    await lane.get("a")  # evicted: compiled again
    assert fake.started == ["a", "b", "c", "a"]


async def test_requests_for_a_key_being_compiled_join_that_compile() -> None:
    fake = FakeCompiler()
    lane = _lane(fake, workers=1, queue=0)
    first = asyncio.create_task(lane.get("a"))
    await _until(lambda: fake.started == ["a"])
    second = asyncio.create_task(lane.get("a"))  # no slot free, no room in line: joins
    fake.gate("a").set()
    assert await asyncio.gather(first, second) == ["grammar(a)", "grammar(a)"]
    assert fake.started == ["a"]


async def test_a_full_line_is_shed_and_a_slow_compile_times_out() -> None:
    fake = FakeCompiler()
    lane = _lane(fake, workers=1, queue=1, timeout_s=0.2)
    running = asyncio.create_task(lane.get("slow"))
    await _until(lambda: lane.running == 1)
    waiting = asyncio.create_task(lane.get("next"))
    await _until(lambda: lane.waiting == 1)
    with pytest.raises(LaneFull):
        await lane.get("third")
    for task in (running, waiting):
        with pytest.raises(CompileTimeout):
            await task
    assert fake.started == ["slow"]  # "next" gave up in line: never compiled
    # The timed-out compile still holds its slot: at most `workers` compiles run.
    assert lane.running == 1
    fake.gate("slow").set()
    await _until(lambda: lane.running == 0)
    assert await lane.get("slow") == "grammar(slow)"  # it landed in the cache
    assert lane.counts.hits == 1


async def test_a_client_gone_while_in_line_starts_no_compile() -> None:
    fake = FakeCompiler()
    lane = _lane(fake, workers=1, queue=4)
    running = asyncio.create_task(lane.get("a"))
    await _until(lambda: lane.running == 1)
    gone = asyncio.create_task(lane.get("b"))
    await _until(lambda: lane.waiting == 1)
    gone.cancel()  # aiohttp cancels the handler of a client that disconnected
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert lane.waiting == 0
    fake.gate("a").set()
    await running
    await _until(lambda: lane.running == 0)
    assert fake.started == ["a"]
    assert lane.counts.left == 1


async def test_a_client_gone_while_compiling_leaves_the_compile_to_finish() -> None:
    fake = FakeCompiler()
    lane = _lane(fake, workers=1)
    gone = asyncio.create_task(lane.get("a"))
    await _until(lambda: fake.started == ["a"])
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert lane.running == 1  # the thread cannot be stopped: its slot stays taken
    fake.gate("a").set()
    await _until(lambda: lane.running == 0)
    assert await lane.get("a") == "grammar(a)"
    assert fake.started == ["a"]


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [f"v{i}" for i in range(100_000)]},
        {"enum": list(range(MAX_ENUM_VALUES)), "properties": {"a": {"const": 1}}},
        json.loads('{"type":"object","properties":{"a":' * 200 + "{}" + "}}" * 200),
        json.loads('{"items":' * MAX_SCHEMA_DEPTH + "{}" + "}" * MAX_SCHEMA_DEPTH),
        {"type": "string", "pattern": "[a-z]{10000}"},
        {"type": "string", "pattern": "a{1," + "9" * 5000 + "}"},  # past int()'s digit limit
        {"description": "x" * MAX_SCHEMA_BYTES},
    ],
    ids=["enum-100k", "enum+const", "deep-objects", "deep-items", "repeat", "digits", "bytes"],
)
def test_schemas_over_the_limits_are_a_400_naming_the_field(schema: object) -> None:
    with pytest.raises(APIError) as err:
        check_schema(json.dumps(schema), "response_format")
    assert err.value.status == 400
    assert err.value.param == "response_format"
    assert "response_format" in err.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": list(range(MAX_ENUM_VALUES))},
        json.loads('{"items":' * (MAX_SCHEMA_DEPTH - 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH - 1)),
        {"type": "string", "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{1000}$"},
    ],
    ids=["enum-1000", "depth-63", "uuid-like"],
)
def test_schemas_within_the_limits_pass(schema: object) -> None:
    check_schema(json.dumps(schema), "response_format")
