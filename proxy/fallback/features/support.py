"""What the API features need from the model's tokenizer, loaded once per server.

`ApiSupport` holds the chat template renderer (with `tools`, which the
engine's own `render_chat` does not take), the xgrammar state (`Structured`,
None when xgrammar is not installed), `logit_bias` and the token table for
logprobs. All use the tokenizer on the tokenizer thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from aiohttp import web
from transformers import AutoConfig, AutoTokenizer, LogitsProcessor

from proxy.fallback.api.errors import invalid, unsupported
from proxy.fallback.engines.interface import LogitsProcessorFactory
from proxy.fallback.features.grammarlane import LaneLimits
from proxy.fallback.protocol import Message, Output, Tool

if TYPE_CHECKING:
    from proxy.fallback.features.structured import Structured

log = structlog.get_logger("brownout.fallback.support")


class ChatTemplate:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.available = bool(getattr(tokenizer, "chat_template", None))

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> str:
        """The chat template applied; ValueError if the model has none."""
        if not self.available:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self._tokenizer.apply_chat_template(
            [m.as_template_input() for m in messages],
            tools=[t.as_template_input() for t in tools] or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: a fixed value added to some tokens' logits."""

    def __init__(self, bias: tuple[tuple[int, float], ...]) -> None:
        self._ids = [i for i, _ in bias]
        self._values = [v for _, v in bias]
        self._tensor: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self._values, dtype=scores.dtype, device=scores.device)
        scores[:, self._ids] += self._tensor
        return scores


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, over the generated tokens only (as vLLM)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self._prompt_len = prompt_len
        self._presence = presence
        self._frequency = frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self._prompt_len :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device)
        )
        return scores - self._frequency * counts - self._presence * (counts > 0).to(scores.dtype)


class TokenTable:
    """Token id → (text, raw bytes), for OpenAI's logprobs `token` and `bytes`."""

    def __init__(self, tokenizer: Any, token_bytes: Sequence[bytes] | None) -> None:
        self._tokenizer = tokenizer
        self._bytes = token_bytes

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        if self._bytes is not None:
            raw = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
            return raw.decode("utf-8", errors="replace"), raw
        text = str(self._tokenizer.decode([token_id]))  # without xgrammar: decoded text
        return text, text.encode()


def _load_structured(tokenizer: Any, vocab_size: int, limits: LaneLimits) -> Structured | None:
    try:
        from proxy.fallback.features.structured import Structured
    except ImportError:  # xgrammar is optional: without it, no constrained output
        log.warning("structured_output_unavailable", reason="xgrammar is not installed")
        return None
    return Structured(tokenizer, vocab_size, limits)


@dataclass(frozen=True)
class ApiSupport:
    template: ChatTemplate
    structured: Structured | None  # None: xgrammar missing
    token_text: TokenTable

    vocab_size: int
    #: Characters of the vocabulary's longest token (special ones included): no
    #: token covers more of a prompt's text (`parsing.check_prompt_size`).
    max_token_chars: int = 1

    @property
    def grammar(self) -> bool:
        return self.structured is not None

    def processors(self, output: Output, prompt_len: int) -> tuple[LogitsProcessorFactory, ...]:
        """Per-generation logits processors for `output` but the grammar; tokenizer thread."""
        factories: list[LogitsProcessorFactory] = []
        if output.has_penalties:
            factories.append(
                partial(Penalties, prompt_len, output.presence_penalty, output.frequency_penalty)
            )
        if output.logit_bias:
            too_big = [i for i, _ in output.logit_bias if i >= self.vocab_size]
            if too_big:
                raise invalid(
                    f"logit_bias token id {too_big[0]} is not below the vocabulary size "
                    f"{self.vocab_size}.",
                    "logit_bias",
                )
            factories.append(partial(LogitBias, output.logit_bias))
        return tuple(factories)

    async def compile_grammar(self, output: Output) -> tuple[LogitsProcessorFactory, ...]:
        """The grammar processor `output` needs (after the others), from the grammar lane.

        Raises the lane's `LaneFull` / `CompileTimeout` (the handler's 503s)."""
        if not output.needs_grammar:
            return ()
        if self.structured is None:
            raise unsupported("response_format", "Structured output needs xgrammar.")
        return await self.structured.compile(output)

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()

    @classmethod
    def load(cls, path: Path, grammar: LaneLimits | None = None) -> ApiSupport:
        """From the model directory (local files only); raises like `AutoTokenizer`.

        `grammar`: the grammar lane's bounds (default `LaneLimits()`)."""
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        # The logits can be wider than the tokenizer (padded embedding matrices).
        vocab_size = max(int(getattr(config, "vocab_size", 0) or 0), len(tokenizer))
        structured = _load_structured(tokenizer, vocab_size, grammar or LaneLimits())
        token_bytes = structured.token_bytes if structured is not None else None
        return cls(
            ChatTemplate(tokenizer),
            structured,
            TokenTable(tokenizer, token_bytes),
            vocab_size,
            longest_token(tokenizer),
        )


def longest_token(tokenizer: Any) -> int:
    """The most characters one token's string has: byte-level BPE spells each byte as
    one character, SentencePiece each character as one, so that bounds the prompt
    characters a token can cover either way."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


API_SUPPORT = web.AppKey("api_support", ApiSupport)
