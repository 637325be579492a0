"""Model loading and the blocking `generate()` call.

Nothing here runs on the event loop: `Engine.load` runs before the server
starts, `render_chat`/`encode` on the tokenizer thread, `generate` on a
generation worker thread (see `workers`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from proxy.fallback.protocol import Message, SamplingParams
from proxy.fallback.textstream import IncrementalDecoder, StopMatcher

log = structlog.get_logger("brownout.fallback.engine")

Outcome = Literal["stop", "length", "abort"]


class ModelLoadError(Exception):
    """The model directory cannot be served; the message is one line for the operator."""


@dataclass(frozen=True)
class Delta:
    """Text produced by `tokens` newly generated tokens (text may be empty: held back)."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Finished:
    reason: Outcome
    completion_tokens: int


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
        self.generate(ids, SamplingParams(temperature=0.0), 2, threading.Event(), lambda _: None)
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
        text = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return str(text)

    # --- generation (worker thread) --------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        cancel: threading.Event,
        emit: Emit,
    ) -> Finished:
        """Generate up to `max_tokens`, calling `emit` per token; blocks the calling thread.

        Returns when the model stops, a stop string or the limit is reached, or
        soon after `cancel` is set (checked after every token).
        """
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)
        sink = _TokenSink(
            decoder=IncrementalDecoder(self.decode, prompt_ids),
            stops=StopMatcher(params.stop),
            stop_ids=stop_ids,
            emit=emit,
        )
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=max_tokens,
            # ignore_eos: suppressing the end tokens is what vLLM's flag amounts to.
            min_new_tokens=max_tokens if params.ignore_eos else min(params.min_tokens, max_tokens),
            # Always greedy for transformers; sampling happens in `_SeededSampler`.
            # The neutral values keep the model's own generation_config defaults out.
            do_sample=False,
            temperature=1.0,
            top_p=1.0,
            top_k=50,
            repetition_penalty=params.repetition_penalty,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self._pad_token_id,
        )
        processors = LogitsProcessorList()
        if params.temperature > 0:
            processors.append(_SeededSampler(params, self.device))
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self._model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_StopFlag(cancel, sink)]),
                streamer=sink,
            )
        if sink.stopped:
            return Finished("stop", sink.count)
        if sink.count >= max_tokens:
            return Finished("length", sink.count)
        return Finished("abort" if cancel.is_set() else "stop", sink.count)


class _TokenSink(BaseStreamer):
    """transformers streamer: token ids in (generation thread), `Delta`s out."""

    def __init__(
        self,
        *,
        decoder: IncrementalDecoder,
        stops: StopMatcher,
        stop_ids: set[int] | frozenset[int],
        emit: Emit,
    ) -> None:
        self._decoder = decoder
        self._stops = stops
        self._stop_ids = stop_ids
        self._emit = emit
        self._prompt_pending = True  # generate() first puts the whole prompt
        self.count = 0
        self.stopped = False  # an end token or a stop string ended the output

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_pending:
            self._prompt_pending = False
            return
        for token_id in value.reshape(-1).tolist():
            if self.stopped:
                return  # tokens generated before the stop flag was seen
            self._step(int(token_id))

    def _step(self, token_id: int) -> None:
        self.count += 1
        if token_id in self._stop_ids:
            # Like vLLM, the end token itself is not part of the text.
            self.stopped = True
            self._emit(Delta(self._flush(), 1))
            return
        text = self._stops.push(self._decoder.push(token_id))
        if self._stops.matched is not None:
            self.stopped = True
        self._emit(Delta(text, 1))

    def _flush(self) -> str:
        return self._stops.push(self._decoder.flush()) + self._stops.flush()

    def end(self) -> None:
        if not self.stopped:
            text = self._flush()
            if text:
                self._emit(Delta(text, 0))


class _StopFlag(StoppingCriteria):
    """Stops generate() after the current token once cancelled or a stop string matched."""

    def __init__(self, cancel: threading.Event, sink: _TokenSink) -> None:
        self._cancel = cancel
        self._sink = sink

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        stop = self._cancel.is_set() or self._sink.stopped
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _SeededSampler(LogitsProcessor):
    """Samples the next token with a per-request generator, then masks all others.

    transformers' own sampling draws from torch's global RNG, which every
    worker thread shares, so `seed` would not be reproducible under
    concurrency (and seeding it would race). Sampling here with a private
    `torch.Generator` and leaving a single finite logit makes the greedy
    step downstream pick exactly the sampled token.
    """

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self._warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k > 0:
            self._warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self._warpers.append(TopPLogitsWarper(params.top_p))
        self._generator = torch.Generator(device=device)
        if params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(params.seed % 2**64)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self._warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.multinomial(probs, num_samples=1, generator=self._generator)
        masked = torch.full_like(scores, float("-inf"))
        return masked.scatter_(1, chosen, 0.0)
