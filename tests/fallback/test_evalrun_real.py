"""The eval runner against the real Transformers fallback server on the tiny
model: the mechanics end to end (the random model passes only checks that
pass anything, and fails one that needs a real answer)."""

from __future__ import annotations

import time

from proxy.backends.upstream import Upstream, make_session
from proxy.control.breaker import BackendBreaker
from proxy.policy import parse_policy
from proxy.policy.evalset import parse_evalset
from proxy.runtime.evalrun import run_eval
from tests.fallback.conftest import FallbackServer

EVALSET = parse_evalset(
    """
questions:
  - id: anything
    prompt: "Say anything."
    max_tokens: 8
    checks: [{regex: ".*"}, {json: false}]
  - id: chat
    messages:
      - {role: system, content: "You are terse."}
      - {role: user, content: "What is the capital of France?"}
    max_tokens: 8
    checks: [{regex: "(?s).*"}, {equals: "Paris, of course, said the random model"}]
  - id: third
    prompt: "One more."
    max_tokens: 4
    checks: [{json: false}]
""",
    "eval.yaml",
)


async def test_the_eval_set_runs_against_the_real_fallback_server(
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
        await up.discover()
        assert up.served_model == server.served_model_name
        result = await run_eval(EVALSET, up, timeout_s=60)
    finally:
        await up.session.close()
    assert result.arm == "primary"
    assert result.errors == 0, result.failures
    assert (result.passed, result.total) == (4, 5)
    assert result.failures == (("chat", "1/2 checks passed; failed: equals"),)
    assert result.score == 0.8
