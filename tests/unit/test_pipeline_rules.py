"""The pipeline's pure decisions: the retry rule, the retry budget, redirect rewriting."""

from __future__ import annotations

from typing import get_args

import pytest

from proxy.control.retrybudget import RetryBudget, backoff, retry_after_s
from proxy.pipeline.attempts import Decision, next_step
from proxy.pipeline.record import AttemptKind, AttemptResult
from proxy.policy.ladder import FailoverPolicy

POL = FailoverPolicy()


def step(result: AttemptResult, **kw: object) -> Decision:
    args: dict[str, object] = {
        "retries": 0,
        "remaining_s": 30.0,
        "larger_window_next": False,
        "rand": lambda: 1.0,
    }
    args.update(kw)
    return next_step(result, POL, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", get_args(AttemptKind))
def test_only_a_failure_before_the_first_byte_moves_on(kind: AttemptKind) -> None:
    result = AttemptResult(kind, "primary", 502, "error")
    assert step(result).step == ("next" if kind == "failed" else "return")


@pytest.mark.parametrize("reason", ["http_500", "http_502", "http_503", "http_429", "reset"])
def test_a_transient_failure_is_retried_on_the_same_backend_once(reason: str) -> None:
    result = AttemptResult("failed", "primary", 500, "error", retry=reason)
    first = step(result)
    assert first == Decision("retry", reason, POL.retry_backoff_s)  # rand 1.0: no jitter cut
    assert step(result, retries=1) == Decision("next", reason)  # retry_max 1: then fail over


def test_backoff_is_jittered_and_bounded_by_the_deadline() -> None:
    result = AttemptResult("failed", "primary", 500, "error", retry="http_500")
    assert step(result, rand=lambda: 0.0).delay == pytest.approx(POL.retry_backoff_s / 2)
    assert step(result, remaining_s=0.01).step == "next"


@pytest.mark.parametrize(
    ("fault", "status"),
    [("first_byte_timeout", 504), ("truncated", 502), ("connect", 502), ("http_504", 504)],
)
def test_timeouts_and_silent_backends_fail_over_at_once(fault: str, status: int) -> None:
    result = AttemptResult("failed", "primary", status, "error", fault=fault)
    assert step(result) == Decision("next", fault)


def test_retry_after_is_honoured_when_it_fits() -> None:
    result = AttemptResult("failed", "primary", 429, "error", retry="http_429", retry_after=1.0)
    assert step(result) == Decision("retry", "http_429", 1.0)
    assert step(result, remaining_s=0.9).step == "next"  # past the request's deadline
    longer = result._replace(retry_after=POL.retry_after_max_s + 1)
    assert step(longer).step == "next"  # longer than the policy waits


def test_context_too_long_goes_to_a_larger_window_or_ends() -> None:
    result = AttemptResult("refused", "primary", 400, "rejected", code="context_length_exceeded")
    assert step(result, larger_window_next=True) == Decision("next", "context_length")
    assert step(result).step == "return"
    other = result._replace(code="content_policy_violation")
    assert step(other, larger_window_next=True).step == "return"


def test_unsupported_fields_move_on() -> None:
    result = AttemptResult("refused", "fallback", 503, "rejected", code="unsupported_fields")
    assert step(result) == Decision("next", "unsupported_fields")


def test_retry_budget_is_a_share_of_requests_plus_a_floor() -> None:
    budget = RetryBudget()
    for _ in range(20):
        budget.request(0.0, 10.0)
    granted = sum(budget.take(1.0, 10.0, 0.2, 3) for _ in range(20))
    assert granted == 20 * 0.2 + 3  # 7
    # The previous window still counts, then it is forgotten.
    assert not budget.take(12.0, 10.0, 0.2, 3)
    assert budget.take(25.0, 10.0, 0.2, 3)


def test_backoff_grows_and_caps() -> None:
    assert backoff(1, 0.1, 1.0, lambda: 1.0) == pytest.approx(0.1)
    assert backoff(3, 0.1, 1.0, lambda: 1.0) == pytest.approx(0.4)
    assert backoff(10, 0.1, 1.0, lambda: 0.0) == pytest.approx(0.5)
    assert retry_after_s("2") == 2.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None


def test_relative_location_keeps_same_origin_redirects_only() -> None:
    from unittest.mock import MagicMock

    from yarl import URL

    from proxy.pipeline.passthrough import relative_location

    up = MagicMock()
    up.base = URL("http://10.0.0.5:8000")
    assert relative_location(up, "http://10.0.0.5:8000/v1/models?x=1") == "/v1/models?x=1"
    assert relative_location(up, "/v1/models") == "/v1/models"
    assert relative_location(up, "http://evil.example/v1/models") is None
    assert relative_location(up, "") is None
