"""App factory and entry point of `brownout fallback-server`.

The model is loaded before the port opens: while loading, clients get
connection refused (as with vLLM), and once anything answers, `/health` is
200. SIGTERM/SIGINT cancel running generations (streams end with an in-band
error, never a silent cut), wait for the worker threads, then exit 0. If
the engine dies (the batched engine's loop ends on an error), /health turns
503 and the server shuts down the same way within a second or so, exit 1
(vLLM exits too), for its supervisor to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import structlog
from aiohttp import web

from proxy.fallback.api import handlers
from proxy.fallback.api.metrics import FallbackMetrics
from proxy.fallback.api.state import (
    ADMISSION,
    ENGINE,
    METRICS,
    SETTINGS,
    SIDE_ADMISSION,
    WORKERS,
    Settings,
)
from proxy.fallback.engines import capacity
from proxy.fallback.engines.admission import Admission
from proxy.fallback.engines.engine import Engine, ModelLoadError
from proxy.fallback.engines.interface import GenerationEngine
from proxy.fallback.engines.workers import ThreadEngine
from proxy.fallback.features.grammarlane import LaneLimits
from proxy.fallback.features.support import API_SUPPORT, ApiSupport
from proxy.telemetry.logs import configure_logging

log = structlog.get_logger("brownout.fallback")

# Room for long prompts: 32k tokens of JSON-escaped text is well under this.
_MAX_BODY_BYTES = 16 * 1024 * 1024
# The batched engine's side lane: threads for what continuous batching cannot honour.
DEFAULT_SIDE_SLOTS = 2
# Bounded so a stuck client cannot hold shutdown for aiohttp's default 60 s.
_SHUTDOWN_TIMEOUT_S = 10.0
# How often `serve` checks that the engine can still generate.
_ENGINE_CHECK_S = 1.0


def create_app(
    engine: Engine, settings: Settings, generator: GenerationEngine | None = None
) -> web.Application:
    """The app around a loaded model; `generator` defaults to the threads engine."""
    app = web.Application(middlewares=[handlers.error_middleware], client_max_size=_MAX_BODY_BYTES)
    if generator is None:
        generator = ThreadEngine(engine, settings.max_concurrency)
    admission = Admission(generator.max_running, settings.max_queue)
    side = Admission(generator.side_slots, settings.max_queue) if generator.side_slots else None
    app[SETTINGS] = settings
    app[ENGINE] = engine
    app[ADMISSION] = admission
    if side is not None:
        app[SIDE_ADMISSION] = side
    app[METRICS] = FallbackMetrics(settings.served_model_name, admission, generator.load, side=side)
    app[WORKERS] = generator
    # API helper: chat template + xgrammar (its compile lane bounded by the settings)
    app[API_SUPPORT] = ApiSupport.load(engine.path, settings.grammar)
    structured = app[API_SUPPORT].structured
    if structured is not None:
        app[METRICS].watch_grammar(structured.lane)
    app.on_shutdown.append(_cancel_generations)
    app.cleanup_ctx.append(_close_workers)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    return app


async def _cancel_generations(app: web.Application) -> None:
    # Runs before aiohttp waits for in-flight handlers, so streams end now.
    app[WORKERS].cancel_all()


async def _close_workers(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[WORKERS].close()
    app[API_SUPPORT].shutdown()


def check_limits(args: argparse.Namespace) -> None:
    """Reject bad limits before spending seconds on loading the model."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be at least 0, got {args.max_queue}")
    side_slots = getattr(args, "side_slots", DEFAULT_SIDE_SLOTS)
    if side_slots < 0:
        raise ValueError(f"--side-slots must be at least 0, got {side_slots}")
    grammar_limits(args)


def settings_from_args(
    args: argparse.Namespace, engine: Engine, max_concurrency: int | None = None
) -> Settings:
    """Validated settings; ValueError with a one-line message otherwise.

    `max_concurrency`: the capacity planned from the device (`capacity.plan`),
    used where `--max-concurrency` is not given.
    """
    check_limits(args)
    limit = engine.max_position_embeddings
    max_model_len = limit if args.max_model_len is None else args.max_model_len
    if not 1 <= max_model_len <= limit:
        raise ValueError(
            f"--max-model-len must be between 1 and the model's max_position_embeddings "
            f"({limit}), got {max_model_len}"
        )
    name = args.served_model_name or Path(args.model).expanduser().resolve().name
    return Settings(
        served_model_name=name,
        max_model_len=max_model_len,
        max_concurrency=_first(args.max_concurrency, max_concurrency, 1),
        max_queue=args.max_queue,
        grammar=grammar_limits(args),
    )


