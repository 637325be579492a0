"""One backend: its HTTP client session, URLs, health and recovery probes.

Each backend gets exactly one `ClientSession` (its own connection pool and
keep-alive), created and closed in the app's cleanup context.

Its breakers, their corroboration ledgers and its retry budget are decisions
and live in `proxy.control.breakers` (`judge`); the methods here that name
them only hand the backend's served models to it. A backend of kind `openai`
that serves several models and has no `model` rewrite gets a breaker per
model (`per_model`).
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
from proxy.control.breakers import MAX_MODEL_BREAKERS, BreakerSet, ModelBreakerChange
from proxy.control.retrybudget import RetryBudget
from proxy.openai.capabilities import PLAIN, Capabilities, from_model_card
from proxy.policy import BackendPolicy, BreakerPolicy

log = structlog.get_logger("brownout.upstream")


# Answers to the recovery probe that blame the probe request, not the backend.
MISCONFIGURED = frozenset({400, 404, 405, 422})
PING = '{"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "temperature": 0}'


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
    # The model of the traffic that last failed here (one of `served_models`):
    # what the recovery probe asks for when the policy names none.
    traffic_model: str | None = None
    # Set when the recovery probe was refused as a request: real ones are the trial.
    probe_misconfigured: str | None = None
    # What it honours of a request (None: the whole OpenAI API, nothing checked):
    # read from /v1/models at discovery; a transformers fallback that
    # advertises nothing is taken to honour plain chat only.
    caps: Capabilities | None = None
    # Told every health probe's result (the flight recorder): name, health.
    on_probe: Callable[[str, Health], None] | None = None
    # Breakers, their corroboration ledgers, the retry budget (decisions, in control/).
    judge: BreakerSet = field(init=False)
    # The shared recovery probe (`shared_probe`): in flight, and the last verdict.
    _probe_flight: dict[str | None, tuple[float, asyncio.Task[str | ProbeMisconfigured | None]]] = (
        field(default_factory=dict, init=False, repr=False)
    )
    _probe_seen: dict[str | None, tuple[float, str | ProbeMisconfigured | None]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.judge = BreakerSet(self.breaker)
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
        # Ask for every stream's usage chunk (the token counters).
        self.stream_usage: bool = (
            p.stream_usage if p.stream_usage is not None else p.kind in ("vllm", "transformers")
        )
        # Only what the operator lists: a field the backend does not honour is
        # refused or dropped by name (ladder.failover.unsupported_fields).
        self.drop_params: tuple[str, ...] = p.drop_params
        self.caps = PLAIN if p.kind == "transformers" else None

    # -- breakers (the decisions live in proxy.control.breakers) --------------

    @property
    def per_model(self) -> bool:
        """Whether requests get a breaker per model (see the module doc)."""
        return (
            self.policy.kind == "openai"
            and self.policy.model is None
            and (len(self.served_models) > 1)
        )

    @property
    def model_breakers(self) -> dict[str, BackendBreaker]:
        return self.judge.model_breakers

    @property
    def retry_budget(self) -> RetryBudget:
        return self.judge.retry_budget

    def breaker_for(self, model: str | None) -> BackendBreaker:
        return self.judge.breaker_for(model, self.per_model, self.served_models)

    def breaker_of(self, permit: Permit) -> BackendBreaker:
        return self.judge.breaker_of(permit)

    def release_trial(self, permit: Permit | None) -> None:
        self.judge.release_trial(permit)

    def breakers(self) -> Iterator[tuple[str | None, BackendBreaker]]:
        return self.judge.all()

    def trial_due(self, now: float) -> bool:
        return self.judge.trial_due(now)

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
        if self.per_model:
            closed = self.judge.any_closed_model(len(self.served_models))
            return closed is None or closed
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
        if self.on_probe is not None:
            self.on_probe(self.name, h)
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
        model = self.policy.model or model or self.traffic_model or self.served_model
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

    async def shared_probe(
        self, model: str | None = None, since: float | None = None
    ) -> str | ProbeMisconfigured | None:
        """`recovery_probe(model)`, shared: a caller takes the verdict of a
        probe that started at or after `since` (loop time; None: any probe in
        flight, else a new one) — finished or in flight — or starts one. So a
        verdict is never older than the failure it judges, and no number of
        requests has more than one probe per backend in flight at a time."""
        loop = asyncio.get_running_loop()
        seen = self._probe_seen.get(model)
        if seen is not None and since is not None and seen[0] >= since:
            return seen[1]
        flight = self._probe_flight.get(model)
        if flight is not None and since is not None and flight[0] < since:
            await asyncio.shield(flight[1])  # too old for this caller: the next one
            return await self.shared_probe(model, since)
        if flight is None:
            task = loop.create_task(self._probe_once(model, loop.time()), name=f"probe-{self.name}")
            flight = self._probe_flight[model] = (loop.time(), task)
        return await asyncio.shield(flight[1])

    async def _probe_once(
        self, model: str | None, started: float
    ) -> str | ProbeMisconfigured | None:
        try:
            try:
                why = await self.recovery_probe(model)
            except Exception as exc:  # reported as the probe's failure
                why = f"recovery probe: {type(exc).__name__}"
            self._probe_seen[model] = (started, why)
            return why
        finally:
            self._probe_flight.pop(model, None)

    async def close(self) -> None:
        for _, flight in list(self._probe_flight.values()):
            flight.cancel()
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
    upstream.judge.on_model_breaker_change = on_model_breaker_change
    if start is None:
        upstream.probe_task = asyncio.create_task(upstream.probe_forever(), name=f"probe-{name}")
    else:
        upstream.probe_task = start(f"health_probe_{name}", upstream.probe_forever)
    return upstream
