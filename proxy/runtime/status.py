"""The runtime's view for `GET /brownout/status`: what a running generation
holds, read only (moved out of `proxy.runtime.generation` to keep it under
~400 lines; no behaviour change)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from proxy.openai.capabilities import PLAIN
from proxy.policy import redact_url

if TYPE_CHECKING:
    from proxy.runtime.generation import Runtime


def status_of(rt: Runtime) -> dict[str, Any]:
    backends = {}
    for name, up in rt.upstreams.items():
        h = up.health
        backends[name] = {
            "url": redact_url(up.policy.url),
            "kind": up.policy.kind,
            "healthy": h.healthy,
            "down": up.down,
            "last_error": h.last_error,
            "last_probe_at": h.last_probe_at,
            "consecutive_probe_failures": h.consecutive_failures,
            "breaker": up.breaker.state,
            "breaker_detail": up.breaker.snapshot(),
            "model_breakers": {m: b.snapshot() for m, b in up.model_breakers.items()},
            "probe": {
                "path": up.policy.probe.path,
                "misconfigured": up.probe_misconfigured,
            },
            "model": up.policy.model or up.served_model,
            "max_model_len": up.max_model_len,
            # What failover may send it (issue 14): learnt at discovery / rescue.
            "supports_continuation": up.supports_continuation,
            "capabilities": (
                "openai" if up.caps is None else "plain" if up.caps is PLAIN else "advertised"
            ),
            "retries_in_window": up.retry_budget.retries,
            # Who its failures were charged to (proxy.control.attribution).
            "attribution": up.judge.ledger(up.breaker).snapshot(),
        }
    lad = rt.ladder.snapshot()
    lad["since"] = rt.wall(float(lad["since"]))  # type: ignore[arg-type]
    return {
        "tier": rt.ladder.tier,
        "ladder": lad,
        "history": [
            {
                "at": rt.wall(t.at),
                "from": t.from_tier,
                "to": t.to_tier,
                "reason": t.reason,
                "detail": t.detail,
            }
            for t in rt.ladder.history
        ],
        "backends": backends,
        "concurrency": {
            "limit": rt.admission.limit,
            "max": rt.policy.ladder.throttle.max_inflight,
            "inflight": rt.inflight,
            "admission": rt.admission.snapshot(),
        },
        "pressure": {
            "active": rt.pressure.active,
            "reason": rt.pressure.reason,
            "signals": {k: round(v, 3) for k, v in rt.pressure.ratios().items()},
            "engine": {
                "num_requests_waiting": rt.pressure.engine.waiting,
                "num_requests_running": rt.pressure.engine.running,
                "kv_cache_usage_perc": rt.pressure.engine.kv_cache,
                "scraped_at": rt.wall(rt.pressure.engine.scraped_at)
                if rt.pressure.engine.scraped_at is not None
                else None,
                "error": rt.pressure.engine.error,
            },
        },
        "sessions": {
            "store": redact_url(rt.policy.sessions.store),
            "healthy": rt.store.healthy,
            "last_error": rt.store.last_error,
            "saves_waiting": len(rt.pending_saves),
        },
        "shared": rt.shared.snapshot() if rt.shared is not None else {"enabled": False},
        "rollout": rt.canary.snapshot() if rt.canary is not None else {"state": "idle"},
        "policy": {"source": rt.policy.source},
        "uptime_s": round(time.time() - rt.started_at, 1),
    }
