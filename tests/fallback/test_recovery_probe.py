"""The default recovery probe against the real fallback server (issue 14 item 3).

The probe is a 1-token chat to the model the backend serves (read from its
/v1/models); the real Transformers server on the tiny model must take it, so
an open breaker towards it closes on the first probe after it recovered.
"""

from __future__ import annotations

import time

from proxy.backends.upstream import Upstream, make_session
from proxy.control.breaker import BackendBreaker
from proxy.policy import parse_policy
from tests.fallback.conftest import FallbackServer


async def test_the_default_probe_passes_on_the_real_fallback_server(
    server: FallbackServer,
) -> None:
    policy = parse_policy(
        f"backends:\n  primary:\n    url: {server.url}\n    kind: transformers\n", "p.yaml"
    )
    bp = policy.backends.primary
    up = Upstream(
        "primary",
        bp,
        make_session(bp),
        BackendBreaker("primary", policy.ladder.breaker, time.monotonic),
    )
    try:
        assert await up.recovery_probe() is None
        assert up.served_model == server.served_model_name
        assert up.probe_request() == {
            "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 1,
            "temperature": 0,
            "model": server.served_model_name,
        }
        assert up.probe_misconfigured is None
    finally:
        await up.session.close()
