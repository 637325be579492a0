"""Token-aware trimming of a chat prompt to the backend's context window.

Public API::

    budget_tokens(max_model_len, max_tokens, *, margin_tokens, default_max_tokens) -> int
    await trim(messages, budget, counter, *, high_water, low_water) -> TrimResult

    TokenCounter            protocol: count_messages() / count_prompt() / is_estimate
      HFTokenCounter        local Hugging Face tokenizer + chat template (exact)
      RemoteTokenCounter    the backend's vLLM-style POST /tokenize (exact)
      EstimateTokenCounter  chars/3 + per-message overhead (is_estimate = True)

Exceptions::

    ContextTooLong    system prompt + current question alone exceed the budget
                      (→ 400 context_length_exceeded)
    TokenCountError   a counter failed (tokenizer or /tokenize unreachable)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

from proxy.policy import TrimPolicy

__all__ = [
    "ContextTooLong",
    "EstimateTokenCounter",
    "HFTokenCounter",
    "Message",
    "RemoteTokenCounter",
    "TokenCountError",
    "TokenCounter",
    "TrimPolicy",
    "TrimResult",
    "budget_tokens",
    "trim",
]

Message = Mapping[str, Any]
T = TypeVar("T")

# Roles kept at the front of the prompt whatever the budget.
_HEAD_ROLES = frozenset({"system", "developer"})


# --------------------------------------------------------------------------- errors


class ContextTooLong(Exception):
    """The parts that are never dropped (system prompt + current question) exceed the budget."""

    def __init__(
        self, prompt_tokens: int, budget_tokens: int, messages: Sequence[Message] = ()
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.budget_tokens = budget_tokens
        # What is left after dropping every turn (system prompt + question).
        self.messages = list(messages)
        super().__init__(
            f"the prompt needs {prompt_tokens} tokens without any history, "
            f"but only {budget_tokens} fit in the context window"
        )


class TokenCountError(Exception):
    """A token counter could not count (tokenizer failure, /tokenize unreachable or invalid)."""


# --------------------------------------------------------------------------- budget


def budget_tokens(
    max_model_len: int,
    max_tokens: int | None,
    *,
    margin_tokens: int,
    default_max_tokens: int,
) -> int:
    """Prompt tokens allowed: max_model_len − requested max_tokens − margin (may be ≤ 0)."""
    answer = default_max_tokens if max_tokens is None else max_tokens
    return max_model_len - answer - margin_tokens


# --------------------------------------------------------------------------- counters


class TokenCounter(Protocol):
    """Counts chat prompts the way the backend will see them.

    `count_messages` gives each message's tokens rendered alone by the chat
    template (no generation prompt); `count_prompt` the whole prompt with the
    generation prompt. `trim` needs one of each per request (plus one
    `count_prompt` when it drops turns), never one call per prefix.
    """

    @property
    def is_estimate(self) -> bool:
        """True when counts are approximations (the caller counts a warning metric)."""
        ...

    async def count_messages(self, messages: Sequence[Message]) -> list[int]: ...

    async def count_prompt(self, messages: Sequence[Message]) -> int: ...


def _plain(m: Message) -> dict[str, Any]:
    return {"role": m.get("role", "user"), "content": m.get("content") or ""}


def _content_chars(m: Message) -> int:
    content = m.get("content")
    if isinstance(content, str):
        return len(content)
    if content is None:
        return 0
    # Content parts or anything else: its JSON length bounds the text length.
    return len(json.dumps(content, ensure_ascii=False))


class EstimateTokenCounter:
    """chars/3 + a fixed overhead per message: errs on the large side for real text."""

    def __init__(
        self, *, chars_per_token: float = 3.0, per_message: int = 8, per_prompt: int = 8
    ) -> None:
        self._chars_per_token = chars_per_token
        self._per_message = per_message
        self._per_prompt = per_prompt

    @property
    def is_estimate(self) -> bool:
        return True

    def one(self, m: Message) -> int:
        role = str(m.get("role", ""))
        chars = _content_chars(m) + len(role)
        return math.ceil(chars / self._chars_per_token) + self._per_message

    async def count_messages(self, messages: Sequence[Message]) -> list[int]:
        return [self.one(m) for m in messages]

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return sum(self.one(m) for m in messages) + self._per_prompt


class _CountCache:
    """Bounded LRU of per-message counts: a session's history repeats every request."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    @staticmethod
    def key(m: Message) -> bytes:
        raw = json.dumps(_plain(m), sort_keys=True, ensure_ascii=False).encode()
        return hashlib.blake2b(raw, digest_size=16).digest()

    async def counts(
        self,
        messages: Sequence[Message],
        compute: Callable[[list[Message]], Awaitable[list[int]]],
        *,
        limit: int | None = None,
        estimate: Callable[[Message], int] | None = None,
    ) -> list[int]:
        """Counts of `messages`, calling `compute` once for the ones not cached.

        With `limit`, only the newest `limit` uncached messages are computed;
        older ones get `estimate` (not cached: a later request counts them)."""
        keys = [self.key(m) for m in messages]
        missing = {k: m for k, m in zip(keys, messages, strict=True) if k not in self._counts}
        guessed: dict[bytes, int] = {}
        if missing:
            items = list(missing.items())
            if limit is not None and estimate is not None and len(items) > limit:
                cut = len(items) - limit
                guessed = {k: estimate(m) for k, m in items[:cut]}
                items = items[cut:]
            computed = await compute([m for _, m in items])
            self._counts.update(zip((k for k, _ in items), computed, strict=True))
        out = []
        counts = self._counts
        for k in keys:
            if k in guessed:
                out.append(guessed[k])
                continue
            out.append(counts[k])
            counts.move_to_end(k)
        while len(self._counts) > self._size:
            self._counts.popitem(last=False)
        return out


