"""Drill 8's pure parts: verdicts on hostile replies, its policy, its counters,
its figures and their report (no servers; the drill itself is in
test_chaos_short.py)."""

from __future__ import annotations

import json
import re

import pytest

from proxy.policy.loader import parse_policy
from tests.chaos.drill import Req
from tests.chaos.hostile import (
    KINDS,
    HostileReq,
    deep_schema,
    hostile_policy,
    judge,
    kinds,
    metric_values,
    summarize,
)
from tests.chaos.report import hostile_section
from tests.chaos.scenarios import DRILLS

SSE = "text/event-stream"
JSON = "application/json"


def err(code: str | None, etype: str = "invalid_request_error") -> bytes:
    return json.dumps(
        {"error": {"message": "m", "type": etype, "param": None, "code": code}}
    ).encode()


@pytest.mark.parametrize(
    ("status", "ctype", "raw", "transport", "verdict", "code"),
    [
        (400, JSON, err("invalid_schema"), "", "clear_error", "invalid_schema"),
        (504, JSON, err("total_timeout"), "", "clear_error", "total_timeout"),
        (502, JSON, err("everywhere"), "", "clear_error", "everywhere"),
        (429, JSON, err("rate_limit_exceeded"), "", "clear_error", "rate_limit_exceeded"),
        # A 500 is no clear error, whatever its body says.
        (500, JSON, err(None, "server_error"), "", "bad", "server_error"),
        (503, JSON, err("maintenance"), "", "bad", "maintenance"),
        # In-band error in a stream that ends properly: the client knows.
        (200, SSE, b"data: " + err("upstream_timeout") + b"\n\ndata: [DONE]\n\n", "", "clear_error",
         "upstream_timeout"),
        # A stream cut without a word: bad.
        (200, SSE, b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', "", "bad",
         "no finish_reason and [DONE]"),
        (200, SSE, b"", "ClientPayloadError", "bad", "transport:ClientPayloadError"),
        (200, JSON, b'{"choices": [{"finish_reason": "length", "message": {}}]}', "", "answer", ""),
    ],
)  # fmt: skip
def test_judge(
    status: int, ctype: str, raw: bytes, transport: str, verdict: str, code: str
) -> None:
    assert judge(status, ctype, raw, transport) == (verdict, code)


def test_hostile_bodies_are_what_the_issue_names() -> None:
    k = kinds(100_000)
    assert k["poison:repetition_penalty"]["repetition_penalty"] == 1e-300
    assert k["poison:temperature"]["temperature"] == 1e-300
    assert k["poison:top_p"]["top_p"] == 1e-300
    enum = k["schema:enum-fb"]["response_format"]["json_schema"]["schema"]["enum"]
    assert len(enum) == len(set(enum)) == 100_000
    depth, s = 0, k["schema:deep200"]["response_format"]["json_schema"]["schema"]
    while s.get("type") == "object":
        s, depth = s["properties"]["a"], depth + 1
    assert depth == 200
    assert k["long:non-stream"].get("stream") is not True
    # Each `-fb` kind asks for more than the primary's 1,024-token window.
    assert all(v["max_tokens"] > 1000 for n, v in k.items() if "-fb" in n)
    assert set(KINDS) == set(k)
    # Every body is JSON as sent (no inf/nan, which json.dumps would write bare).
    json.dumps(k, allow_nan=False)
    assert deep_schema(0) == {"type": "string"}


POLICY = """server:
  admin_token: x
  heartbeat_s: 1
backends:
  primary:
    url: http://127.0.0.1:1
    kind: vllm
    timeouts: {connect_s: 1, first_byte_s: 10.0, idle_s: 3.0}
  fallback:
    url: http://127.0.0.1:2
    kind: transformers
    timeouts: {connect_s: 1, first_byte_s: 30.0, idle_s: 10.0}
"""


