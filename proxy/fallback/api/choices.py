"""The `n` choices of one request, run one after another inside one admission slot.

`Choices.next()` yields what the client may see of each choice in order:
content text (tool-call blocks held back and parsed at the end when tools
are offered), logprob entries (end tokens left out: their text is not part
of the answer either), and the choice's end with its finish reason. The
slot is released once the last generation has let go of the engine, or,
on `close()` before that, once the running one has stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from proxy.fallback.api.metrics import FallbackMetrics
from proxy.fallback.engines.interface import (
    Delta,
    Finished,
    Generation,
    GenerationEngine,
    GenerationSpec,
    TokenLogprob,
)
from proxy.fallback.features.tools import ToolCallSplitter
from proxy.fallback.protocol import FinishReason, ToolCall, ToolUse


@dataclass(frozen=True)
class ChoiceOutput:
    index: int
    text: str  # content to send now (may be empty)
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: Finished | None = None  # set on the choice's last output
    reason: FinishReason | None = None  # with `finished`: None when aborted
    tool_calls: tuple[ToolCall, ...] = ()
    content_if_calls: str | None = None  # the content of a whole answer that made calls


class _Observer:
    """Metrics of one generation, recorded on the loop even if the client left."""

    def __init__(self, metrics: FallbackMetrics, arrived: float) -> None:
        self._metrics = metrics
        self._arrived = arrived

    def first_token(self) -> None:
        self._metrics.ttft.observe(time.monotonic() - self._arrived)

    def tokens(self, count: int) -> None:
        self._metrics.generation_tokens.inc(count)

    def finished(self, outcome: Finished) -> None:
        self._metrics.finished(outcome.reason)
        self._metrics.e2e_latency.observe(time.monotonic() - self._arrived)


class Choices:
    def __init__(
        self,
        engine: GenerationEngine,
        specs: Sequence[GenerationSpec],
        metrics: FallbackMetrics,
        arrived: float,
        *,
        release: Callable[[], None],
        tool_use: ToolUse,
        hidden_ids: Collection[int],
    ) -> None:
        self._engine = engine
        self._specs = specs
        self._observer = _Observer(metrics, arrived)
        self._release = release
        self._tool_use = tool_use
        self._hidden = frozenset(hidden_ids)
        self._index = 0
        self._gen: Generation | None = None
        self._ended = False  # the current generation sent its Finished
        self._splitter: ToolCallSplitter | None = None
        self._closed = False

    def _submit(self) -> None:
        self._gen = self._engine.submit(self._specs[self._index], self._observer)
        self._ended = False
        self._splitter = ToolCallSplitter() if self._tool_use.active else None

    def start(self) -> None:
        """Submit the first choice; raises `EngineClosed` during shutdown."""
        self._submit()

    async def next(self) -> ChoiceOutput | None:
        """The next output, None after the last choice; raises `GenerationFailed`."""
        while True:
            gen = self._gen
            if gen is None:
                return None
            if self._ended:
                # Cancellation-safe: a keepalive timeout here must not cancel `done`.
                await asyncio.wait([gen.done])
                self._index += 1
                if self._index >= len(self._specs):
                    self._gen = None
                    return None
                self._submit()
                continue
            event = await gen.next_event()
            if isinstance(event, Delta):
                return self._delta(event)
            self._ended = True
            return self._finish(event)

    def _delta(self, event: Delta) -> ChoiceOutput:
        text = event.text if self._splitter is None else self._splitter.push(event.text)
        logprobs = tuple(lp for lp in event.logprobs if lp.token_id not in self._hidden)
        return ChoiceOutput(self._index, text, logprobs)

    def _finish(self, event: Finished) -> ChoiceOutput:
        if event.reason == "abort":
            return ChoiceOutput(self._index, "", finished=event)
        reason: FinishReason = event.reason
        if self._splitter is None:
            return ChoiceOutput(self._index, "", finished=event, reason=reason)
        cut = event.reason == "length"
        rest, calls, content = self._splitter.finish(self._tool_use, cut=cut)
        forced_and_cut = cut and self._tool_use.constrained
        if calls and not forced_and_cut:
            reason = "tool_calls"
        return ChoiceOutput(
            self._index,
            rest,
            finished=event,
            reason=reason,
            tool_calls=calls,
            content_if_calls=content,
        )

    def close(self) -> None:
        """Stop what runs; the slot is released once the engine has let go of it."""
        if self._closed:
            return
        self._closed = True
        gen = self._gen
        if gen is None or gen.done.done():
            self._release()
            return
        gen.cancel()
        gen.done.add_done_callback(lambda _: self._release())
