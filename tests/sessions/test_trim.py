"""Trimming with the tiny model's real tokenizer, the remote /tokenize counter and the estimate."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sessions.trim import (
    ContextTooLong,
    EstimateTokenCounter,
    HFTokenCounter,
    Message,
    RemoteTokenCounter,
    TokenCountError,
    TrimResult,
    budget_tokens,
    trim,
)
from tests.harness.procs import free_port

pytest.importorskip("transformers")

HIGH, LOW = 0.9, 0.7
SYSTEM = {"role": "system", "content": "You are a helpful assistant for orders and shipping."}
TEXT = (
    "the package left our warehouse on monday morning and should arrive on thursday "
    "please share your order number so that i can check the status refunds are usually "
    "processed within five to seven business days"
)
WORDS = TEXT.split(" ")


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


def session(turns: int, *, words: int = 30, question: str | None = None) -> list[Message]:
    """System prompt, `turns` past turns (user + assistant), then the current question."""

    def ask(i: int) -> str:
        return f"Question {i}: " + sentence(i, words // 2)

    msgs: list[Message] = [SYSTEM]
    for i in range(turns):
        msgs.append({"role": "user", "content": ask(i)})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + sentence(i + 1, words)})
    # Request n asks what the stored history holds as turn n's question afterwards.
    msgs.append({"role": "user", "content": question or ask(turns)})
    return msgs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def counter(tokenizer: Any) -> HFTokenCounter:
    return HFTokenCounter(tokenizer)


def exact(tokenizer: Any, messages: Sequence[Message]) -> int:
    """The reference: the chat template with the generation prompt, tokenized by transformers."""
    enc = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return len(enc["input_ids"])


class CountingCounter:
    """Wraps a counter and counts the calls trim makes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.message_calls = 0
        self.prompt_calls = 0

    @property
    def is_estimate(self) -> bool:
        return bool(self.inner.is_estimate)

    async def count_messages(self, messages: Sequence[Message]) -> list[int]:
        self.message_calls += 1
        result: list[int] = await self.inner.count_messages(messages)
        return result

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        self.prompt_calls += 1
        result: int = await self.inner.count_prompt(messages)
        return result


def assert_shape(original: Sequence[Message], result: TrimResult) -> None:
    """System first, current question last, and in between a suffix of the history."""
    kept = result.messages
    assert kept[0] is original[0]
    assert kept[-1] is original[-1]
    middle = kept[1:-1]
    if middle:
        assert middle[0]["role"] == "user", "history restarts at a whole turn"
        assert list(original[-1 - len(middle) : -1]) == middle
    assert result.dropped_messages == len(original) - len(kept)
    assert result.dropped_messages == 2 * result.dropped_turns


# --------------------------------------------------------------------------- counters


async def test_hf_counter_matches_the_chat_template(
    tokenizer: Any, counter: HFTokenCounter
) -> None:
    msgs = session(5)
    assert await counter.count_prompt(msgs) == exact(tokenizer, msgs)
    per = await counter.count_messages(msgs)
    assert len(per) == len(msgs)
    # ChatML: every message renders on its own; only the generation prompt is shared.
    generation_prompt = exact(tokenizer, msgs) - sum(per)
    assert 0 < generation_prompt < 10
    assert not counter.is_estimate


async def test_hf_counter_load_factory_and_thread_path(tiny_model_dir: Path) -> None:
    threaded = await HFTokenCounter.load(tiny_model_dir, thread_min_chars=0)
    inline = await HFTokenCounter.load(tiny_model_dir, thread_min_chars=10**9)
    msgs = session(10)
    assert await threaded.count_prompt(msgs) == await inline.count_prompt(msgs)
    assert await threaded.count_messages(msgs) == await inline.count_messages(msgs)
    with pytest.raises(TokenCountError):
        await HFTokenCounter.load(tiny_model_dir / "missing")


async def test_hf_counter_long_history_leaves_the_loop_responsive(tiny_model_dir: Path) -> None:
    counter = await HFTokenCounter.load(tiny_model_dir)
    msgs = session(400, words=200)  # ≈ 740 k characters
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    await counter.count_messages(msgs)
    await counter.count_prompt(msgs)
    elapsed_ms = (time.monotonic() - started) * 1000
    stop.set()
    await task
    # Counted inline, the loop would not tick at all for ≈ 0.5 s.
    assert ticks >= 0.2 * elapsed_ms, (ticks, elapsed_ms)


