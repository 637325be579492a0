"""`telemetry:` in the policy: checked like every section (FILE:LINE), its
secrets never shown, and tracing off unless a collector is named."""

from __future__ import annotations

import pytest

from proxy.policy import PolicyError, parse_policy, policy_diff, redact

BASE = "backends:\n  primary:\n    url: http://127.0.0.1:8000\n"


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(BASE + text, "p.yaml", env={})
    return info.value.lines()


def test_tracing_is_off_by_default() -> None:
    t = parse_policy(BASE, "p.yaml", env={}).telemetry
    assert t.otlp_endpoint == ""
    assert t.sample_ratio == 0.1  # what a traced request costs: bench/otel_ab.py


def test_a_collector_url_and_export_knobs_load() -> None:
    p = parse_policy(
        BASE
        + "telemetry:\n  otlp_endpoint: http://otel:4318/v1/traces\n"
        + "  otlp_headers: [Authorization=Bearer s3cret]\n  sample_ratio: 0.25\n",
        "p.yaml",
        env={},
    )
    assert p.telemetry.otlp_endpoint == "http://otel:4318/v1/traces"
    assert p.telemetry.otlp_headers == ("Authorization=Bearer s3cret",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("  otlp_endpoint: otel:4318\n", "p.yaml:5: telemetry.otlp_endpoint: not an http(s) URL"),
        ("  otlp_endpoint: http://otel:99999\n", "p.yaml:5: telemetry.otlp_endpoint: not a valid"),
        ("  otlp_headers: [novalue]\n", "p.yaml:5: telemetry.otlp_headers: must be NAME=value"),
        ("  otlp_headers: ['bad name=1']\n", "p.yaml:5: telemetry.otlp_headers: must be NAME="),
        ("  sample_ratio: 1.5\n", "p.yaml:5: telemetry.sample_ratio: must be <= 1"),
        ("  batch_delay_s: 0\n", "p.yaml:5: telemetry.batch_delay_s: must be > 0"),
        (
            "  max_queue_spans: 10\n  max_batch_spans: 20\n",
            "telemetry.max_batch_spans: must not exceed telemetry.max_queue_spans (10)",
        ),
    ],
)
def test_bad_telemetry_knobs_are_refused_with_their_line(text: str, message: str) -> None:
    lines = errors("telemetry:\n" + text)
    assert any(message in line for line in lines), lines


def test_collector_credentials_are_never_shown() -> None:
    lines = errors("telemetry:\n  otlp_headers: [novalue-s3cret]\n")
    assert not any("s3cret" in line for line in lines)
    assert redact("telemetry.otlp_headers", ("Authorization=Bearer s3cret",)) == ("<redacted>",)
    assert redact("telemetry.otlp_endpoint", "https://u:pw@otel:4318") == "https://***@otel:4318"
    old = parse_policy(BASE, "p.yaml", env={})
    new = parse_policy(
        BASE + "telemetry:\n  otlp_endpoint: https://u:pw@otel:4318\n", "p.yaml", env={}
    )
    [line] = policy_diff(old, new)
    assert "pw" not in line and "otel:4318" in line
