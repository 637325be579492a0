from __future__ import annotations

import pytest

from proxy.openai.chunks import error_status, has_finish_reason, is_error_event


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"choices":[{"delta":{},"finish_reason":"stop"}]}', True),
        (b'{"choices":[{"delta":{},"finish_reason": "length"}]}', True),
        (b'{"choices":[{"delta":{"content":"x"},"finish_reason":null}]}', False),
        (b'{"choices":[{"delta":{"content":"x"}}]}', False),
        (b'{"choices":[{"delta":{"content":"\\"finish_reason\\":"}}]}', False),
    ],
)
def test_has_finish_reason(data: bytes, expected: bool) -> None:
    assert has_finish_reason(data) is expected


def test_error_event_detection_and_status() -> None:
    assert is_error_event(b'{"error": {"message": "x"}}')
    assert is_error_event(b'{ "error":{}}')
    assert not is_error_event(b'{"choices": []}')
    assert error_status(b'{"error": {"message": "x", "code": 503}}')[0] == 503
    assert error_status(b'{"error": {"message": "x", "code": "invalid_output"}}')[0] == 502
    assert error_status(b"{broken")[0] == 502
