"""The batched engine: Transformers' own continuous batching behind the engine interface.

One `ContinuousBatchingManager` (from `model.init_continuous_batching`) runs
its generation loop on its own thread and batches every running request into
each forward pass over a paged KV cache. Each request is added with its own
`max_new_tokens`, end tokens and sampling kwargs (temperature, top_k, top_p:
the library's per-request processors; seed: `cbsampler`), streamed through
`register_result_handler` (outputs arrive on the event loop) and cancelled
with `cancel_request`.

Text is made on the event loop from the token ids (`TokenText`: incremental
detokenization, end tokens, stop strings); a stop string cancels the request
in the library. Greedy requests sample at a temperature of 1e-6 (all
probability on the argmax: the library's sampling flag is per manager, not
per request).

What continuous batching cannot honour runs in a side lane (design (2)):
logprobs/top_logprobs, response_format json_object/json_schema, forced tool
calls, logit_bias, presence/frequency penalties, repetition_penalty and
min_tokens. Such a request runs on a small pool of thread-per-slot
`model.generate()` calls (`workers.ThreadEngine`, `--side-slots`, default 2)
on the same model, inside the same admission slots and /metrics counts
(`vllm:num_requests_running`: generating in either lane; `..._waiting`: also
those queued for a side thread), cancelled the same way (one still waiting
for a thread ends at once). Seeded requests in the side lane sample with
`cbsampler`'s hash: reproducible there, and mostly the batch's text for the
same seed (not always: the two forward passes round differently).
The side lane's KV (Transformers' dynamic cache) is outside the batch's
paged budget; on CUDA the planned budget leaves half the free memory.

Why not in-batch: the library's per-request processors get one int32 per
row and a `prepare_tensor_args` call on the host, which would do for a
grammar bitmask held aside, but on CUDA (graphs on) the manager runs
asynchronously: batch N+1 is prepared before batch N's tokens are back, so
a host-side xgrammar matcher cannot know the token its next mask follows.
Its `return_logprobs` gives only the chosen token's log-probability after
the warpers (no raw logprobs, no top_logprobs). And logit_bias/penalties are
per-request Transformers processors, which it does not take. With
`--side-slots 0` those fields are a 400 naming them and are advertised off
(`Capabilities`); the side lane is also off when the library switched the
model to a paged-only attention (`paged|eager`), which plain `generate()`
cannot use.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import structlog
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from proxy.fallback.engines import cbsampler
from proxy.fallback.engines.engine import MAX_TOP_LOGPROBS, Engine
from proxy.fallback.engines.interface import (
    Capabilities,
    Delta,
    EngineClosed,
    EngineName,
    Finished,
    Generation,
    GenerationSpec,
    Load,
    Observer,
    Outcome,
)
from proxy.fallback.engines.tokentext import TokenText
from proxy.fallback.engines.workers import ThreadEngine, TokenizerPool

log = structlog.get_logger("brownout.fallback.batched")

T = TypeVar("T")

GREEDY_TEMPERATURE = 1e-6
# The library's default page: tokens per KV block.
PAGE_SIZE = 256


def capabilities(*, seed: bool, side_lane: bool) -> Capabilities:
    """In the batch: seed (`cbsampler`); with a side lane: everything the threads engine does."""
    return Capabilities(
        engine="batched",
        seed=seed or side_lane,
        logprobs=side_lane,
        max_top_logprobs=MAX_TOP_LOGPROBS if side_lane else 0,
        logits_processors=side_lane,
        repetition_penalty=side_lane,
        min_tokens=side_lane,
    )


#: What the batch itself honours (the side lane takes whatever needs more).
IN_BATCH = capabilities(seed=True, side_lane=False)


def unsupported_fields(spec: GenerationSpec, caps: Capabilities) -> list[str]:
    """Request fields of `spec` that `caps` cannot honour (the handler's 400 names them)."""
    params = spec.params
    fields = []
    if spec.logprobs is not None and not caps.logprobs:
        fields.append("logprobs")
    if spec.logits_processors and not caps.logits_processors:
        fields.append("response_format")
    if params.repetition_penalty != 1.0 and not caps.repetition_penalty:
        fields.append("repetition_penalty")
    if params.min_tokens > 0 and not caps.min_tokens:
        fields.append("min_tokens")
    if params.seed is not None and params.temperature > 0 and not caps.seed:
        fields.append("seed")
    return fields


def side_lane_usable(model: Any) -> bool:
    """Plain `generate()` works with the attention the manager left the model on."""
    implementation = str(getattr(model.config, "_attn_implementation", "") or "")
    return not implementation.startswith("paged")


@dataclass
class _Request:
    request_id: str
    generation: Generation
    text: TokenText
    max_tokens: int
    seen: int = 0
    over: bool = False
    pending: list[Delta] = field(default_factory=list)


class BatchedEngine:
    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int,
        kv_tokens: int | None,
        max_model_len: int,
        max_batch_tokens: int | None = None,
        use_cuda_graph: bool | None = None,
        side_slots: int = 2,
    ) -> None:
        """`side_slots`: threads of the side lane (0: no side lane, see the module doc)."""
        self._engine = engine
        self._max_running = max_running
        self._max_model_len = max_model_len
        self._tokenizer = TokenizerPool()
        self._ids = itertools.count()
        self._active: dict[str, _Request] = {}
        self._closing = False
        vocab = engine.vocab_size
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            # Sampling on, with each warper present so that per-request values apply;
            # every request sends its own temperature, top_k and top_p.
            do_sample=True,
            temperature=0.5,
            top_k=vocab,
            top_p=0.9999,
            max_new_tokens=max_model_len,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=engine.pad_token_id,
        )
        cb_config = ContinuousBatchingConfig(
            per_request_processors=True,
            max_requests_per_batch=max_running,
            num_blocks=None if kv_tokens is None else max(1, math.ceil(kv_tokens / PAGE_SIZE)),
            page_size=PAGE_SIZE,
            max_batch_tokens=max_batch_tokens,
            use_cuda_graph=use_cuda_graph,
        )
        # The library logs its sizing decisions at INFO in its own plain-text format,
        # between the server's JSON lines; warnings and errors still show.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
        model = engine.model
        self._manager: Any = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        self._sampler = cbsampler.install(self._manager.logit_processor)
        self._batch_caps = replace(IN_BATCH, seed=self._sampler is not None)
        with torch.inference_mode():
            self._manager.warmup()
            self._manager.start()  # the loop thread inherits inference mode
        self._side: ThreadEngine | None = None
        if side_slots > 0 and side_lane_usable(model):
            self._side = ThreadEngine(
                engine, side_slots, gumbel_seed=True, thread_name_prefix="side"
            )
        self._capabilities = capabilities(
            seed=self._sampler is not None, side_lane=self._side is not None
        )
        log.info(
            "batched_engine",
            max_running=max_running,
            kv_tokens=kv_tokens,
            seeded_sampling=self._sampler is not None,
            side_slots=side_slots if self._side is not None else 0,
            attention=str(getattr(model.config, "_attn_implementation", "")),
        )

    # --- the interface ----------------------------------------------------------------------

    @property
    def name(self) -> EngineName:
        return "batched"

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def max_running(self) -> int:
        return self._max_running

    async def tokenize(self, fn: Callable[[], T]) -> T:
        return await self._tokenizer.run(fn)

    def load(self) -> Load:
        waiting = self._engine_waiting()
        side = Load() if self._side is None else self._side.load()
        return Load(
            running=max(len(self._active) - waiting, 0) + side.running,
            waiting=waiting + side.waiting,
            kv_cache_usage=self._kv_usage(),
        )

    def alive(self) -> bool:
        """The library's loop thread ends on any error in a generation step, for good."""
        return not self._closing and bool(self._manager.is_running())

    @property
    def side_slots(self) -> int:
        return 0 if self._side is None else self._side.max_running

    def in_side_lane(self, spec: GenerationSpec) -> bool:
        return self._side is not None and bool(unsupported_fields(spec, self._batch_caps))

    def submit(self, spec: GenerationSpec, observer: Observer) -> Generation:
        if not self.alive():
            raise EngineClosed
        if unsupported_fields(spec, self._batch_caps):
            unsupported = unsupported_fields(spec, self._capabilities)
            if unsupported or self._side is None:
                raise ValueError(f"the batched engine cannot honour {', '.join(unsupported)}")
            return self._side.submit(spec, observer)
        self._drain_orphans()
        request_id = f"brownout-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        generation = Generation(loop, observer, on_cancel=lambda: self._cancel(request_id))
        request = _Request(request_id, generation, self._engine.token_text(spec), spec.max_tokens)
        self._manager.register_result_handler(request_id, lambda out: self._on_output(request, out))
        self._active[request_id] = request
        added = self._manager.add_request(
            list(spec.prompt_ids),
            request_id=request_id,
            max_new_tokens=spec.max_tokens,
            streaming=True,
            eos_token_id=sorted(request.text.stop_ids),
            **self._sampling_kwargs(spec),
        )
        if added is None:  # the manager is stopping
            self._forget(request)
            raise EngineClosed
        return generation

    def cancel_all(self) -> None:
        self._closing = True
        for request in list(self._active.values()):
            request.generation.cancel()
        if self._side is not None:
            self._side.cancel_all()

    async def close(self) -> None:
        self.cancel_all()
        if self._side is not None:
            await self._side.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: self._manager.stop(block=True, timeout=10))
        self._tokenizer.shutdown()

    # --- internals (event loop) -------------------------------------------------------------

    def _sampling_kwargs(self, spec: GenerationSpec) -> dict[str, Any]:
        params = spec.params
        greedy = params.temperature <= 0
        vocab = self._engine.vocab_size
        kwargs: dict[str, Any] = {
            "temperature": GREEDY_TEMPERATURE if greedy else float(params.temperature),
            # Past the vocabulary top_k keeps everything; the library's int32 tensor
            # of it overflowed at 2**31, in its loop thread, which then died.
            "top_k": params.top_k if 0 < params.top_k < vocab else vocab,
            "top_p": float(params.top_p),
        }
        seed = spec.seed
        if self._sampler is not None:
            kwargs[cbsampler.SEED_KWARG] = -1 if greedy or seed is None else seed
        return kwargs

    def _on_output(self, request: _Request, output: Any) -> None:
        """One streamed output of the library (cumulative token ids), on the event loop."""
        if request.over:
            return  # cancelled, or already ended by a stop string
        generation, text = request.generation, request.text
        if output.error is not None:
            self._forget(request)
            generation.deliver(RuntimeError(str(output.error)))
            self._end(request)
            return
        tokens = output.generated_tokens
        new = tokens[request.seen :]
        request.seen = len(tokens)
        pieces: list[str] = []
        ids: list[int] = []
        for token_id in new:
            delta = text.step(int(token_id))
            if delta is None:
                break
            pieces.append(delta.text)
            ids.append(int(token_id))
        finished = output.is_finished()
        if text.stopped or finished:
            if not text.stopped:
                tail = text.finish()
                if tail is not None:
                    pieces.append(tail.text)
            if ids or any(pieces):
                generation.deliver(Delta("".join(pieces), len(ids), tuple(ids)))
            if not finished:
                self._manager.cancel_request(request.request_id)  # a stop string matched
            reason: Outcome = (
                "stop" if text.stopped or text.count < request.max_tokens else "length"
            )
            self._forget(request)
            generation.deliver(Finished(reason, text.count))
            self._end(request)
            return
        if ids:
            generation.deliver(Delta("".join(pieces), len(ids), tuple(ids)))

    def _cancel(self, request_id: str) -> None:
        request = self._active.get(request_id)
        if request is None or request.over:
            return
        self._manager.cancel_request(request_id)
        self._forget(request)
        request.generation.deliver(Finished("abort", request.text.count))
        self._end(request)

    def _forget(self, request: _Request) -> None:
        request.over = True
        self._active.pop(request.request_id, None)
        router = self._manager.output_router
        with router._lock:
            router.result_handlers.pop(request.request_id, None)
        if self._sampler is not None:
            self._sampler.forget(request.request_id)

    def _end(self, request: _Request) -> None:
        if not request.generation.done.done():
            request.generation.done.set_result(None)

    def _drain_orphans(self) -> None:
        """Outputs of cancelled requests land in the library's shared queue: drop them."""
        shared = self._manager.output_router.output_queue
        with contextlib.suppress(queue.Empty):
            while not shared.empty():
                shared.get_nowait()

    def _engine_waiting(self) -> int:
        processor = self._manager.batch_processor
        pending = int(self._manager.input_queue.qsize())
        if processor is None:
            return pending
        return pending + len(processor.scheduler.waiting_requests)

    def _kv_usage(self) -> float:
        processor = self._manager.batch_processor
        if processor is None:
            return 0.0
        try:
            free = float(processor.cache.compute_free_capacity(relative=True))
        except (RuntimeError, ValueError, ZeroDivisionError):  # read while the loop mutates it
            return 0.0
        return min(max(1.0 - free, 0.0), 1.0)
