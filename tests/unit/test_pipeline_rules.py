"""The pipeline's pure decisions: the retry rule and redirect rewriting."""

from __future__ import annotations

from typing import get_args

import pytest

from proxy.pipeline.attempts import next_step
from proxy.pipeline.record import AttemptKind, AttemptResult


@pytest.mark.parametrize("kind", get_args(AttemptKind))
def test_only_a_failure_before_the_first_byte_moves_on(kind: AttemptKind) -> None:
    result = AttemptResult(kind, "primary", 502, "error")
    assert next_step(result) == ("next" if kind == "failed" else "return")


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
