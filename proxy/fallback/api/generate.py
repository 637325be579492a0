"""The generation endpoints: /v1/chat/completions and /v1/completions.

A request goes: parse and classify every field (400) → model check (404) →
engine capabilities (400 naming the field) → the prompt's length against the
context window (400 `context_length_exceeded`, before any tokenizing) →
capacity fast-path (503) → the grammar from the grammar lane (400 for a bad
schema, 503 + Retry-After when the lane is full or past its deadline) →
admission (503, or wait in line) → prompt ids on the tokenizer thread, under
the slot (400 for a bad template) → context check (400) → the engine →
stream or collect.

Tokenizing under the slot bounds how many prompts wait for the tokenizer
thread to the slots, so a plain request is never queued behind any number of
long prompts in front of it.

`n` choices run one after another inside one admission slot (so `n` never
needs more slots than the server has), each with `seed + index`. Once an SSE
response has started, errors travel in-band as `data: {"error": ...}`
followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import jinja2
import structlog
from aiohttp import web

from proxy.fallback.api.choices import ChoiceOutput, Choices
from proxy.fallback.api.errors import APIError, invalid
from proxy.fallback.api.fields import check_capabilities
from proxy.fallback.api.httpio import (
    check_capacity,
    check_model,
    grammar_busy,
    overloaded,
    read_json,
    send,
    send_error,
    shutting_down,
)
from proxy.fallback.api.parsing import (
    check_prompt_size,
    parse_chat,
    parse_completion,
    resolve_max_tokens,
)
from proxy.fallback.api.shapes import ChatShape, ChoiceResult, CompletionShape, Shape, Usage
from proxy.fallback.api.state import ADMISSION, ENGINE, METRICS, SETTINGS, SIDE_ADMISSION, WORKERS
from proxy.fallback.engines.admission import QueueFull
from proxy.fallback.engines.engine import Engine
from proxy.fallback.engines.interface import (
    EngineClosed,
    GenerationFailed,
    GenerationSpec,
    LogitsProcessorFactory,
    TokenLogprob,
)
from proxy.fallback.features.grammarlane import CompileTimeout, LaneFull
from proxy.fallback.features.support import API_SUPPORT, ApiSupport
from proxy.fallback.protocol import ChatRequest, CompletionRequest, Output, SamplingParams
from proxy.openai.headers import SSE_HEADERS

log = structlog.get_logger("brownout.fallback.http")


Prepare = Callable[[], tuple[list[int], tuple[LogitsProcessorFactory, ...]]]


@dataclass(frozen=True)
class _Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    output: Output
    processors: tuple[LogitsProcessorFactory, ...]
    stream: bool
    include_usage: bool
    arrived: float  # monotonic


def _stand_in() -> None:
    """A logits processor not made yet (made with the prompt ids): picks the lane."""


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = parse_chat(await read_json(request))
    support = request.app[API_SUPPORT]
    name = request.app[SETTINGS].served_model_name
    prepare = partial(_prepare_chat, request.app[ENGINE], support, req)
    return await _serve(request, req, prepare, ChatShape(name, support.token_text), arrived)


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = parse_completion(await read_json(request))
    support = request.app[API_SUPPORT]
    name = request.app[SETTINGS].served_model_name
    prepare = partial(_prepare_completion, request.app[ENGINE], support, req)
    return await _serve(request, req, prepare, CompletionShape(name, support.token_text), arrived)


async def _serve(
    request: web.Request,
    req: ChatRequest | CompletionRequest,
    prepare: Prepare,
    shape: Shape,
    arrived: float,
) -> web.StreamResponse:
    """What both endpoints share once the request is parsed: model, capability and
    length checks, capacity, the grammar, then a slot, the prompt ids and the run."""
    app = request.app
    settings = app[SETTINGS]
    check_model(req.model, settings)
    caps = app[WORKERS].capabilities
    chat = isinstance(req, ChatRequest)
    support = app[API_SUPPORT]
    check_capabilities(caps, req.sampling, req.output, chat=chat, grammar=support.grammar)
    check_prompt_size(req, settings.max_model_len, support.max_token_chars)
    check_capacity(app)
    try:
        grammar = await support.compile_grammar(req.output)
    except LaneFull:
        raise grammar_busy(app, timed_out=False) from None
    except CompileTimeout:
        raise grammar_busy(app, timed_out=True) from None
    return await _run(request, shape, req, prepare, grammar, arrived)


def _specs(job: _Job, max_tokens: int) -> list[GenerationSpec]:
    base = GenerationSpec(
        prompt_ids=tuple(job.prompt_ids),
        params=job.sampling,
        max_tokens=max_tokens,
        logprobs=job.output.logprobs,
        logits_processors=job.processors,
    )
    return [replace(base, seed_offset=i) for i in range(job.output.n)]


async def _run(
    request: web.Request,
    shape: Shape,
    req: ChatRequest | CompletionRequest,
    prepare: Prepare,
    grammar: tuple[LogitsProcessorFactory, ...],
    arrived: float,
) -> web.StreamResponse:
    app = request.app
    settings, metrics, workers = app[SETTINGS], app[METRICS], app[WORKERS]
    # Which lane depends on the fields only, not on the prompt: decided before tokenizing.
    needs = grammar or ((_stand_in,) if req.output.needs_logits_processors else ())
    probe = GenerationSpec((), req.sampling, 1, req.output.logprobs, needs)
    # A request for the side lane waits for a side-lane slot, never in the
    # batch's queue (where it would hold a slot the batch could use).
    side = app.get(SIDE_ADMISSION)
    admission = side if side is not None and workers.in_side_lane(probe) else app[ADMISSION]
    queued = time.monotonic()
    try:
        await admission.acquire()
    except QueueFull:
        raise overloaded(app, admission) from None
    metrics.queue_time.observe(time.monotonic() - queued)
    try:
        prompt_ids, processors = await workers.tokenize(prepare)
        job = _Job(
            prompt_ids,
            req.sampling,
            req.output,
            processors + grammar,
            req.stream,
            req.include_usage,
            arrived,
        )
        max_tokens = resolve_max_tokens(
            len(job.prompt_ids), job.sampling.max_tokens, settings.max_model_len
        )
    except BaseException:
        admission.release()  # a 400 (template, context) or the client gone while tokenizing
        raise
    choices = Choices(
        workers,
        _specs(job, max_tokens),
        metrics,
        job.arrived,
        release=admission.release,
        tool_use=job.output.tool_use,
        hidden_ids=app[ENGINE].eos_token_ids | set(job.sampling.stop_token_ids),
    )
    try:
        try:
            choices.start()
        except EngineClosed:
            raise shutting_down() from None
        metrics.prompt_tokens.inc(len(job.prompt_ids))
        if job.stream:
            return await _stream(request, shape, choices, job)
        return await _collect(shape, choices, job)
    finally:
        # Client gone (handler cancelled or write failed) or any error: stop generating.
        choices.close()


async def _collect(shape: Shape, choices: Choices, job: _Job) -> web.Response:
    results: list[ChoiceResult] = []
    completion_tokens = 0
    while True:
        try:
            out = await choices.next()
        except GenerationFailed as exc:
            raise APIError(500, f"Generation failed: {exc}", type_="server_error") from exc
        except EngineClosed:
            raise shutting_down() from None
        if out is None:
            break
        while len(results) <= out.index:
            wants = job.output.logprobs is not None
            results.append(ChoiceResult("", "stop", [] if wants else None))
        result = results[out.index]
        result.text = (result.text or "") + out.text
        if result.logprobs is not None and out.logprobs:
            result.logprobs.extend(out.logprobs)
        if out.finished is not None:
            if out.finished.reason == "abort":
                raise shutting_down()
            completion_tokens += out.finished.completion_tokens
            result.reason = out.reason or "stop"
            if out.tool_calls:
                result.tool_calls = out.tool_calls
                result.text = out.content_if_calls
    usage = Usage(len(job.prompt_ids), completion_tokens)
    return web.json_response(shape.full(results, usage))


async def _stream(
    request: web.Request, shape: Shape, choices: Choices, job: _Job
) -> web.StreamResponse:
    keepalive = request.app[SETTINGS].keepalive_s
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    started: set[int] = set()
    completion_tokens = 0
    try:
        while True:
            try:
                async with asyncio.timeout(keepalive):  # no per-token task, unlike wait_for
                    out = await choices.next()
            except TimeoutError:
                await response.write(b": ping\n\n")
                continue
            except GenerationFailed as exc:
                await send_error(response, APIError(500, f"Generation failed: {exc}"))
                break
            except EngineClosed:
                await send_error(response, shutting_down())
                break
            if out is None:
                if job.include_usage:
                    usage = Usage(len(job.prompt_ids), completion_tokens)
                    await send(response, shape.usage_chunk(usage))
                break
            if out.index not in started:
                started.add(out.index)
                start = shape.start_chunk(out.index)
                if start is not None:
                    await send(response, start)
            if out.text or out.logprobs:
                await send(response, shape.delta_chunk(out.index, out.text, _lp(out, job)))
            if out.finished is None:
                continue
            if out.finished.reason == "abort":
                await send_error(response, shutting_down())
                break
            completion_tokens += out.finished.completion_tokens
            if out.tool_calls:
                await send(response, shape.tool_calls_chunk(out.index, out.tool_calls))
            await send(response, shape.finish_chunk(out.index, out.reason or "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("client_disconnected")  # `_run` cancels the generation
    except Exception:
        # Headers are sent, so the middleware cannot answer any more; a stream that
        # just stops would look like a short success to the OpenAI SDKs.
        log.exception("stream_failed")
        with contextlib.suppress(ConnectionResetError):
            await send_error(response, APIError(500, "Internal server error."))
            await response.write(b"data: [DONE]\n\n")
    return response


def _lp(out: ChoiceOutput, job: _Job) -> Sequence[TokenLogprob] | None:
    return out.logprobs if job.output.logprobs is not None else None


# --- tokenizer-thread functions: template errors are the request's fault ----------------


def _prepare_chat(
    engine: Engine, support: ApiSupport, req: ChatRequest
) -> tuple[list[int], tuple[LogitsProcessorFactory, ...]]:
    tools = req.output.tool_use.tools if req.output.tool_use.active else ()
    try:
        text = support.template.render(
            req.messages,
            tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    except (ValueError, jinja2.TemplateError) as exc:
        raise invalid(f"Cannot apply the chat template: {exc}", "messages") from exc
    # The template carries its own special tokens (BOS), as in vLLM.
    ids = engine.encode(text, add_special_tokens=req.add_special_tokens)
    return ids, support.processors(req.output, len(ids))


def _prepare_completion(
    engine: Engine, support: ApiSupport, req: CompletionRequest
) -> tuple[list[int], tuple[LogitsProcessorFactory, ...]]:
    if isinstance(req.prompt, str):
        ids = engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = list(req.prompt)
        if any(i >= engine.vocab_size for i in ids):
            raise invalid(
                f"Token ids must be below the vocabulary size {engine.vocab_size}.", "prompt"
            )
    if not ids:
        raise invalid("The prompt is empty.", "prompt")
    return ids, support.processors(req.output, len(ids))
