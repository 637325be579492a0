"""Token ids in, text deltas out: incremental detokenization and stop strings.

Pure and synchronous; the generation thread drives both per token so the
event loop only ever receives finished text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

# Prompt tokens decoded along with the output so the first generated token gets
# the same leading-space/merge treatment it has in context (vLLM uses 5 too).
_CONTEXT_TOKENS = 5


class IncrementalDecoder:
    """Decodes a growing token sequence into text deltas.

    Decoding each token alone is wrong for tokenizers whose tokens are parts
    of a UTF-8 character or whose spacing depends on the neighbour, and
    decoding everything every step is quadratic. Like vLLM, decode a short
    window twice (with and without the new tokens) and emit the difference,
    holding back while the window ends in an incomplete character.
    """

    def __init__(self, decode: Decode, prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # end of what has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Cuts the output at the first stop string, which is itself not emitted.

    Text that could be the start of a stop string is held back until the
    next delta settles it, so a stop string split across tokens is still
    caught and never leaks to the client.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The part of `held + text` that is safe to emit; sets `matched` on a hit."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        hits = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            self._held = ""
            return buffer[:index]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held text once generation ended without completing a stop."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