async def test_estimate_counter_is_flagged() -> None:
    est = EstimateTokenCounter()
    assert est.is_estimate
    msgs = session(3)
    per = await est.count_messages(msgs)
    assert await est.count_prompt(msgs) == sum(per) + 8
    result = await trim(msgs, 10_000, est, high_water=HIGH, low_water=LOW)
    assert result.estimated
    assert not result.trimmed


# --------------------------------------------------------------------------- trimming


def test_budget_helper() -> None:
    assert budget_tokens(2048, 256, margin_tokens=64, default_max_tokens=512) == 1728
    assert budget_tokens(2048, None, margin_tokens=64, default_max_tokens=512) == 1472
    assert budget_tokens(100, 200, margin_tokens=0, default_max_tokens=1) < 0


async def test_no_trim_below_high_water(tokenizer: Any, counter: HFTokenCounter) -> None:
    msgs = session(4)
    total = exact(tokenizer, msgs)
    budget = int(total / HIGH) + 1
    counting = CountingCounter(counter)
    result = await trim(msgs, budget, counting, high_water=HIGH, low_water=LOW)
    assert result.messages == msgs
    assert result.prompt_tokens == total
    assert not result.trimmed
    assert (counting.message_calls, counting.prompt_calls) == (1, 1)


async def test_trimmed_prompt_fits_and_keeps_system_and_question(
    tokenizer: Any, counter: HFTokenCounter
) -> None:
    msgs = session(30)
    total = exact(tokenizer, msgs)
    budget = total // 3
    counting = CountingCounter(counter)
    result = await trim(msgs, budget, counting, high_water=HIGH, low_water=LOW)
    assert result.trimmed
    assert_shape(msgs, result)
    assert result.prompt_tokens == exact(tokenizer, result.messages)
    assert result.prompt_tokens <= LOW * budget, "a block drop goes down to the low-water mark"
    assert (counting.message_calls, counting.prompt_calls) == (1, 2)
    assert not result.estimated


async def test_smaller_window_trims_more(tokenizer: Any, counter: HFTokenCounter) -> None:
    msgs = session(30)
    total = exact(tokenizer, msgs)
    previous = -1
    for fraction in (1.2, 0.9, 0.6, 0.4, 0.2):
        budget = int(total * fraction)
        result = await trim(msgs, budget, counter, high_water=HIGH, low_water=LOW)
        assert exact(tokenizer, result.messages) <= budget
        assert_shape(msgs, result)
        assert result.dropped_turns >= previous
        previous = result.dropped_turns
    assert previous > 0


async def test_block_trimming_keeps_the_prefix_stable(
    tokenizer: Any, counter: HFTokenCounter
) -> None:
    budget = exact(tokenizer, session(12))  # room for about 12 turns
    results = []
    for n in range(60):  # a session growing one turn per request
        msgs = session(n)
        result = await trim(msgs, budget, counter, high_water=HIGH, low_water=LOW)
        assert_shape(msgs, result)
        assert result.prompt_tokens == exact(tokenizer, result.messages)
        assert result.prompt_tokens <= HIGH * budget
        results.append(result)

    block_drops = 0
    for before, after in itertools.pairwise(results):
        assert after.dropped_turns >= before.dropped_turns
        if after.dropped_turns == before.dropped_turns:
            # The next request extends this one: same prefix, the engine's cache hits.
            assert after.messages[: len(before.messages)] == before.messages
        else:
            block_drops += 1
            assert after.prompt_tokens <= LOW * budget
    # A sliding window would change the prefix on every request past the limit; blocks of
    # (high - low) × budget ≈ 2.4 turns here change it on fewer than half of them.
    trimming = sum(1 for r in results if r.trimmed)
    assert 1 <= block_drops < trimming / 2
    assert results[-1].dropped_turns > 30


async def test_huge_question_raises_context_too_long(counter: HFTokenCounter) -> None:
    msgs = session(3, question=sentence(0, 3000))
    with pytest.raises(ContextTooLong) as err:
        await trim(msgs, 500, counter, high_water=HIGH, low_water=LOW)
    assert err.value.budget_tokens == 500
    assert err.value.prompt_tokens > 500
    with pytest.raises(ContextTooLong):
        await trim(session(0), 0, counter, high_water=HIGH, low_water=LOW)


async def test_tail_after_the_last_question_is_kept(
    tokenizer: Any, counter: HFTokenCounter
) -> None:
    # A partial assistant answer being continued on the fallback stays with its question.
    msgs = [*session(20), {"role": "assistant", "content": "The package left"}]
    budget = exact(tokenizer, msgs) // 3
    result = await trim(msgs, budget, counter, high_water=HIGH, low_water=LOW)
    assert result.messages[-2:] == msgs[-2:]
    assert result.messages[0] is SYSTEM
    assert exact(tokenizer, result.messages) <= budget


