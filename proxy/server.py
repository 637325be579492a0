"""`brownout serve`: run the app on uvloop (when installed) until a signal."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

import structlog
from aiohttp import web

from proxy.app import create_app
from proxy.ingress.listen import GuardedSite
from proxy.policy import Policy, redact_url
from proxy.runtime.keys import STATE
from proxy.runtime.layouts import settle_layouts
from proxy.runtime.shutdown import drain
from proxy.runtime.state import ProxyState
from proxy.telemetry.logs import configure_logging

#: How long handlers still running after the drain get before they are cancelled.
CLEANUP_TIMEOUT_S = 1.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a default dependency
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    _send_chunks_unjoined()
    return loop


def _send_chunks_unjoined() -> None:
    """On uvloop, let aiohttp hand a chunked write's pieces (size line, data,
    CRLF) to `transport.writelines` as they are. Before Python 3.12.9 aiohttp
    joins them into one new bytes first (asyncio's own `writelines` had a bug
    in 3.12 up to 3.12.8); uvloop's sends them in one `writev` and copies
    nothing, so a relayed region, ~180 KB in a 1,024-chunk burst, is not
    copied once more (and no block of its size is allocated) on its way out.
    The bytes on the wire are the same."""
    import aiohttp.http_writer

    aiohttp.http_writer.SKIP_WRITELINES = False


def run(policy: Policy, host: str | None = None, port: int | None = None) -> None:
    settle_layouts()  # before any request or probe makes a writer
    configure_logging(policy.server.log_level)
    host = host or policy.server.host
    port = port or policy.server.port
    log = structlog.get_logger("brownout")
    log.info("starting", **starting_fields(policy, host, port))
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    app = create_app(policy)
    app.on_startup.append(_reload_on_sighup)
    app.on_startup.append(_freeze_startup_objects)
    try:
        loop.run_until_complete(serve(app, host, port, policy.server.shutdown_grace_s))
    finally:
        _cancel_remaining(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def serve(app: web.Application, host: str, port: int, shutdown_grace_s: float) -> None:
    """Serve `app` until SIGINT or SIGTERM, then drain (`proxy.runtime.shutdown`):
    `/readyz` 503 and new API requests 503 + `Retry-After` while the listener
    stays open, in-flight requests get `shutdown_grace_s` to finish (a second
    signal cuts that short); then stop listening and run the cleanups.
    (`web.run_app`, but on a site with the header deadline.)"""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    draining = app[STATE].shutdown

    def on_signal() -> None:
        if stop.is_set():
            draining.hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    runner = web.AppRunner(
        app,
        access_log=None,  # one structured line per request is logged instead
        # Cancel the handler when the client goes away, so the upstream
        # request is closed at once and vLLM frees the sequence's KV cache.
        handler_cancellation=True,
        # The drain below already gave the API requests their grace: what is
        # left at cleanup (a status page's event stream, closed on shutdown; a
        # stream past the deadline) gets a moment, then is cancelled.
        shutdown_timeout=min(shutdown_grace_s, CLEANUP_TIMEOUT_S),
        keepalive_timeout=75.0,  # idle keep-alive (nginx's upstream pool: 60 s)
    )
    await runner.setup()
    try:
        await start_site(runner, app, host, port)
        await stop.wait()
        await drain(draining, shutdown_grace_s)
    finally:
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _count_refused(state: ProxyState, status: int, code: str) -> None:
    """A request aiohttp's parser refused before the app saw it: counted like
    every other refusal (`brownout_requests_total`, `brownout_bad_requests_total`)."""
    rt = state.current
    rt.metrics.bad_requests.labels(code).inc()
    rt.count_request("none", "unknown", status)


async def start_site(
    runner: web.AppRunner, app: web.Application, host: str, port: int
) -> GuardedSite:
    """Listen on host:port with the policy's header deadline (re-read for
    each new connection, so a reload changes it)."""
    state = app[STATE]
    site = GuardedSite(
        runner,
        host,
        port,
        header_timeout_s=lambda: state.current.policy.server.header_timeout_s,
        on_timeout=lambda: state.current.metrics.header_timeouts.inc(),
        on_refused=lambda status, code: _count_refused(state, status, code),
    )
    await site.start()
    return site


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def starting_fields(policy: Policy, host: str, port: int) -> dict[str, Any]:
    """The `starting` log line: backend URLs without their `user:password@`."""
    fallback = policy.backends.fallback
    return {
        "host": host,
        "port": port,
        "policy": policy.source,
        "primary": redact_url(policy.backends.primary.url),
        "fallback": redact_url(fallback.url) if fallback is not None else None,
    }


async def _freeze_startup_objects(app: web.Application) -> None:
    """Keep the collector off what start-up built (modules, policy, tokenizer
    tables): they live as long as the process, and re-scanning them in every
    full collection costs the hot path. Each request allocates many short-lived
    objects, so young collections are also made rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


async def _reload_on_sighup(app: web.Application) -> None:
    """`kill -HUP` re-reads the policy, like nginx."""
    state = app[STATE]
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        # Supervised: an exception is logged and counted, never lost. A burst
        # of signals while a reload waits for its turn adds no reloads.
        state.supervisor.spawn("reload_sighup", state.reload_coalesced("sighup"))

    loop.add_signal_handler(signal.SIGHUP, on_hup)
