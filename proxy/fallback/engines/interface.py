"""The generation-engine interface: what the HTTP layer submits, what it gets back.

Two engines implement `GenerationEngine`: `workers.ThreadEngine` (one thread
per slot, each running its own `model.generate()`) and
`batched.BatchedEngine` (Transformers' continuous batching). The handlers
only see this module: they build a `GenerationSpec`, check it against the
engine's `Capabilities` (a 400 naming the field when the engine cannot honour
it), `submit` it and read `Delta`s then one `Finished` from the returned
`Generation`. `cancel()` stops it at the next token and frees its slot.

Everything here runs on the event loop, except `Generation.post`, which the
engine's threads call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from proxy.fallback.protocol import SamplingParams

T = TypeVar("T")

Outcome = Literal["stop", "length", "abort"]
EngineName = Literal["threads", "batched"]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log probability under the model (raw logits).

    `top` holds the `top_logprobs` most likely tokens at that position, most
    likely first, as (token id, logprob); empty unless the spec asked for them.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    """Text produced by `tokens` newly generated tokens (text may be empty: held back).

    `token_ids` are those tokens (the end token included when it ends the
    output, as vLLM counts it); `logprobs` has one entry per token id when the
    spec asked for logprobs, else it is empty.
    """

    text: str
    tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: Outcome
    completion_tokens: int


class LogitsProcessorFactory(Protocol):
    """Makes a fresh per-request Transformers `LogitsProcessor` (e.g. a grammar matcher).

    Called once per generation on the engine's thread, so one spec submitted
    twice (n > 1) gets two independent processors.
    """

    def __call__(self) -> Any: ...


@dataclass(frozen=True)
class GenerationSpec:
    """One generation: the prompt, how to sample, how much, what to report.

    - `params`: temperature/top_p/top_k/seed/stop/stop_token_ids/min_tokens/
      ignore_eos/repetition_penalty, as parsed (`max_tokens` there is ignored:
      `max_tokens` below is the resolved budget).
    - `logprobs`: None for none; 0 for the chosen token's logprob only; k > 0
      for the chosen token plus the k most likely (OpenAI's `top_logprobs`).
    - `logits_processors`: factories of per-request Transformers logits
      processors, applied in order before sampling (structured output).
    - `seed_offset`: added to `params.seed`, so the choices of one `n > 1`
      request differ from each other yet stay reproducible.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    logprobs: int | None = None
    logits_processors: tuple[LogitsProcessorFactory, ...] = ()
    seed_offset: int = 0

    @property
    def seed(self) -> int | None:
        seed = self.params.seed
        return None if seed is None else (seed + self.seed_offset) % 2**64


@dataclass(frozen=True)
class Capabilities:
    """What an engine honours; a request needing more gets a 400 naming the field.

    The handler maps fields to flags: `seed` → `seed`, `logprobs`/`top_logprobs`
    → `logprobs` / `max_top_logprobs`, `response_format` json_* and anything
    else needing `GenerationSpec.logits_processors` → `logits_processors`,
    `repetition_penalty` ≠ 1 → `repetition_penalty`, `min_tokens` > 0 →
    `min_tokens`. Stop strings, stop_token_ids, ignore_eos, temperature,
    top_p, top_k, max_tokens and n (as n specs) work on every engine.
    """

    engine: EngineName
    seed: bool
    logprobs: bool
    max_top_logprobs: int
    logits_processors: bool
    repetition_penalty: bool
    min_tokens: bool

    def as_json(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "seed": self.seed,
            "logprobs": self.logprobs,
            "max_top_logprobs": self.max_top_logprobs,
            "logits_processors": self.logits_processors,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
        }


class Observer(Protocol):
    """Hooks run on the event loop as events arrive, whether or not anyone reads them."""

    def first_token(self) -> None: ...
    def tokens(self, count: int) -> None: ...
    def finished(self, outcome: Finished) -> None: ...


class GenerationFailed(Exception):
    """The engine failed this generation."""


class EngineClosed(Exception):
    """Shutdown has begun; no new generation starts."""


class Generation:
    """One running generation, seen from the event loop.

    The engine feeds it with `post` (from any thread) and ends it with exactly
    one `Finished` or exception; `done` resolves when the engine has let go of
    it (its slot is free). `cancel()` is idempotent and safe after the end.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        observer: Observer,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self._loop = loop
        self._observer = observer
        self._on_cancel = on_cancel
        self._events: asyncio.Queue[Delta | Finished | BaseException] = asyncio.Queue()
        self._seen_token = False
        self.cancel_flag = threading.Event()
        self.done: asyncio.Future[None] = loop.create_future()

    def cancel(self) -> None:
        """Stop after the current token; idempotent."""
        if self.cancel_flag.is_set():
            return
        self.cancel_flag.set()
        if self._on_cancel is not None:
            self._on_cancel()

    async def next_event(self) -> Delta | Finished:
        """The next delta, or the final `Finished`; raises `GenerationFailed`."""
        event = await self._events.get()
        if isinstance(event, BaseException):
            raise GenerationFailed(str(event) or type(event).__name__) from event
        return event

    def post(self, event: Delta | Finished | BaseException) -> None:
        """Hand an event to the loop; called from an engine thread."""
        try:
            self._loop.call_soon_threadsafe(self.deliver, event)
        except RuntimeError:
            self.cancel_flag.set()  # the loop is closed: nobody is listening any more

    def deliver(self, event: Delta | Finished | BaseException) -> None:
        """Hand an event over; on the event loop."""
        if isinstance(event, Delta) and event.tokens:
            if not self._seen_token:
                self._seen_token = True
                self._observer.first_token()
            self._observer.tokens(event.tokens)
        elif isinstance(event, Finished):
            self._observer.finished(event)
        self._events.put_nowait(event)


@dataclass
class Load:
    """What /metrics reports: the engine's own counts, not the HTTP layer's."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    extra: dict[str, float] = field(default_factory=dict)


class GenerationEngine(Protocol):
    """A model's generation engine, as the HTTP layer uses it."""

    @property
    def name(self) -> EngineName: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def max_running(self) -> int:
        """Generations it runs at once (the admission's slot count)."""
        ...

    @property
    def side_slots(self) -> int:
        """Slots of a side lane for what the main path cannot honour (0: none)."""
        ...

    def in_side_lane(self, spec: GenerationSpec) -> bool:
        """Whether `spec` runs in the side lane (it then takes a side-lane slot)."""
        ...

    def submit(self, spec: GenerationSpec, observer: Observer) -> Generation:
        """Start generating; the caller holds an admission slot. Raises `EngineClosed`."""
        ...

    async def tokenize(self, fn: Callable[[], T]) -> T:
        """Run a tokenizer call off the event loop."""
        ...

    def load(self) -> Load: ...

    def alive(self) -> bool:
        """False once it can start no generation any more (shutdown, or its loop died)."""
        ...

    def cancel_all(self) -> None:
        """Shutdown begins: stop running generations and refuse new ones."""
        ...

    async def close(self) -> None:
        """Cancel what runs, wait for it, release threads and device memory."""
        ...
