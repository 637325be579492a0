"""What a running proxy holds: the policy, its upstreams, its metrics.

One `Runtime` per app, stored under an `AppKey`; handlers read it, nothing
lives at module level.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import Counter

from proxy.config import Policy, Tier
from proxy.metrics import BackendMetrics, Metrics
from proxy.upstream import Upstream

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


@dataclass
class Runtime:
    policy: Policy
    metrics: Metrics
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    backend_metrics: dict[str, BackendMetrics] = field(default_factory=dict)
    tier: Tier = "normal"
    inflight: int = 0
    started_at: float = field(default_factory=time.time)
    _request_counters: dict[tuple[str, str, int], Counter] = field(default_factory=dict)

    def add_upstream(self, upstream: Upstream) -> None:
        self.upstreams[upstream.name] = upstream
        self.backend_metrics[upstream.name] = self.metrics.for_backend(upstream.name)

    def candidates(self) -> list[Upstream]:
        """Backends to try for a request, in order. The ladder (tier 2+) will
        reorder this; until then: the primary, then the fallback on connect
        failure when the policy allows it."""
        out = [self.upstreams["primary"]]
        fb = self.upstreams.get("fallback")
        if fb is not None and self.policy.ladder.failover.on_connect_error:
            out.append(fb)
        return out

    def count_request(self, backend: str, endpoint: str, status: int) -> None:
        key = (backend, endpoint, status)
        child = self._request_counters.get(key)
        if child is None:
            child = self.metrics.requests.labels(backend, endpoint, str(status))
            self._request_counters[key] = child
        child.inc()


def request_id(incoming: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, a fresh one otherwise."""
    if incoming and _REQUEST_ID_RE.match(incoming):
        return incoming
    return uuid.uuid4().hex
