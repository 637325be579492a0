"""Worker threads for the model, bridged to the event loop.

Two pools: one thread per generation slot (`--max-concurrency`) and one
tokenizer thread (chat templates and long prompts would otherwise stall the
loop). Each running generation is a `Generation`: the loop reads its events
from an asyncio queue fed with `call_soon_threadsafe`, and cancels it with a
flag the thread checks after every token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import structlog

from proxy.fallback.engine import Delta, Engine, Finished
from proxy.fallback.protocol import SamplingParams

log = structlog.get_logger("brownout.fallback.workers")

T = TypeVar("T")


class GenerationFailed(Exception):
    """generate() raised in the worker thread."""


class WorkersClosed(Exception):
    """Shutdown has begun; no new generation starts."""


class Observer(Protocol):
    """Hooks run on the event loop as events arrive, whether or not anyone reads them."""

    def first_token(self) -> None: ...
    def tokens(self, count: int) -> None: ...
    def finished(self, outcome: Finished) -> None: ...


class Generation:
    """One generate() call running on a worker thread, seen from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, observer: Observer) -> None:
        self._loop = loop
        self._observer = observer
        self._events: asyncio.Queue[Delta | Finished | BaseException] = asyncio.Queue()
        self._seen_token = False
        self.cancel_flag = threading.Event()
        self.done: asyncio.Future[None] = loop.create_future()

    def cancel(self) -> None:
        """Ask the thread to stop after its current token; idempotent."""
        self.cancel_flag.set()

    async def next_event(self) -> Delta | Finished:
        """The next delta, or the final `Finished`; raises `GenerationFailed`."""
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise GenerationFailed(str(event) or type(event).__name__) from event
        return event

    def post(self, event: Delta | Finished | BaseException) -> None:
        """Hand an event to the loop; called from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:
            self.cancel_flag.set()  # the loop is closed: nobody is listening any more

    def _deliver(self, event: Delta | Finished | BaseException) -> None:
        if isinstance(event, Delta) and event.tokens:
            if not self._seen_token:
                self._seen_token = True
                self._observer.first_token()
            self._observer.tokens(event.tokens)
        elif isinstance(event, Finished):
            self._observer.finished(event)
        self._events.put_nowait(event)


class Workers:
    def __init__(self, engine: Engine, max_concurrency: int) -> None:
        self._engine = engine
        self._generate_pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="generate")
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._active: set[Generation] = set()
        self._closing = False

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizer call on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        observer: Observer,
    ) -> Generation:
        """Start generating on a worker thread; the caller holds a concurrency slot."""
        if self._closing:
            # A queued request admitted during shutdown must not start a fresh generation.
            raise WorkersClosed
        loop = asyncio.get_running_loop()
        generation = Generation(loop, observer)
        future = loop.run_in_executor(
            self._generate_pool, self._run, generation, list(prompt_ids), params, max_tokens
        )
        self._active.add(generation)

        def finished(_: asyncio.Future[None]) -> None:
            self._active.discard(generation)
            generation.done.set_result(None)

        future.add_done_callback(finished)
        return generation

    def _run(
        self,
        generation: Generation,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
    ) -> None:
        try:
            outcome = self._engine.generate(
                prompt_ids, params, max_tokens, generation.cancel_flag, generation.post
            )
        except Exception as exc:  # reported to the client as a server error, never lost
            log.exception("generation_failed")
            generation.post(exc)
        else:
            generation.post(outcome)

    def cancel_all(self) -> None:
        """Shutdown begins: stop running generations and refuse new ones."""
        self._closing = True
        for generation in self._active:
            generation.cancel()

    async def close(self) -> None:
        """Cancel running generations, wait for their threads, stop the pools."""
        self.cancel_all()
        await asyncio.gather(*(g.done for g in list(self._active)))
        self._generate_pool.shutdown(wait=True, cancel_futures=True)
        self._tokenize_pool.shutdown(wait=True, cancel_futures=True)