async def test_underestimating_counter_is_corrected_by_the_exact_count() -> None:
    class DefaultSystemPrompt(EstimateTokenCounter):
        """A template that adds a long default text once per prompt: per-message sums miss it
        for the kept part, so trim must recount and drop more."""

        async def count_prompt(self, messages: Sequence[Mapping[str, Any]]) -> int:
            return await super().count_prompt(messages) + 40 * (len(messages) > 5)

    msgs = session(20)
    result = await trim(msgs, 400, DefaultSystemPrompt(), high_water=HIGH, low_water=LOW)
    assert result.prompt_tokens <= 400
    assert result.prompt_tokens == await DefaultSystemPrompt().count_prompt(result.messages)


def test_invalid_water_marks() -> None:
    with pytest.raises(ValueError, match="low_water"):
        asyncio.run(trim(session(1), 100, EstimateTokenCounter(), high_water=0.5, low_water=0.6))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40),
    question=st.integers(1, 300),
    budget=st.integers(50, 3000),
    high=st.floats(0.5, 1.0),
    gap=st.floats(0.05, 0.45),
)
def test_trim_invariants_with_estimates(
    sizes: list[int], question: int, budget: int, high: float, gap: float
) -> None:
    low = high - gap
    est = EstimateTokenCounter()
    msgs: list[Message] = [{"role": "system", "content": "s" * 30}]
    for i, size in enumerate(sizes):
        msgs.append({"role": "user", "content": f"q{i}" + "x" * size})
        msgs.append({"role": "assistant", "content": f"a{i}" + "y" * size})
    msgs.append({"role": "user", "content": "z" * question})

    async def run() -> TrimResult | None:
        try:
            return await trim(msgs, budget, est, high_water=high, low_water=low)
        except ContextTooLong:
            return None

    result = asyncio.run(run())
    fixed = asyncio.run(est.count_prompt([msgs[0], msgs[-1]]))
    if result is None:
        assert fixed > budget
        return
    assert_shape(msgs, result)
    assert result.prompt_tokens <= budget
    assert result.prompt_tokens <= high * budget or result.dropped_turns == len(sizes)

    # One more turn and a new question: the cut never moves back, and without a new
    # block drop the new prompt extends the previous one.
    grown = [
        *msgs,
        {"role": "assistant", "content": "w" * question},
        {"role": "user", "content": "?"},
    ]
    try:
        nxt = asyncio.run(trim(grown, budget, est, high_water=high, low_water=low))
    except ContextTooLong:
        return
    assert nxt.dropped_turns >= result.dropped_turns
    if nxt.dropped_turns == result.dropped_turns:
        assert nxt.messages[: len(result.messages)] == result.messages


# --------------------------------------------------------------------------- remote /tokenize


@pytest.fixture
async def tokenize_server(tokenizer: Any) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A vLLM-shaped /tokenize backed by the tiny tokenizer; records the requests."""
    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("model") != "tiny":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        text = tokenizer.apply_chat_template(
            body["messages"],
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        return web.json_response({"count": len(ids), "max_model_len": 2048, "tokens": ids})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_remote_counter_matches_and_caches(
    tokenize_server: tuple[str, list[dict[str, Any]]], counter: HFTokenCounter
) -> None:
    url, seen = tokenize_server
    async with aiohttp.ClientSession() as http:
        remote = RemoteTokenCounter(http, url + "/", "tiny")
        msgs = session(6)
        assert await remote.count_messages(msgs) == await counter.count_messages(msgs)
        assert await remote.count_prompt(msgs) == await counter.count_prompt(msgs)
        assert remote.max_model_len == 2048
        assert not remote.is_estimate
        calls = len(seen)
        assert calls == len(msgs) + 1

        # The next request of the session: only its new messages cost a call.
        grown = [*msgs, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "?"}]
        budget = (await counter.count_prompt(grown)) // 2
        result = await trim(grown, budget, remote, high_water=HIGH, low_water=LOW)
        assert result.trimmed
        assert len(seen) - calls == 2 + 2  # two new messages, full prompt, kept prompt
        expected = await trim(grown, budget, counter, high_water=HIGH, low_water=LOW)
        assert result.messages == expected.messages


async def test_remote_counter_errors(tokenize_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = tokenize_server
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TokenCountError, match="404"):
            await RemoteTokenCounter(http, url, "other").count_prompt(session(1))
        down = RemoteTokenCounter(http, f"http://127.0.0.1:{free_port()}", "tiny", timeout_s=1)
        with pytest.raises(TokenCountError):
            await down.count_messages(session(1))
