"""Token ids in, `Delta`s out: one generation's text, shared by both engines.

Pure and synchronous: the threads engine drives it on its generation thread,
the batched engine on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.fallback.engines.interface import Delta, TokenLogprob
from proxy.fallback.engines.textstream import IncrementalDecoder, StopMatcher


class TokenText:
    """Token ids in, `Delta`s out: detokenization, end tokens and stop strings.

    Pure and synchronous; one per generation, shared by both engines. After an
    end token or a stop string, `stopped` is set and later tokens are ignored.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_ids: Sequence[int],
        *,
        stops: Sequence[str],
        stop_ids: set[int] | frozenset[int],
        ignore_eos_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
    ) -> None:
        self._decoder = IncrementalDecoder(decode, prompt_ids)
        self._stops = StopMatcher(stops)
        # vLLM looks for stop strings only once the output is past min_tokens.
        self._min_tokens = min_tokens
        # ignore_eos: the model's end tokens are ordinary text; stop_token_ids still stop.
        self.stop_ids = frozenset(stop_ids) - ignore_eos_ids
        self.count = 0
        self.stopped = False  # an end token or a stop string ended the output

    def step(self, token_id: int, logprob: TokenLogprob | None = None) -> Delta | None:
        """The delta for one more token; None once stopped."""
        if self.stopped:
            return None  # tokens generated before the stop was seen
        self.count += 1
        lps = () if logprob is None else (logprob,)
        if token_id in self.stop_ids:
            # Like vLLM, the end token itself is not part of the text.
            self.stopped = True
            return Delta(self._flush(), 1, (token_id,), lps)
        text = self._decoder.push(token_id)
        if self.count > self._min_tokens:
            text = self._stops.push(text)
        if self._stops.matched is not None:
            self.stopped = True
        return Delta(text, 1, (token_id,), lps)

    def finish(self) -> Delta | None:
        """Held-back text once generation ended without a stop (None if nothing)."""
        if self.stopped:
            return None
        text = self._flush()
        return Delta(text, 0) if text else None

    def _flush(self) -> str:
        return self._stops.push(self._decoder.flush()) + self._stops.flush()
