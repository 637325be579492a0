"""Model loading and the blocking `generate()` call.

Nothing here runs on the event loop: `Engine.load` runs before the server
starts, `render_chat`/`encode` on the tokenizer thread, `generate` on a
generation worker thread (see `workers`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from proxy.fallback.engines import cbsampler
from proxy.fallback.engines.interface import Delta, Finished, GenerationSpec, Outcome, TokenLogprob
from proxy.fallback.engines.tokentext import TokenText
from proxy.fallback.protocol import Message, SamplingParams

log = structlog.get_logger("brownout.fallback.engine")

__all__ = ["Delta", "Engine", "Finished", "ModelLoadError", "Outcome", "TokenText"]

# Most top_logprobs the threads engine computes (OpenAI allows 20).
MAX_TOP_LOGPROBS = 20


class ModelLoadError(Exception):
    """The model directory cannot be served; the message is one line for the operator."""


Emit = Callable[[Delta], None]


def _torch_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {', '.join(dtypes)}")
    return dtypes[name]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _id_set(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        return {v for v in value if isinstance(v, int)}
    return set()


class Engine:
    """A causal LM and its tokenizer, loaded from a local directory."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        path: Path,
        device: torch.device,
        max_position_embeddings: int,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self.path = path
        self.device = device
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = len(tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        # End of turn: what the model's generation config says, plus the tokenizer's eos.
        self.eos_token_ids = frozenset(
            _id_set(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
            | _id_set(tokenizer.eos_token_id)
        )
        pad = tokenizer.pad_token_id
        self._pad_token_id: int | None = (
            pad if pad is not None else min(self.eos_token_ids, default=None)
        )
        self._backend_decode = _backend_decode(tokenizer)

    @property
    def model(self) -> Any:
        """The loaded model (for an engine that drives it itself)."""
        return self._model

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    # --- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path, *, device: str, dtype: str) -> Engine:
        """Load from `path` only (no hub access), logging one line per stage."""
        started = time.monotonic()
        path = path.expanduser()
        if not path.exists():
            raise ModelLoadError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is not a directory")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; not a Hugging Face model directory")
        if device == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("--device cuda requested but CUDA is not available")
        torch_dtype = _torch_dtype(dtype)
        # tqdm bars on stderr would interleave with the JSON log lines.
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        log.info("model_load", stage="start", path=str(path), device=device, dtype=dtype)

        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {_first_line(exc)}") from exc
        max_pos = getattr(config, "max_position_embeddings", None)
        if not isinstance(max_pos, int) or max_pos < 1:
            raise ModelLoadError(f"{path}: config.json has no max_position_embeddings")
        log.info("model_load", stage="config", model_type=getattr(config, "model_type", None))

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer from {path}: {_first_line(exc)}") from exc
        log.info(
            "model_load",
            stage="tokenizer",
            vocab_size=len(tokenizer),
            chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )

        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, dtype=torch_dtype
            )
            model.to(torch.device(device))
            model.eval()
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load model weights from {path}: {_first_line(exc)}"
            ) from exc
        params = sum(p.numel() for p in model.parameters())
        log.info("model_load", stage="weights", parameters=params, device=device)

        engine = cls(
            model,
            tokenizer,
            path=path,
            device=torch.device(device),
            max_position_embeddings=max_pos,
        )
        try:
            engine._warmup()
        except Exception as exc:  # e.g. a dtype the device cannot compute in
            raise ModelLoadError(f"test generation failed for {path}: {_first_line(exc)}") from exc
        log.info("model_load", stage="ready", seconds=round(time.monotonic() - started, 3))
        return engine

    def _warmup(self) -> None:
        """One short generation so the first request does not pay lazy initialisation."""
        started = time.monotonic()
        ids = self.encode("Hello", add_special_tokens=True) or [min(self.eos_token_ids, default=0)]
        spec = GenerationSpec(tuple(ids), SamplingParams(temperature=0.0), 2)
        self.generate(spec, threading.Event(), lambda _: None)
        log.info("model_load", stage="warmup", seconds=round(time.monotonic() - started, 3))

    # --- tokenizer (tokenizer thread) ------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> str:
        """The chat template applied to `messages`; ValueError if the model has none."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self._tokenizer.apply_chat_template(
            [m.as_template_input() for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        # Twice per generated token (incremental detokenization): the Rust
        # tokenizer directly where it gives the same text, about 6x cheaper
        # than the Python wrapper, whose time a GPU batch's loop thread waits
        # for (the interpreter lock).
        fast = self._backend_decode
        if fast is not None:
            return str(fast(list(ids), skip_special_tokens=True))
        text = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return str(text)

    # --- generation (worker thread) --------------------------------------------------------

    def token_text(self, spec: GenerationSpec) -> TokenText:
        """A fresh token-to-text converter for one generation of `spec`."""
        return TokenText(
            self.decode,
            spec.prompt_ids,
            stops=spec.params.stop,
            stop_ids=self.eos_token_ids | set(spec.params.stop_token_ids),
            ignore_eos_ids=self.eos_token_ids if spec.params.ignore_eos else frozenset(),
            min_tokens=spec.params.min_tokens,
        )

    def generate(
        self,
        spec: GenerationSpec,
        cancel: threading.Event,
        emit: Emit,
        *,
        gumbel_seed: bool = False,
    ) -> Finished:
        """Generate up to `spec.max_tokens`, calling `emit` per token; blocks the calling thread.

        Returns when the model stops, a stop string or the limit is reached, or
        soon after `cancel` is set (checked after every token). `gumbel_seed`:
        a seeded request samples as the batched engine does (`cbsampler`), so
        the batched engine's side lane gives the same text for the same seed.
        """
        params, max_tokens = spec.params, spec.max_tokens
        text = self.token_text(spec)
        capture = _LogprobCapture(spec.logprobs) if spec.logprobs is not None else None
        sink = _TokenSink(text, capture, emit)
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=max_tokens,
            # min_tokens holds back the end tokens and stop_token_ids (as vLLM's).
            min_new_tokens=min(params.min_tokens, max_tokens),
            # Always greedy for transformers; sampling happens in `_SeededSampler`.
            # The neutral values keep the model's own generation_config defaults out.
            do_sample=False,
            temperature=1.0,
            top_p=1.0,
            top_k=50,
            repetition_penalty=params.repetition_penalty,
            # What ends the output; with ignore_eos the stop_token_ids only. An id past
            # int64 (torch overflows on it: a 500) is no token the model can produce.
            eos_token_id=sorted(i for i in text.stop_ids if i < 2**63),
            pad_token_id=self._pad_token_id,
        )
        processors = LogitsProcessorList()
        ignored = sorted(self.eos_token_ids - text.stop_ids) if params.ignore_eos else []
        if ignored:
            # ignore_eos: suppressing the model's end tokens is what vLLM's flag amounts
            # to; stop_token_ids still stop (min_new_tokens = max_tokens masked them too).
            processors.append(SuppressTokensLogitsProcessor(ignored, device=str(self.device)))
        if capture is not None:
            processors.append(capture)
        processors.extend(factory() for factory in spec.logits_processors)
        if params.temperature > 0:
            if gumbel_seed and spec.seed is not None:
                processors.append(_GumbelSampler(params, spec.seed))
            else:
                processors.append(_SeededSampler(params, spec.seed, self.device))
        input_ids = torch.tensor([list(spec.prompt_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self._model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_StopFlag(cancel, text)]),
                streamer=sink,
            )
        if text.stopped:
            return Finished("stop", text.count)
        if text.count >= max_tokens:
            return Finished("length", text.count)
        return Finished("abort" if cancel.is_set() else "stop", text.count)


class _LogprobCapture(LogitsProcessor):
    """First in the list: keeps the raw log-softmax of the step the streamer then reports."""

    def __init__(self, top: int) -> None:
        self._top = min(top, MAX_TOP_LOGPROBS)
        self._row: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._row = torch.log_softmax(scores[0].float(), dim=-1)
        return scores

    def take(self, token_id: int) -> TokenLogprob | None:
        row, self._row = self._row, None
        if row is None:
            return None
        top: tuple[tuple[int, float], ...] = ()
        if self._top > 0:
            values, ids = torch.topk(row, self._top)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token_id, float(row[token_id]), top)


class _TokenSink(BaseStreamer):
    """transformers streamer: token ids in (generation thread), `Delta`s out."""

    def __init__(self, text: TokenText, capture: _LogprobCapture | None, emit: Emit) -> None:
        self._text = text
        self._capture = capture
        self._emit = emit
        self._prompt_pending = True  # generate() first puts the whole prompt

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_pending:
            self._prompt_pending = False
            return
        for token_id in value.reshape(-1).tolist():
            logprob = None if self._capture is None else self._capture.take(int(token_id))
            delta = self._text.step(int(token_id), logprob)
            if delta is None:
                return
            self._emit(delta)

    def end(self) -> None:
        delta = self._text.finish()
        if delta is not None:
            self._emit(delta)


class _StopFlag(StoppingCriteria):
    """Stops generate() after the current token once cancelled or a stop string matched."""

    def __init__(self, cancel: threading.Event, text: TokenText) -> None:
        self._cancel = cancel
        self._text = text

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self._cancel.is_set() or self._text.stopped
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


class _GumbelSampler(LogitsProcessor):
    """Seeded sampling by `cbsampler`'s Gumbel-max hash: the batched engine's choice."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self._warpers = _warpers(params)
        self._seed = seed
        self._index = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self._warpers:
            scores = warper(input_ids, scores)
        key = cbsampler.row_key(self._seed, self._index)
        self._index += 1
        keys = torch.full((scores.shape[0],), key, dtype=torch.int64, device=scores.device)
        return cbsampler.gumbel_pick(scores, keys)


class _SeededSampler(LogitsProcessor):
    """Samples the next token with a per-request generator, then masks all others.

    transformers' own sampling draws from torch's global RNG, which every
    worker thread shares, so `seed` would not be reproducible under
    concurrency (and seeding it would race). Sampling here with a private
    `torch.Generator` and leaving a single finite logit makes the greedy
    step downstream pick exactly the sampled token.
    """

    def __init__(self, params: SamplingParams, seed: int | None, device: torch.device) -> None:
        self._warpers = _warpers(params)
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed % 2**64)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self._warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.multinomial(probs, num_samples=1, generator=self._generator)
        masked = torch.full_like(scores, float("-inf"))
        return masked.scatter_(1, chosen, 0.0)


def _backend_decode(tokenizer: Any) -> Callable[..., Any] | None:
    """The Rust tokenizer's `decode` when the Python wrapper's adds nothing to
    it: a fast tokenizer without `clean_up_tokenization_spaces` (the wrapper's
    only extra step for a list of ids)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    decode = getattr(backend, "decode", None)
    return decode if callable(decode) else None