class HFTokenCounter:
    """Exact counts with a local Hugging Face tokenizer and its chat template.

    Build it with `await HFTokenCounter.load(path)` at start-up (loading takes
    about a second and reads files, so it runs in a thread). Counting runs
    inline for short prompts and in a worker thread above `thread_min_chars`,
    where the tokenizer releases the GIL, so a long history does not stall the
    event loop. Per-message counts are cached.
    """

    def __init__(
        self, tokenizer: Any, *, thread_min_chars: int = 4096, cache_size: int = 4096
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TokenCountError("the tokenizer has no chat template")
        self._tok = tokenizer
        # The raw `tokenizers.Tokenizer`: its encode_batch releases the GIL and
        # is safe to share between threads (the transformers wrapper's __call__
        # mutates padding/truncation state; its encode holds the GIL).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._thread_min_chars = thread_min_chars
        self._cache = _CountCache(cache_size)

    @classmethod
    async def load(cls, path: str | Path, *, thread_min_chars: int = 4096) -> HFTokenCounter:
        def _load() -> Any:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)

        try:
            tokenizer = await asyncio.to_thread(_load)
        except (OSError, ValueError) as exc:
            raise TokenCountError(f"cannot load the tokenizer from {path}: {exc}") from exc
        return cls(tokenizer, thread_min_chars=thread_min_chars)

    @property
    def is_estimate(self) -> bool:
        return False

    def _lengths(self, texts: list[str]) -> list[int]:
        # The template already holds the special tokens (BOS, role markers).
        if self._backend is not None:
            return [len(e.ids) for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [len(self._tok.encode(t, add_special_tokens=False)) for t in texts]

    def _messages_sync(self, messages: list[Message]) -> list[int]:
        # One batched render: each message as a conversation of its own.
        texts = self._tok.apply_chat_template(
            [[_plain(m)] for m in messages], tokenize=False, add_generation_prompt=False
        )
        return self._lengths([str(t) for t in texts])

    def _prompt_sync(self, messages: Sequence[Message]) -> int:
        text = self._tok.apply_chat_template(
            [_plain(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return self._lengths([str(text)])[0]

    async def _run(self, fn: Callable[[list[Message]], T], messages: Sequence[Message]) -> T:
        batch = list(messages)
        try:
            if sum(_content_chars(m) for m in batch) < self._thread_min_chars:
                return fn(batch)
            return await asyncio.to_thread(fn, batch)
        except Exception as exc:  # jinja TemplateError, tokenizer errors
            raise TokenCountError(f"tokenizer failed: {exc}") from exc

    async def count_messages(self, messages: Sequence[Message]) -> list[int]:
        async def compute(missing: list[Message]) -> list[int]:
            return await self._run(self._messages_sync, missing)

        return await self._cache.counts(messages, compute)

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return await self._run(self._prompt_sync, messages)


class RemoteTokenCounter:
    """Counts with the backend's `/tokenize` endpoint (vLLM request/response shape).

    POST {base_url}/tokenize {"model", "messages", "add_generation_prompt"} →
    {"count", "max_model_len", "tokens"}. Per-message counts are cached (a
    session's history is the same from one request to the next, so only new
    messages cost a call) and fetched concurrently, `max_parallel` at a time.
    At most `max_calls` messages are counted per request (the newest: the
    ones a trim keeps); older uncached ones are estimated, so a request of
    100,000 messages costs a bounded few calls. The kept prompt's own count
    (`count_prompt`) is always exact.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 2.0,
        max_parallel: int = 8,
        cache_size: int = 4096,
        max_calls: int = 16,
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._parallel = asyncio.Semaphore(max_parallel)
        self._cache = _CountCache(cache_size)
        self._max_calls = max_calls
        self._estimate = EstimateTokenCounter()
        self.max_model_len: int | None = None  # as reported by the last answer

    @property
    def is_estimate(self) -> bool:
        return False

    async def _tokenize(self, messages: Sequence[Message], generation_prompt: bool) -> int:
        body = {
            "model": self._model,
            "messages": [_plain(m) for m in messages],
            "add_generation_prompt": generation_prompt,
        }
        try:
            async with (
                self._parallel,
                self._session.post(
                    self._url, json=body, timeout=self._timeout, allow_redirects=False
                ) as resp,
            ):
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise TokenCountError(f"/tokenize answered {resp.status}: {text}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TokenCountError(f"/tokenize failed: {exc!r}") from exc
        count = data.get("count") if isinstance(data, dict) else None
        if not isinstance(count, int):
            raise TokenCountError("/tokenize answer has no integer 'count'")
        mml = data.get("max_model_len")
        if isinstance(mml, int):
            self.max_model_len = mml
        return count

    async def count_messages(self, messages: Sequence[Message]) -> list[int]:
        async def compute(missing: list[Message]) -> list[int]:
            return list(await asyncio.gather(*(self._tokenize([m], False) for m in missing)))

        return await self._cache.counts(
            messages, compute, limit=self._max_calls, estimate=self._estimate.one
        )

    async def count_prompt(self, messages: Sequence[Message]) -> int:
        return await self._tokenize(messages, True)


# --------------------------------------------------------------------------- trimming


@dataclass(frozen=True, slots=True)
class TrimResult:
    messages: list[Message]  # what to send: the same message objects, oldest turns removed
    prompt_tokens: int  # the counter's count of `messages` (with the generation prompt)
    budget_tokens: int
    dropped_turns: int
    dropped_messages: int
    estimated: bool  # counts came from EstimateTokenCounter-like counters

    @property
    def trimmed(self) -> bool:
        return self.dropped_messages > 0


def _split(messages: Sequence[Message]) -> tuple[int, int, list[tuple[int, int]]]:
    """(end of the head, start of the tail, [start, end) of each droppable turn).

    Head = leading system/developer messages. Tail = the last user message and
    whatever follows it (e.g. a partial assistant answer being continued).
    Between them, a turn starts at each user message; anything before the
    first one forms its own group, dropped first.
    """
    n = len(messages)
    head = 0
    while head < n and messages[head].get("role") in _HEAD_ROLES:
        head += 1
    tail = n
    for i in range(n - 1, head - 1, -1):
        if messages[i].get("role") == "user":
            tail = i
            break
    else:
        tail = head  # no user message after the head: nothing is droppable
    starts = [i for i in range(head, tail) if messages[i].get("role") == "user"]
    if not starts or starts[0] != head:
        starts.insert(0, head)
    groups = [(s, e) for s, e in zip(starts, [*starts[1:], tail], strict=True) if s < e]
    return head, tail, groups


# Exact recounts of the kept prompt after the first, at most (each is a
# tokenizer call or a /tokenize round trip).
_MAX_RECOUNTS = 3


def _replay_cut(
    fixed: int,
    turn_tokens: Sequence[int],
    question_tokens: Sequence[int],
    current: int,
    high: float,
    low: float,
) -> int:
    """Number of oldest turns to drop, by replaying block trimming over the session.

    Request i of the session sent turns[0:i] plus its question (the user
    message of turn i); the current request sends all turns plus `current`.
    Replaying the high/low-water rule over those requests finds the cut the
    previous requests used, so the cut only moves when a new block is dropped.
    """
    cut = 0
    kept = 0  # tokens of turns[cut:i]
    steps = [*question_tokens, current]
    for i, question in enumerate(steps):
        size = fixed + kept + question
        if size > high:
            while cut < i and size > low:
                size -= turn_tokens[cut]
                kept -= turn_tokens[cut]
                cut += 1
        if i < len(turn_tokens):
            kept += turn_tokens[i]
    return cut


async def trim(
    messages: Sequence[Message],
    budget_tokens: int,
    counter: TokenCounter,
    *,
    high_water: float,
    low_water: float,
) -> TrimResult:
    """Fit `messages` into `budget_tokens`, dropping the oldest turns first.

    The system prompt(s) at the front and the current question (the last user
    message, plus anything after it) are always kept; whole turns (a user
    message and the answers that follow it) are dropped from the oldest.

    Block trimming, for vLLM's prefix cache: a sliding window that drops just
    enough every request changes the start of the prompt on every request of
    a long session, so the engine re-computes the whole prompt each time.
    Instead nothing is dropped while the prompt fits in `high_water × budget`;
    when it no longer does, the oldest turns are dropped in one block until it
    fits in `low_water × budget`. The following requests then extend the same
    prefix (cache hits) until the prompt grows past the high-water mark again.
    No state is kept between requests: the cut is found by replaying the rule
    over the earlier requests of the session, which are the prefixes of this
    one's history, so each request finds the same cut its predecessor used.

    Counter calls: `count_messages` once and `count_prompt` once (twice when
    turns are dropped: the kept prompt is counted exactly), plus a recount
    only when the per-message sums under-estimated the kept prompt (chat
    templates that add text once per prompt, e.g. a default system prompt) —
    at most three; the third keeps only the head and the question.
    The result always fits in `budget_tokens` by the counter's count.

    Raises ContextTooLong when the kept parts alone exceed the budget, and
    TokenCountError when the counter fails.
    """
    if not 0.0 < low_water < high_water <= 1.0:
        raise ValueError("need 0 < low_water < high_water <= 1")
    msgs = list(messages)
    head, tail, groups = _split(msgs)
    per = await counter.count_messages(msgs)
    total = await counter.count_prompt(msgs)
    # Template text not attributed to any message (mostly the generation prompt).
    overhead = total - sum(per)

    fixed = overhead + sum(per[:head])
    turn_tokens = [sum(per[s:e]) for s, e in groups]
    # The question of an earlier request = the first message of its turn.
    question_tokens = [per[s] for s, _ in groups]
    current = sum(per[tail:])
    cut = _replay_cut(
        fixed,
        turn_tokens,
        question_tokens,
        current,
        high_water * budget_tokens,
        low_water * budget_tokens,
    )

    def assemble(n_dropped: int) -> list[Message]:
        keep_from = groups[n_dropped][0] if n_dropped < len(groups) else tail
        return msgs[:head] + msgs[keep_from:]

    kept = msgs if cut == 0 else assemble(cut)
    tokens = total if cut == 0 else await counter.count_prompt(kept)
    # The per-message estimate can be short of the real count: drop enough
    # further turns to cover the excess and count again (rare; see docstring).
    recounts = 0
    while tokens > budget_tokens:
        if cut >= len(groups):
            raise ContextTooLong(tokens, budget_tokens, kept)
        freed = 0
        while cut < len(groups) and freed < tokens - budget_tokens:
            freed += turn_tokens[cut]
            cut += 1
        recounts += 1
        if recounts >= _MAX_RECOUNTS:
            cut = len(groups)  # the estimates are far off: keep only what must stay
        kept = assemble(cut)
        tokens = await counter.count_prompt(kept)
    return TrimResult(
        messages=kept,
        prompt_tokens=tokens,
        budget_tokens=budget_tokens,
        dropped_turns=cut,
        dropped_messages=len(msgs) - len(kept),
        estimated=counter.is_estimate,
    )