def grammar_limits(args: argparse.Namespace) -> LaneLimits:
    """`--grammar-workers/-queue/-timeout`; ValueError with a one-line message."""
    default = LaneLimits()
    workers = getattr(args, "grammar_workers", default.workers)
    queue = getattr(args, "grammar_queue", default.queue)
    timeout_s = getattr(args, "grammar_timeout", default.timeout_s)
    if workers < 1:
        raise ValueError(f"--grammar-workers must be at least 1, got {workers}")
    if queue < 0:
        raise ValueError(f"--grammar-queue must be at least 0, got {queue}")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"--grammar-timeout must be positive, got {timeout_s}")
    return LaneLimits(workers=workers, queue=queue, timeout_s=timeout_s)


def _cuda_graphs(args: argparse.Namespace, engine: Engine) -> bool | None:
    """`--cuda-graphs`: auto = on for a CUDA device (measured ~5x the steps per second)."""
    choice = getattr(args, "cuda_graphs", "auto")
    if choice == "auto":
        return True if engine.device.type == "cuda" else None
    return choice == "on"


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def build_generator(args: argparse.Namespace, engine: Engine) -> tuple[Settings, GenerationEngine]:
    """Settings and the generation engine `--engine` asks for, sized from the device."""
    settings = settings_from_args(args, engine)
    choice: capacity.EngineChoice = getattr(args, "engine", "auto")
    kind = capacity.pick_engine(choice, engine.device.type)
    planned = capacity.plan(
        engine=kind,
        device=engine.device.type,
        free_bytes=capacity.free_memory(engine.device),
        kv_bytes_per_token=capacity.kv_bytes_per_token(engine.model.config, engine.model.dtype),
        max_model_len=settings.max_model_len,
        override=args.max_concurrency,
    )
    log.info("capacity", **planned.as_log())
    settings = settings_from_args(args, engine, planned.max_running)
    generator: GenerationEngine
    if kind == "batched":
        from proxy.fallback.engines.batched import BatchedEngine  # imports the library's CB code

        generator = BatchedEngine(
            engine,
            max_running=planned.max_running,
            kv_tokens=planned.kv_tokens,
            max_model_len=settings.max_model_len,
            max_batch_tokens=planned.max_batch_tokens,
            use_cuda_graph=_cuda_graphs(args, engine),
            side_slots=getattr(args, "side_slots", DEFAULT_SIDE_SLOTS),
        )
    else:
        generator = ThreadEngine(engine, planned.max_running, kv_token_budget=planned.kv_tokens)
    return settings, generator


async def _watch_engine(app: web.Application, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(_ENGINE_CHECK_S)
        if not stop.is_set() and not app[WORKERS].alive():
            log.error("engine_dead", action="exiting")
            stop.set()
            return


async def serve(app: web.Application, host: str, port: int) -> bool:
    """Serve until SIGINT/SIGTERM, then shut down gracefully.

    Also stops once the engine cannot generate any more (the batched engine's
    loop died): like vLLM, which exits within seconds of its engine dying, so
    that a supervisor restarts it rather than every request getting a 503.
    Returns True in that case.
    """
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that disconnects cancels its handler
        access_log=None,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = [f"http://{a[0]}:{a[1]}" for a in runner.addresses]
        log.info("listening", urls=bound, model=app[SETTINGS].served_model_name)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watch = asyncio.create_task(_watch_engine(app, stop))
        try:
            await stop.wait()
        finally:
            watch.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        died = watch.done() and not watch.cancelled()
        log.info("shutting_down")
    finally:
        await runner.cleanup()
    log.info("stopped")
    return died


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (a default dependency): the per-token path runs on the loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _fail(message: str, code: int) -> int:
    log.error("startup_failed", error=message)
    print(f"brownout fallback-server: error: {message}", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    configure_logging()
    try:
        check_limits(args)
        engine = Engine.load(Path(args.model), device=args.device, dtype=args.dtype)
        settings, generator = build_generator(args, engine)
    except (ModelLoadError, ValueError) as exc:
        return _fail(str(exc), 2)
    app = create_app(engine, settings, generator)
    # Start-up built a large heap (torch, transformers, the tokenizer): keep the
    # collector's full passes off it while serving.
    gc.collect()
    gc.freeze()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            died = runner.run(serve(app, args.host, args.port))
    except OSError as exc:  # typically: the port is taken
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", 1)
    return 1 if died else 0
