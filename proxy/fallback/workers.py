"""The threads engine: one thread per generation slot, each running `model.generate()`.

Two pools: one thread per generation slot (`max_running`) and one tokenizer
thread (chat templates and long prompts would otherwise stall the loop).
Each running generation is a `Generation` (see `interface`): the loop reads
its events from an asyncio queue fed with `call_soon_threadsafe`, and cancels
it with a flag the thread checks after every token.

Wins on CPU and for a single stream; on a GPU it does not scale past a few
streams (each thread runs its own batch of one), which is what
`batched.BatchedEngine` is for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import structlog

from proxy.fallback.engine import MAX_TOP_LOGPROBS, Engine
from proxy.fallback.interface import (
    Capabilities,
    EngineClosed,
    EngineName,
    Generation,
    GenerationFailed,
    GenerationSpec,
    Load,
    Observer,
)

log = structlog.get_logger("brownout.fallback.workers")

T = TypeVar("T")

__all__ = ["Generation", "GenerationFailed", "ThreadEngine", "Workers", "WorkersClosed"]

WorkersClosed = EngineClosed  # the pre-interface name

THREADS_CAPABILITIES = Capabilities(
    engine="threads",
    seed=True,
    logprobs=True,
    max_top_logprobs=MAX_TOP_LOGPROBS,
    logits_processors=True,
    repetition_penalty=True,
    min_tokens=True,
)


class TokenizerPool:
    """The one tokenizer thread both engines use."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class ThreadEngine:
    def __init__(self, engine: Engine, max_concurrency: int, *, kv_token_budget: int = 0) -> None:
        self._engine = engine
        self._max_running = max_concurrency
        self._generate_pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="generate")
        self._tokenizer = TokenizerPool()
        self._active: dict[Generation, int] = {}  # generation -> its token budget (prompt + max)
        self._closing = False
        self._kv_token_budget = kv_token_budget

    @property
    def name(self) -> EngineName:
        return "threads"

    @property
    def capabilities(self) -> Capabilities:
        return THREADS_CAPABILITIES

    @property
    def max_running(self) -> int:
        return self._max_running

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizer call on the tokenizer thread."""
        return await self._tokenizer.run(fn)

    def load(self) -> Load:
        # HF's dynamic cache grows per token; the reserved worst case is what can run out.
        reserved = sum(self._active.values())
        usage = min(reserved / self._kv_token_budget, 1.0) if self._kv_token_budget else 0.0
        return Load(running=len(self._active), waiting=0, kv_cache_usage=usage)

    def submit(self, spec: GenerationSpec, observer: Observer) -> Generation:
        """Start generating on a worker thread; the caller holds a concurrency slot."""
        if self._closing:
            # A queued request admitted during shutdown must not start a fresh generation.
            raise EngineClosed
        loop = asyncio.get_running_loop()
        generation = Generation(loop, observer)
        future = loop.run_in_executor(self._generate_pool, self._run, generation, spec)
        self._active[generation] = len(spec.prompt_ids) + spec.max_tokens

        def finished(_: asyncio.Future[None]) -> None:
            self._active.pop(generation, None)
            generation.done.set_result(None)

        future.add_done_callback(finished)
        return generation

    def _run(self, generation: Generation, spec: GenerationSpec) -> None:
        try:
            outcome = self._engine.generate(spec, generation.cancel_flag, generation.post)
        except Exception as exc:  # reported to the client as a server error, never lost
            log.exception("generation_failed")
            generation.post(exc)
        else:
            generation.post(outcome)

    def cancel_all(self) -> None:
        """Shutdown begins: stop running generations and refuse new ones."""
        self._closing = True
        for generation in list(self._active):
            generation.cancel()

    async def close(self) -> None:
        """Cancel running generations, wait for their threads, stop the pools."""
        self.cancel_all()
        await asyncio.gather(*(g.done for g in list(self._active)))
        self._generate_pool.shutdown(wait=True, cancel_futures=True)
        self._tokenizer.shutdown()


Workers = ThreadEngine  # the pre-interface name
