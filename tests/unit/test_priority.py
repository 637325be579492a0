"""Priorities: `key_priorities` entries and what `X-Priority` may do."""

from __future__ import annotations

import pytest

from proxy.policy import Grant, PolicyError, parse_key_priority, parse_policy
from proxy.runtime.generation import Runtime
from proxy.telemetry.metrics import Metrics


def test_entries() -> None:
    assert parse_key_priority("sk-a=normal") == ("sk-a", Grant("normal", "normal"))
    assert parse_key_priority("sk-b=sheddable..critical") == (
        "sk-b",
        Grant("sheddable", "critical"),
    )
    assert parse_key_priority("c2stYw==x=critical")[0] == "c2stYw==x"  # keys may hold "="


@pytest.mark.parametrize(
    "entry", ["sk-secret", "=normal", "sk-secret=urgent", "sk-secret=normal..", "sk-secret=.."]
)
def test_bad_entries_never_echo_the_key(entry: str) -> None:
    with pytest.raises(ValueError, match="KEY=PRIORITY") as info:
        parse_key_priority(entry)
    assert "sk-secret" not in str(info.value)


def test_a_ceiling_below_the_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="below"):
        parse_key_priority("sk-a=normal..sheddable")


@pytest.mark.parametrize(
    ("grant", "header", "expected"),
    [
        (Grant("normal", "normal"), None, "normal"),
        (Grant("normal", "normal"), "critical", "normal"),  # never raised
        (Grant("normal", "normal"), "sheddable", "sheddable"),  # lowered
        (Grant("normal", "normal"), "urgent", "normal"),
        (Grant("sheddable", "normal"), "critical", "normal"),  # up to the ceiling
        (Grant("sheddable", "normal"), "normal", "normal"),
        (Grant("normal", "critical"), "critical", "critical"),
        (Grant("normal", "critical"), None, "normal"),
    ],
)
def test_the_header_rule(grant: Grant, header: str | None, expected: str) -> None:
    assert grant.for_header(header) == expected


POLICY = """
backends:
  primary: {url: "http://127.0.0.1:9"}
ladder:
  throttle:
    default_priority: sheddable
    key_priorities: ["sk-app=normal", "sk-gw=normal..critical"]
"""


@pytest.mark.parametrize(
    ("key", "header", "expected"),
    [
        # Issue 14 item 10: a client without an entry asked for critical and got it
        # (evicting queued normal requests, escaping the throttle tier's shedding).
        (None, "critical", "sheddable"),
        ("sk-unknown", "critical", "sheddable"),
        ("sk-unknown", "normal", "sheddable"),
        (None, None, "sheddable"),
        ("sk-app", "critical", "normal"),
        ("sk-app", "sheddable", "sheddable"),
        ("sk-gw", "critical", "critical"),
        ("sk-gw", None, "normal"),
    ],
)
def test_priority_for(key: str | None, header: str | None, expected: str) -> None:
    rt = Runtime(policy=parse_policy(POLICY), metrics=Metrics())
    assert rt.priority_for(header, key) == expected


def test_the_policy_check_names_the_entry_format() -> None:
    bad = POLICY.replace("sk-gw=normal..critical", "sk-gw=normal..urgent")
    with pytest.raises(PolicyError) as info:
        parse_policy(bad, "p.yaml")
    text = str(info.value)
    assert "p.yaml:7:" in text and "KEY=PRIORITY..MAX" in text
    assert "sk-gw" not in text
