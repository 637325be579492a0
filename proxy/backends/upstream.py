"""One backend: its HTTP client session, URLs, health probe and breakers.

Each backend gets exactly one `ClientSession` (its own connection pool and
keep-alive), created and closed in the app's cleanup context.

Breakers: one per backend (`breaker`), except for a backend of kind `openai`
that serves several models and has no `model` rewrite: there a request's
model (one of those its /v1/models lists) gets its own breaker, so failures
of one model never divert another's traffic. Ask `breaker_for(model)` for
the permit and hand it back to `release_trial(permit)` (or report it to the
runtime): a permit knows the breaker that issued it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from yarl import URL

from proxy.control.breaker import BackendBreaker, Permit
from proxy.control.retrybudget import RetryBudget
from proxy.openai.capabilities import PLAIN, Capabilities, from_model_card
from proxy.policy import BackendPolicy, BreakerPolicy

log = structlog.get_logger("brownout.upstream")


# Answers to the recovery probe that blame the probe request, not the backend.
MISCONFIGURED = frozenset({400, 404, 405, 422})
# Models of one backend that get their own breaker (the rest share `breaker`).
MAX_MODEL_BREAKERS = 64
PING = '{"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "temperature": 0}'

ModelBreakerChange = Callable[[str, str, str, str, str], None]  # backend, model, old, new, why


@dataclass(frozen=True, slots=True)
class ProbeMisconfigured:
    """The recovery probe's request is not one this backend takes: 404/405
    (no such endpoint: a chat-only server asked for /v1/completions) or
    400/422 (it rejects the body: e.g. a base model without a chat template)."""

    reason: str


@dataclass
class Health:
    """What the last probe said; read by the status page and the ladder."""

    healthy: bool | None = None  # None until the first probe ran
    last_error: str | None = None
    last_probe_at: float | None = None
    consecutive_failures: int = 0
    # A refused connection or vLLM's 503 (engine dead) needs no second opinion.
    definitive: bool = False


@dataclass
class Upstream:
    name: str  # "primary" | "fallback"
    policy: BackendPolicy
    session: aiohttp.ClientSession
    breaker: BackendBreaker
    probe_failures: int = 2
    health: Health = field(default_factory=Health)
    # Discovered from /v1/models unless the policy sets them.
    served_model: str | None = None
    max_model_len: int | None = None
    probe_task: asyncio.Task[None] | None = None
    # Every model id of /v1/models (kind openai: the per-model breakers' keys).
    served_models: tuple[str, ...] = ()
    model_breakers: dict[str, BackendBreaker] = field(default_factory=dict)
    on_model_breaker_change: ModelBreakerChange | None = None
    # Set when the recovery probe was refused as a request: real ones are the trial.
    probe_misconfigured: str | None = None
    # What it honours of a request (None: the whole OpenAI API, nothing checked):
    # read from /v1/models at discovery; a transformers fallback that
    # advertises nothing is taken to honour plain chat only.
    caps: Capabilities | None = None
    retry_budget: RetryBudget = field(default_factory=RetryBudget)

    def __post_init__(self) -> None:
        base = URL(self.policy.url.rstrip("/"))
        self.base = base
        # Parsed once: building a URL per request is measurable at high rates.
        self.chat_url = base / "v1" / "chat" / "completions"
        self.completions_url = base / "v1" / "completions"
        self.models_url = base / "v1" / "models"
        self.health_url = base.with_path(self.policy.health.path)
        self.auth_header: str | None = (
            f"Bearer {self.policy.api_key}" if self.policy.api_key else None
        )
        self.max_model_len = self.policy.max_model_len
        p = self.policy
        if p.supports_continuation is not None:
            self.supports_continuation = p.supports_continuation
        else:
            self.supports_continuation = p.kind in ("vllm", "transformers")
        # Only what the operator lists: a field the backend does not honour is
        # refused or dropped by name (ladder.failover.unsupported_fields).
        self.drop_params: tuple[str, ...] = p.drop_params
        self.caps = PLAIN if p.kind == "transformers" else None

    # -- breakers --------------------------------------------------------------

    @property
    def per_model(self) -> bool:
        """Whether requests get a breaker per model (see the module doc)."""
        return (
            self.policy.kind == "openai"
            and self.policy.model is None
            and (len(self.served_models) > 1)
        )

    def breaker_for(self, model: str | None) -> BackendBreaker:
        """The breaker that admits a request for `model` (the request's
        `model` field as sent to this backend). The backend's own breaker
        while it is not closed (opened by another replica, or by requests
        without a served model): it gates every model, and real requests can
        then be its half-open trial."""
        if model is None or not self.per_model or model not in self.served_models:
            return self.breaker
        if self.breaker.state != "closed":
            return self.breaker
        b = self.model_breakers.get(model)
        if b is None:
            b = BackendBreaker(
                self.name, self.breaker.policy, self.breaker.clock, self._model_change(model)
            )
            b.model = model
            self.model_breakers[model] = b
            if self.on_model_breaker_change is not None:
                self.on_model_breaker_change(self.name, model, "closed", "closed", "created")
        return b

    def _model_change(self, model: str) -> Callable[[str, str, str, str], None]:
        def changed(name: str, old: str, new: str, reason: str) -> None:
            cb = self.on_model_breaker_change
            if cb is not None:
                cb(name, model, old, new, reason)

        return changed

    def breaker_of(self, permit: Permit) -> BackendBreaker:
        """The breaker of this backend that issued `permit`."""
        owner = permit.owner
        if (
            isinstance(owner, BackendBreaker)
            and self.model_breakers.get(owner.model or "") is owner
        ):
            return owner
        return self.breaker

    def release_trial(self, permit: Permit | None) -> None:
        """`breaker.release_trial` on whichever breaker issued `permit`."""
        # Only a half-open trial holds a slot (a closed breaker's permits are
        # all trial 0): nothing to look up on the common path.
        if permit is not None and permit.trial:
            self.breaker_of(permit).release_trial(permit)

    def breakers(self) -> Iterator[tuple[str | None, BackendBreaker]]:
        """(model or None for the backend's own, breaker) of this backend."""
        yield None, self.breaker
        yield from self.model_breakers.items()

    def trial_due(self, now: float) -> bool:
        """Whether one of the backend's breakers (its own, or a model's) would
        admit a half-open trial now."""
        return any(
            b.state == "half-open" or (b.state == "open" and now >= b.retry_at())
            for _, b in self.breakers()
        )

    def url_for(self, path_qs: str) -> URL:
        return URL(str(self.base) + path_qs, encoded=True)

    @property
    def down(self) -> bool:
        """The probes say this backend cannot serve."""
        h = self.health
        if h.healthy is None or h.healthy:
            return False
        return h.definitive or h.consecutive_failures >= self.probe_failures

    @property
    def available(self) -> bool:
        """Can serve: probes pass, its breaker is closed, and (per-model
        breakers) not every served model's breaker is out."""
        if self.down or self.breaker.state != "closed":
            return False
        mb = self.model_breakers
        if self.per_model and len(mb) >= len(self.served_models):
            return any(b.state == "closed" for b in mb.values())
        return True

    async def probe(self) -> bool:
        """One health check: 200 = healthy; vLLM answers 503 once its engine died."""
        timeout = aiohttp.ClientTimeout(total=self.policy.health.timeout_s)
        err: str | None = None
        definitive = False
        try:
            async with self.session.get(
                self.health_url, timeout=timeout, allow_redirects=False
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    err = f"health returned HTTP {resp.status}"
                    definitive = resp.status == 503
        except aiohttp.ClientConnectorError as exc:
            err = f"connection failed: {exc.os_error.strerror or exc}"
            definitive = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            err = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        h = self.health
        was = h.healthy
        h.last_probe_at = time.time()
        h.healthy = err is None
        h.last_error = err
        h.definitive = definitive
        h.consecutive_failures = 0 if err is None else h.consecutive_failures + 1
        if was is not h.healthy:
            log.info("backend_health_changed", backend=self.name, healthy=h.healthy, error=err)
        if h.healthy and (
            was is not True
            or self.served_model is None
            or self.max_model_len is None
            or not self.served_models
        ):
            # First contact and every recovery: the backend may have been replaced.
            await self.discover()
        return h.healthy

    async def discover(self) -> None:
        """Served model name and context window from /v1/models (vLLM and the
        fallback server both report `max_model_len`)."""
        try:
            async with self.session.get(
                self.models_url, timeout=aiohttp.ClientTimeout(total=2), allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return
                data = json.loads(await resp.read())
            first = data["data"][0]
            ids = [m["id"] for m in data["data"] if isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return
        self.served_models = tuple(dict.fromkeys(ids))[:MAX_MODEL_BREAKERS]
        if self.served_model is None and isinstance(first.get("id"), str):
            self.served_model = first["id"]
        if isinstance(first, dict):
            self.learn_capabilities(first)
        if self.max_model_len is None and isinstance(first.get("max_model_len"), int):
            self.max_model_len = first["max_model_len"]
            log.info(
                "backend_discovered",
                backend=self.name,
                model=self.served_model,
                max_model_len=self.max_model_len,
            )

    def learn_capabilities(self, card: dict[str, object]) -> None:
        """The model card's advertised capabilities (kept as they were when it has none)."""
        caps = from_model_card(card)
        if caps is None:
            return
        self.caps = caps
        if self.policy.supports_continuation is None and caps.continuation is not None:
            self.supports_continuation = caps.continuation
        log.info(
            "backend_capabilities",
            backend=self.name,
            tools="tools" in caps.chat,
            response_format=sorted(caps.response_format),
            continuation=self.supports_continuation,
        )

    def probe_request(self, model: str | None = None) -> dict[str, Any]:
        """The recovery probe's JSON body (`backends.<name>.probe`)."""
        body: dict[str, Any] = json.loads(self.policy.probe.body or PING)
        model = model or self.policy.model or self.served_model
        if model and "model" not in body:
            body["model"] = model
        return body

    async def recovery_probe(self, model: str | None = None) -> str | ProbeMisconfigured | None:
        """/health plus the probe request (for `model`'s breaker, or the
        backend's): None when both work, else why not — `ProbeMisconfigured`
        when the backend does not take the probe request (400/404/405/422)."""
        if not await self.probe():
            return self.health.last_error or "health probe failed"
        path = self.policy.probe.path
        try:
            async with self.session.post(
                self.base.with_path(path),
                json=self.probe_request(model),
                headers={"Authorization": self.auth_header} if self.auth_header else None,
                timeout=aiohttp.ClientTimeout(total=self.policy.timeouts.first_byte_s),
                allow_redirects=False,
            ) as resp:
                await resp.read()
                if resp.status in MISCONFIGURED:
                    return ProbeMisconfigured(f"POST {path} answered HTTP {resp.status}")
                if not 200 <= resp.status < 300:
                    return f"probe POST {path} returned HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"probe POST {path} failed: {type(exc).__name__}"
        return None

    async def close(self) -> None:
        task = self.probe_task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.session.close()

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


def open_upstream(
    name: str,
    policy: BackendPolicy,
    breaker_policy: BreakerPolicy,
    clock: Callable[[], float],
    on_breaker_change: Callable[[str, str, str, str], None],
    probe_failures: int,
    start: Callable[[str, Callable[[], Awaitable[None]]], asyncio.Task[None]] | None = None,
    breaker: BackendBreaker | None = None,
    on_model_breaker_change: ModelBreakerChange | None = None,
) -> Upstream:
    """An upstream with its session and its probe task running (call `close`).
    `start` runs the probe loop (the app's `Supervisor.start`: an exception
    in a probe is logged and counted, and probing goes on). `breaker`: one
    to keep (a reload that changed other settings of the same server)."""
    session = make_session(policy)
    if breaker is None:
        breaker = BackendBreaker(name, breaker_policy, clock, on_breaker_change)
    upstream = Upstream(name, policy, session, breaker, probe_failures)
    upstream.on_model_breaker_change = on_model_breaker_change
    if start is None:
        upstream.probe_task = asyncio.create_task(upstream.probe_forever(), name=f"probe-{name}")
    else:
        upstream.probe_task = start(f"health_probe_{name}", upstream.probe_forever)
    return upstream