def test_hostile_policy_sets_primary_first_byte_and_both_total() -> None:
    text = hostile_policy(POLICY, 4.0, 30.0)
    pol = parse_policy(text)
    assert pol.backends.primary.timeouts.first_byte_s == 4.0
    assert pol.backends.fallback.timeouts.first_byte_s == 30.0
    assert pol.backends.primary.timeouts.total_s == 30.0
    assert pol.backends.fallback.timeouts.total_s == 30.0
    with pytest.raises(RuntimeError):
        hostile_policy("backends: {}\n", 4.0, 30.0)


SCRAPE = """# HELP brownout_failures_total Failed attempts
# TYPE brownout_failures_total counter
brownout_failures_total{attribution="request",backend="primary",fault="http_400"} 3.0
brownout_failures_total{attribution="request",backend="fallback",fault="http_500"} 2.0
brownout_breaker_transitions_total{backend="fallback",from="closed",to="open"} 1.0
brownout_requests_total{status="200"} 9.0
"""


def test_metric_values_and_deltas() -> None:
    before = metric_values(SCRAPE.replace("3.0", "1.0").replace("} 1.0\nbrownout_req", "} 1.0\nx"))
    after = metric_values(SCRAPE)
    assert "brownout_requests_total" not in after
    assert (
        after["brownout_failures_total"][
            '{attribution="request",backend="primary",fault="http_400"}'
        ]
        == 3.0
    )
    h = summarize([], [], before, after, 4.0)
    assert h.metrics["brownout_failures_total"] == {
        '{attribution="request",backend="primary",fault="http_400"}': 2.0
    }
    # Unchanged counters are left out; an opened breaker shows.
    assert "brownout_breaker_transitions_total" not in h.metrics
    h = summarize([], [], {}, after, 4.0)
    assert h.metrics["brownout_breaker_transitions_total"]


def _req(outcome: str, backend: str = "primary", code: str = "") -> Req:
    r = Req("steady", "s", 1, 0.0, 1.0, backend=backend, code=code)
    r.outcome = outcome  # type: ignore[assignment]
    return r


def test_summary_counts_others_and_hostile_and_the_report_says_it() -> None:
    others = [_req("complete"), _req("complete", "fallback"), _req("error", code="502:x")]
    hostile = [
        HostileReq("poison:top_p", 0.0, 0.1, 200, verdict="answer"),
        HostileReq("schema:deep200", 0.0, 0.1, 400, "invalid_schema", verdict="clear_error"),
        HostileReq("schema:deep200", 0.0, 0.1, 400, "invalid_schema", verdict="clear_error"),
        HostileReq("poison:repetition_penalty-fb", 0, 0.2, 500, "server_error", verdict="bad",
                   detail="inf/nan"),
        HostileReq("long:non-stream", 0.0, 6.0, 200, verdict="answer"),
        HostileReq("long:non-stream", 0.0, 2.0, 200, verdict="answer"),
    ]  # fmt: skip
    h = summarize(hostile, others, {}, {}, 4.0, {"primary": ["up/closed"]})
    assert (h.others_total, h.others_normal, h.others_fallback) == (3, 2, 1)
    assert h.others_bad == {"error (502:x)": 1}
    assert h.hostile_by_kind["schema:deep200"] == {"400 invalid_schema": 2}
    assert h.hostile_verdicts == {"answer": 3, "clear_error": 2, "bad": 1}
    assert h.slow_non_stream == (1, 2, 6.0)
    text = hostile_section(h)
    assert "2 of 3 answered normally = 66.7%" in text
    assert "| `schema:deep200` | 400 invalid_schema × 2 |" in text
    assert "inf/nan" in text
    assert re.search(r"longer than the primary's first_byte_s \(4 s.*1 of 2", text)


def test_drill_8_is_registered() -> None:
    spec = DRILLS["hostile"]
    assert spec.number == 8
    assert sorted(s.number for s in DRILLS.values()) == list(range(1, 10))
