"""Typed application state: settings and the `AppKey`s the handlers read."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from proxy.fallback.api.metrics import FallbackMetrics
from proxy.fallback.engines.admission import Admission
from proxy.fallback.engines.engine import Engine
from proxy.fallback.engines.interface import GenerationEngine
from proxy.fallback.features.grammarlane import LaneLimits


@dataclass(frozen=True)
class Settings:
    served_model_name: str
    max_model_len: int
    max_concurrency: int = 1
    max_queue: int = 8
    # SSE comment interval while no token arrives (long prefill), so idle
    # timeouts in nginx or the proxy do not cut a healthy stream.
    keepalive_s: float = 15.0
    # Retry-After on 503; a slot typically frees within a generation or two.
    retry_after_s: int = 1
    # The grammar-compile lane: threads, line, deadline, cache (see `grammarlane`).
    grammar: LaneLimits = field(default_factory=LaneLimits)


SETTINGS = web.AppKey("settings", Settings)
ENGINE = web.AppKey("engine", Engine)
ADMISSION = web.AppKey("admission", Admission)
# The side lane's own slots and queue (only when the engine has a side lane), so
# requests waiting for a side thread never hold the batch's slots.
SIDE_ADMISSION = web.AppKey("side_admission", Admission)
METRICS = web.AppKey("metrics", FallbackMetrics)
# The generation engine in use (threads or batched); the name predates the interface.
WORKERS = web.AppKey("workers", GenerationEngine)
