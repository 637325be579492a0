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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import structlog

from proxy.fallback.engines.engine import MAX_TOP_LOGPROBS, Engine
from proxy.fallback.engines.interface import (
    Capabilities,
    EngineClosed,
    EngineName,
    Finished,
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
    def __init__(
        self,
        engine: Engine,
        max_concurrency: int,
        *,
        kv_token_budget: int = 0,
        gumbel_seed: bool = False,
        thread_name_prefix: str = "generate",
    ) -> None:
        """`gumbel_seed`: seeded sampling as the batched engine's (its side lane sets it)."""
        self._engine = engine
        self._max_running = max_concurrency
        self._gumbel_seed = gumbel_seed
        self._generate_pool = ThreadPoolExecutor(
            max_concurrency, thread_name_prefix=thread_name_prefix
        )
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

    @property
    def side_slots(self) -> int:
        return 0

    def in_side_lane(self, spec: GenerationSpec) -> bool:
        return False

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizer call on the tokenizer thread."""
        return await self._tokenizer.run(fn)

    def load(self) -> Load:
        # HF's dynamic cache grows per token; the reserved worst case is what can run out.
        reserved = sum(self._active.values())
        usage = min(reserved / self._kv_token_budget, 1.0) if self._kv_token_budget else 0.0
        # More generations than threads (the batched engine's side lane shares the
        # admission's slots): the rest wait for a thread.
        running = min(len(self._active), self._max_running)
        return Load(running=running, waiting=len(self._active) - running, kv_cache_usage=usage)

    def alive(self) -> bool:
        return not self._closing

    def submit(self, spec: GenerationSpec, observer: Observer) -> Generation:
        """Start generating on a worker thread; the caller holds a concurrency slot."""
        if self._closing:
            # A queued request admitted during shutdown must not start a fresh generation.
            raise EngineClosed
        loop = asyncio.get_running_loop()
        queued: list[Future[None]] = []

        def dequeue() -> None:
            # Still waiting for a thread (more generations than threads): it ends now.
            if queued and queued[0].cancel():
                generation.deliver(Finished("abort", 0))

        generation = Generation(loop, observer, on_cancel=dequeue)
        work = self._generate_pool.submit(self._run, generation, spec)
        queued.append(work)
        self._active[generation] = len(spec.prompt_ids) + spec.max_tokens

        def finished(_: asyncio.Future[None]) -> None:
            self._active.pop(generation, None)
            if not generation.done.done():
                generation.done.set_result(None)

        asyncio.wrap_future(work, loop=loop).add_done_callback(finished)
        return generation

    def _run(self, generation: Generation, spec: GenerationSpec) -> None:
        if generation.cancel_flag.is_set():  # cancelled while waiting for a thread
            generation.post(Finished("abort", 0))
            return
        try:
            outcome = self._engine.generate(
                spec, generation.cancel_flag, generation.post, gumbel_seed=self._gumbel_seed
            )
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
