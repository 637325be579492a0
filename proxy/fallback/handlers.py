"""HTTP handlers of the fallback server and its error middleware.

A generation request goes: parse (400) → model check (404) → capacity
fast-path (503) → prompt ids on the tokenizer thread → context check (400)
→ admission (503, or wait in line) → worker thread → stream or collect.
Once an SSE response has started, errors travel in-band as
`data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import jinja2
import structlog
from aiohttp import web

from proxy.fallback.admission import QueueFull
from proxy.fallback.engine import Delta, Engine, Finished
from proxy.fallback.errors import APIError, invalid
from proxy.fallback.metrics import CONTENT_TYPE, FallbackMetrics
from proxy.fallback.protocol import (
    ChatRequest,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    JSONObject,
    Message,
    SamplingParams,
    Shape,
    TokenizeRequest,
    Usage,
    parse_chat,
    parse_completion,
    parse_tokenize,
    resolve_max_tokens,
)
from proxy.fallback.state import ADMISSION, ENGINE, METRICS, SETTINGS, WORKERS, Settings
from proxy.fallback.workers import Generation, GenerationFailed, WorkersClosed
from proxy.openai.errors import error_body
from proxy.openai.headers import SSE_HEADERS

log = structlog.get_logger("brownout.fallback.http")


# --- middleware --------------------------------------------------------------------------


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as an OpenAI error object; every request is counted."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    metrics = request.app[METRICS]
    try:
        response = await handler(request)
    except APIError as exc:
        response = exc.response()
    except web.HTTPException as exc:  # routing: unknown path, wrong method
        kept = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        response = APIError(exc.status, exc.reason, headers=kept).response()
    except asyncio.CancelledError:
        metrics.http_request(endpoint, 499)  # client closed the connection (nginx's 499)
        raise
    except Exception:
        log.exception("handler_failed", endpoint=endpoint)
        response = APIError(500, "Internal server error.", type_="server_error").response()
    metrics.http_request(endpoint, response.status)
    return response


# --- small endpoints ---------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    # The model is loaded before the port opens, so answering means ready.
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    card = {
        "id": settings.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "brownout",
        "root": str(request.app[ENGINE].path),
        "parent": None,
        "max_model_len": settings.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    req = parse_tokenize(await _read_json(request))
    settings = request.app[SETTINGS]
    _check_model(req.model, settings)
    ids = await request.app[WORKERS].tokenize(partial(_tokenize_ids, request.app[ENGINE], req))
    return web.json_response(
        {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids}
    )


# --- generation endpoints ----------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = parse_chat(await _read_json(request))
    _check_model(req.model, request.app[SETTINGS])
    _check_capacity(request.app)
    engine = request.app[ENGINE]
    prompt_ids = await request.app[WORKERS].tokenize(partial(_chat_ids, engine, req))
    job = _Job(prompt_ids, req.sampling, req.stream, req.include_usage, arrived)
    return await _run(request, ChatShape(request.app[SETTINGS].served_model_name), job)


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    req = parse_completion(await _read_json(request))
    _check_model(req.model, request.app[SETTINGS])
    _check_capacity(request.app)
    engine = request.app[ENGINE]
    prompt_ids = await request.app[WORKERS].tokenize(partial(_completion_ids, engine, req))
    job = _Job(prompt_ids, req.sampling, req.stream, req.include_usage, arrived)
    return await _run(request, CompletionShape(request.app[SETTINGS].served_model_name), job)


@dataclass(frozen=True)
class _Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    arrived: float  # monotonic


class _RequestObserver:
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


async def _run(request: web.Request, shape: Shape, job: _Job) -> web.StreamResponse:
    app = request.app
    settings, admission, metrics = app[SETTINGS], app[ADMISSION], app[METRICS]
    max_tokens = resolve_max_tokens(
        len(job.prompt_ids), job.sampling.max_tokens, settings.max_model_len
    )
    queued = time.monotonic()
    try:
        await admission.acquire()
    except QueueFull:
        raise _overloaded(app) from None
    metrics.queue_time.observe(time.monotonic() - queued)
    try:
        observer = _RequestObserver(metrics, job.arrived)
        generation = app[WORKERS].start(job.prompt_ids, job.sampling, max_tokens, observer)
    except WorkersClosed:
        admission.release()
        raise _shutting_down() from None
    except BaseException:
        admission.release()
        raise
    # The slot is the thread's, not the handler's: freed when the thread ends.
    generation.done.add_done_callback(lambda _: admission.release())
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    try:
        if job.stream:
            return await _stream(request, shape, generation, job)
        return await _collect(shape, generation, job)
    finally:
        # Client gone (handler cancelled or write failed) or any error: stop the thread.
        generation.cancel()


async def _collect(shape: Shape, generation: Generation, job: _Job) -> web.Response:
    parts: list[str] = []
    while True:
        try:
            event = await generation.next_event()
        except GenerationFailed as exc:
            raise APIError(500, f"Generation failed: {exc}", type_="server_error") from exc
        if isinstance(event, Delta):
            parts.append(event.text)
            continue
        if event.reason == "abort":
            raise _shutting_down()
        usage = Usage(len(job.prompt_ids), event.completion_tokens)
        return web.json_response(shape.full("".join(parts), event.reason, usage))


async def _stream(
    request: web.Request, shape: Shape, generation: Generation, job: _Job
) -> web.StreamResponse:
    keepalive = request.app[SETTINGS].keepalive_s
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        start = shape.start_chunk()
        if start is not None:
            await _send(response, start)
        while True:
            try:
                async with asyncio.timeout(keepalive):  # no per-token task, unlike wait_for
                    event = await generation.next_event()
            except TimeoutError:
                await response.write(b": ping\n\n")
                continue
            except GenerationFailed as exc:
                await _send_error(response, APIError(500, f"Generation failed: {exc}"))
                break
            if isinstance(event, Delta):
                if event.text:
                    await _send(response, shape.delta_chunk(event.text))
                continue
            if event.reason == "abort":
                await _send_error(response, _shutting_down())
                break
            await _send(response, shape.finish_chunk(event.reason))
            if job.include_usage:
                usage = Usage(len(job.prompt_ids), event.completion_tokens)
                await _send(response, shape.usage_chunk(usage))
            break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("client_disconnected")  # `_run` cancels the generation
    except Exception:
        # Headers are sent, so the middleware cannot answer any more; a stream that
        # just stops would look like a short success to the OpenAI SDKs.
        log.exception("stream_failed")
        with contextlib.suppress(ConnectionResetError):
            await _send_error(response, APIError(500, "Internal server error."))
            await response.write(b"data: [DONE]\n\n")
    return response


async def _send(response: web.StreamResponse, obj: JSONObject) -> None:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    await response.write(b"data: " + data.encode() + b"\n\n")


async def _send_error(response: web.StreamResponse, exc: APIError) -> None:
    # In-band error after the 200: what vLLM sends and the OpenAI SDK raises on.
    body = error_body(exc.message, "server_error" if exc.status >= 500 else exc.type_, exc.status)
    await response.write(b"data: " + body + b"\n\n")


# --- helpers -----------------------------------------------------------------------------


async def _read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None


def _check_model(requested: str | None, settings: Settings) -> None:
    # Absent is fine (vLLM serves its one model); a wrong name is a client bug.
    if requested is not None and requested != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist.",
            param="model",
            code="model_not_found",
        )


def _check_capacity(app: web.Application) -> None:
    """Shed before tokenizing when the queue is already full (cheap 503)."""
    if app[ADMISSION].is_full():
        raise _overloaded(app)


def _overloaded(app: web.Application) -> APIError:
    admission, settings = app[ADMISSION], app[SETTINGS]
    return APIError(
        503,
        f"The server is overloaded ({admission.running} running, {admission.waiting} "
        "waiting); please retry later.",
        type_="server_error",
        code="overloaded",
        headers={"Retry-After": str(settings.retry_after_s)},
    )


def _shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type_="server_error", code="shutdown")


# Tokenizer-thread functions: template errors are the request's fault (400).


def _render(
    engine: Engine,
    messages: tuple[Message, ...],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    try:
        return engine.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (ValueError, jinja2.TemplateError) as exc:
        raise invalid(f"Cannot apply the chat template: {exc}", "messages") from exc


def _chat_ids(engine: Engine, req: ChatRequest) -> list[int]:
    # The template carries its own special tokens (BOS), as in vLLM.
    text = _render(
        engine,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    return engine.encode(text, add_special_tokens=False)


def _completion_ids(engine: Engine, req: CompletionRequest) -> list[int]:
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
    return ids


def _tokenize_ids(engine: Engine, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:
        text = _render(
            engine,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        return engine.encode(text, add_special_tokens=req.add_special_tokens)
    return engine.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
