"""One backend: its HTTP client session, its URLs, its health probe.

Each backend gets exactly one `ClientSession` (its own connection pool and
keep-alive), created and closed in the app's cleanup context.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import structlog
from yarl import URL

from proxy.config import BackendPolicy

log = structlog.get_logger("brownout.upstream")

# Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus
# the ones the client library recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "x-session-id",
        "x-priority",
    }
)


@dataclass
class Health:
    """What the last probe said; read by the status page and routing."""

    healthy: bool | None = None  # None until the first probe ran
    last_error: str | None = None
    last_probe_at: float | None = None
    consecutive_failures: int = 0


@dataclass
class Upstream:
    name: str  # "primary" | "fallback"
    policy: BackendPolicy
    session: aiohttp.ClientSession
    health: Health = field(default_factory=Health)

    def __post_init__(self) -> None:
        base = URL(self.policy.url.rstrip("/"))
        self.base = base
        # Parsed once: building a URL per request is measurable at high rates.
        self.chat_url = base / "v1" / "chat" / "completions"
        self.completions_url = base / "v1" / "completions"
        self.models_url = base / "v1" / "models"
        self.health_url = base.with_path(self.policy.health.path)
        if self.policy.api_key:
            self.auth_header: str | None = f"Bearer {self.policy.api_key}"
        else:
            self.auth_header = None

    def url_for(self, path_qs: str) -> URL:
        return URL(str(self.base) + path_qs, encoded=True)

    async def probe(self) -> bool:
        """One health check: 200 = healthy; vLLM answers 503 once its engine died."""
        timeout = aiohttp.ClientTimeout(total=self.policy.health.timeout_s)
        err: str | None = None
        try:
            async with self.session.get(self.health_url, timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    err = f"health returned HTTP {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            err = f"connection failed: {exc.os_error.strerror or exc}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            err = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        h = self.health
        was = h.healthy
        h.last_probe_at = time.time()
        h.healthy = err is None
        h.last_error = err
        h.consecutive_failures = 0 if err is None else h.consecutive_failures + 1
        if was is not h.healthy:
            log.info("backend_health_changed", backend=self.name, healthy=h.healthy, error=err)
        return h.healthy

    async def probe_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self.policy.health.interval_s)


def make_session(policy: BackendPolicy) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=policy.pool.max_connections,
        limit_per_host=0,
        keepalive_timeout=policy.pool.keepalive_s,
        ttl_dns_cache=300,
    )
    # Only connect is bounded here; first-byte and idle limits are enforced
    # by the relay, which knows where in the answer it is.
    timeout = aiohttp.ClientTimeout(
        total=None, connect=policy.timeouts.connect_s, sock_connect=policy.timeouts.connect_s
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # bytes are relayed as received
        raise_for_status=False,
        skip_auto_headers=("User-Agent",),
    )


@contextlib.asynccontextmanager
async def running_upstream(name: str, policy: BackendPolicy) -> AsyncIterator[Upstream]:
    """An upstream with its session and probe task, torn down on exit."""
    session = make_session(policy)
    upstream = Upstream(name, policy, session)
    task = asyncio.create_task(upstream.probe_forever(), name=f"probe-{name}")
    try:
        yield upstream
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await session.close()
