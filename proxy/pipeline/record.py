"""The per-request record and the values the stages hand back.

`RequestRecord` is what one request carries through the pipeline (mutable,
owned by that request alone). Stages answer with frozen values: an
`AttemptResult` per backend attempt, and one `Terminal` per request — the
single thing the finish step turns into a metrics update and a log line.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from aiohttp import web

from proxy.openai.headers import DROPPED_HEADER, dropped_value
from proxy.policy import Priority
from proxy.sessions.conversation import SessionContext

if TYPE_CHECKING:
    from proxy.guard.stream import StreamGuard
    from proxy.guard.verdicts import Trip
    from proxy.pipeline.pump import StreamResult
    from proxy.runtime.generation import Runtime
    from proxy.telemetry.tracing import RequestTrace

# What became of one attempt on one backend.
AttemptKind = Literal[
    "answered",  # the client has the backend's answer (complete, or its 4xx passed on)
    "failed",  # failed before any byte reached the client: another attempt may answer
    "ended",  # failed after bytes reached the client: ended in-band (or rescued)
    "shed",  # admission refused it: the 429 is in `response`
    "refused",  # the request cannot be served as sent (e.g. context too long)
    "client_gone",  # the client left during the attempt
]


class TokenCount(NamedTuple):
    """One answer's token usage on one backend (a rescued stream has two)."""

    backend: str
    model: str
    prompt: int
    completion: int
    # Streams: seconds per output token after the first (its decode speed).
    tpot: float | None = None


class AttemptResult(NamedTuple):
    """Immutable (a NamedTuple: built in well under a microsecond, on the hot path)."""

    kind: AttemptKind
    backend: str
    status: int  # what the client saw, or would see if this is the last attempt
    outcome: str  # the access log's `outcome` (complete, error, guard_trip, shed_*, ...)
    detail: str = ""
    # The client's answer: a prepared stream, a ready body, or (failed) the
    # error to pass on when no other attempt answers.
    response: web.StreamResponse | None = None
    delivered: bool = False  # bytes of this answer reached the client
    # Breaker verdict: `fault` names a backend failure (the upstream_errors
    # kind); `healthy` is a success; neither (429, shed, client gone): nothing.
    fault: str = ""
    healthy: bool = False
    ttft: float | None = None  # upstream call → its first event (streams)
    client_ttft: float | None = None  # arrival → the client's first answer byte
    overhead: float | None = None  # time spent in the proxy (brownout_proxy_overhead)
    events: int | None = None
    body: bytes = b""  # failed: the error body to pass on if no other attempt answers
    trip: Trip | None = None  # the guard stopped it
    answer: str | None = None  # choice 0's finished text, for a session turn
    code: str = ""  # error code of a refused request (bad_requests metric)
    stream: StreamResult | None = None  # a stream that died mid-answer: for the rescue
    # failed: a transient failure the same backend may get a retry for
    # (http_500, http_429, reset, ...); "" = fail over at once (timeouts, ...).
    retry: str = ""
    retry_after: float | None = None  # the backend's Retry-After, seconds
    tokens: tuple[TokenCount, ...] = ()  # the answer's usage, per backend that answered


class Terminal(NamedTuple):
    """How the request ended: one per request, on every path."""

    backend: str
    status: int
    outcome: str
    detail: str = ""
    client_ttft: float | None = None
    overhead: float | None = None
    events: int | None = None
    stream_error: str = ""  # a started stream ended with this in-band error
    bad_request: str = ""  # the request's own fault, by code
    answer: str | None = None  # the answer's text (the flight recorder, with `content`)
    tokens: tuple[TokenCount, ...] = ()  # usage reported by the backends that answered


@dataclass(slots=True)
class RequestRecord:
    """One request on its way through the pipeline."""

    request: web.Request
    rt: Runtime
    endpoint: str  # metrics label: chat | completions | passthrough
    raw: bytes
    body: dict[str, Any]
    stream: bool
    rid: str
    t0: float
    priority: Priority = "normal"
    session: SessionContext | None = None
    body_changed: bool = False  # `body` differs from `raw` (session history merged)
    backend: str = "none"  # serving now: what a cancellation is charged to
    client: web.StreamResponse | None = None  # the client's stream once created
    rescued: bool = False
    overhead_pre: float = 0.0  # arrival → upstream call, of the answering attempt
    # The stream guards of this request's answers (a rescue continues the
    # one it rescues): their notes are reported once, at the finish.
    guards: list[tuple[str, StreamGuard]] = field(default_factory=list)
    adapted: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Fields removed for a backend that does not honour them (policy `drop`).
    dropped: dict[str, list[str]] = field(default_factory=dict)
    # The candidate's own failure of this request (a gray release's evidence).
    candidate_fault: str = ""
    # Its spans, when the policy traces (`telemetry.otlp_endpoint`).
    trace: RequestTrace | None = None  # a sampled request's spans (telemetry.otlp_endpoint)
    traceparent: str | None = None  # tracing on, the request not recorded: its backends'
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    def headers(self, backend: str) -> dict[str, str]:
        """Brownout's response headers."""
        h = {
            "X-Request-Id": self.rid,
            "X-Brownout-Tier": self.rt.tier,
            "X-Brownout-Backend": backend,
        }
        if self.session is not None:
            h["X-Brownout-Session"] = self.session.status
        if self.dropped:
            dropped = self.dropped.get(backend)
            if dropped:
                h[DROPPED_HEADER] = dropped_value(dropped)
        return h

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def model_for(self, backend: str) -> str:
        """The `model` this request named to `backend` (after the policy's
        rewrite): the token counters' label."""
        m = self.adapted.get(backend, self.body).get("model")
        return m if isinstance(m, str) else ""

    @property
    def model(self) -> str | None:
        """The request's `model` (picks a per-model breaker on multi-model
        backends; pass-through bodies may have none)."""
        m = self.body.get("model")
        return m if isinstance(m, str) else None
