"""Token counters: how many tokens a chat prompt costs the backend.

Public API::

    TokenCounter            protocol: count_messages() / count_prompt() / is_estimate
      HFTokenCounter        local Hugging Face tokenizer + chat template (exact)
      RemoteTokenCounter    the backend's vLLM-style POST /tokenize (exact)
      EstimateTokenCounter  chars/3 + per-message overhead (is_estimate = True)

    TokenCountError         a counter failed (tokenizer or /tokenize unreachable)

`proxy.sessions.trim` uses them to fit a prompt into the context window.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

__all__ = [
    "EstimateTokenCounter",
    "HFTokenCounter",
    "Message",
    "RemoteTokenCounter",
    "TokenCountError",
    "TokenCounter",
]

Message = Mapping[str, Any]
T = TypeVar("T")


class TokenCountError(Exception):
    """A token counter could not count (tokenizer failure, /tokenize unreachable or invalid)."""


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
