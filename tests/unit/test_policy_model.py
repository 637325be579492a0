"""The policy model as users meet it: ranges and cross-field rules reported
by `brownout check` with FILE:LINE, the JSON Schema editors use, the
generated default policy, secrets that never leave the process, knobs that
need a restart, and a `check` that loads no server code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from proxy.policy import (
    PolicyError,
    defaults,
    doc,
    jsonschema,
    load_policy,
    parse_policy,
    policy_diff,
    split_restart,
)
from proxy.policy.diff import flatten, redact_url
from proxy.policy.schema import knobs

ROOT = Path(__file__).resolve().parents[2]
PRIMARY = "backends:\n  primary:\n    url: http://127.0.0.1:8000\n"


def check(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(path), *extra],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


# Every example of issue 16 that used to be accepted, in one file: all of
# them must be reported at once, each at its own line.
BROKEN = """\
backends:
  primary:
    url: http://127.0.0.1:8000
    timeouts: {idle_s: 10}
server:
  heartbeat_s: 20
ladder:
  breaker:
    failure_rate: 3
  throttle:
    clear_ratio: 2
    min_limit: 500
    max_inflight: 64
    decrease_factor: 1.5
    kv_cache_high: 95
    queue_size: -1
    queue_timeout_s: 0
  recovery:
    window_s: 0
    min_dwell_s: -5
    healthy_windows: 0
    ramp: [0.5, 0.2, 7]
  maintenance:
    retry_after_s: -1
faq:
  threshold: 9
"""

EXPECTED = [
    "6: server.heartbeat_s: must be shorter than backends.primary.timeouts.idle_s (10 s)",
    "9: ladder.breaker.failure_rate: must be <= 1, got 3.0",
    "11: ladder.throttle.clear_ratio: must be < 1, got 2.0",
    "12: ladder.throttle.min_limit: must be <= max_inflight (64), got 500",
    "14: ladder.throttle.decrease_factor: must be < 1, got 1.5",
    "15: ladder.throttle.kv_cache_high: must be <= 1, got 95.0",
    "16: ladder.throttle.queue_size: must be >= 0, got -1",
    "17: ladder.throttle.queue_timeout_s: must be > 0, got 0.0",
    "19: ladder.recovery.window_s: must be >= 0.01, got 0.0",
    "20: ladder.recovery.min_dwell_s: must be >= 0, got -5.0",
    "21: ladder.recovery.healthy_windows: must be >= 1, got 0",
    "22: ladder.recovery.ramp[2]: must be <= 1, got 7.0",
    "24: ladder.maintenance.retry_after_s: must be >= 0, got -1",
    "26: faq.threshold: must be <= 1, got 9.0",
]


def test_check_reports_every_broken_knob_at_once_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    res = check(bad)
    assert res.returncode == 1
    got = res.stderr.splitlines()
    assert len(got) == len(EXPECTED), res.stderr
    for line, want in zip(got, EXPECTED, strict=True):
        assert line.startswith(f"{bad}:{want}"), (line, want)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "ladder:\n  recovery:\n    ramp: [0.5, 0.2, 1]\n",
            "6: ladder.recovery.ramp: shares must rise",
        ),
        ("ladder:\n  recovery:\n    ramp: [0.2, 0.5]\n", "6: ladder.recovery.ramp: must end at 1"),
        ("ladder:\n  recovery:\n    ramp: []\n", "6: ladder.recovery.ramp: must list at least"),
        ("ladder:\n  recovery:\n    ramp: [0, 1]\n", "6: ladder.recovery.ramp[0]: must be > 0"),
        (
            "ladder:\n  throttle:\n    mode: fixed\n    throttled_limit: 100\n",
            "7: ladder.throttle.throttled_limit: must be <= max_inflight (64)",
        ),
        (
            "sessions:\n  trimming:\n    low_water: 0.95\n",
            "6: sessions.trimming.low_water: must be < high_water (0.9)",
        ),
        ("server:\n  port: 70000\n", "5: server.port: must be <= 65535"),
        ("server:\n  heartbeat_s: .nan\n", "5: server.heartbeat_s: expected a number"),
        (
            "ladder:\n  throttle:\n    baseline_window_s: 30\n",
            "6: ladder.throttle.baseline_window_s: must be longer than ttft_window_s",
        ),
        (
            "ladder:\n  throttle:\n    key_priorities: ['k1=urgent']\n",
            "6: ladder.throttle.key_priorities: item 0 is not KEY=",
        ),
        (
            "    probe:\n      body: '[1, 2]'\n",
            "5: backends.primary.probe.body: must be a JSON object",
        ),
        (
            "    probe:\n      body: '{\"messages\": '\n",
            "5: backends.primary.probe.body: must be a JSON object",
        ),
        (
            "    probe:\n      path: v1/chat/completions\n",
            "5: backends.primary.probe.path: must start with '/'",
        ),
    ],
)
def test_cross_field_and_range_rules(section: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(PRIMARY + section, "p.yaml", env={})
    assert any(line.startswith(f"p.yaml:{message}") for line in info.value.lines()), info.value


def test_heartbeat_zero_turns_heartbeats_off_and_passes_the_rule() -> None:
    p = parse_policy(PRIMARY + "    timeouts: {idle_s: 1}\nserver:\n  heartbeat_s: 0\n", env={})
    assert p.server.heartbeat_s == 0


def test_every_default_is_inside_its_own_range() -> None:
    for k in knobs():
        bounds = k.meta.get("bounds")
        default = k.default
        if bounds is None or default is None:
            continue
        for v in default if isinstance(default, tuple) else (default,):
            assert bounds.violation(v) is None, (k.path, v)


# --------------------------------------------------------------------------- generated files


def test_default_policy_is_generated_and_writes_out_every_knob() -> None:
    committed = (ROOT / "policies" / "default.yaml").read_text()
    assert committed == defaults.render(), (
        "run: python -m proxy.policy.defaults > policies/default.yaml"
    )
    written = set(_leaves(yaml.safe_load(committed)))
    # backends.candidate is written as null (no rollout unless configured).
    every = {k.path for k in knobs() if not k.path.startswith("backends.candidate.")}
    assert written == every | {"backends.candidate"}
    p = load_policy(ROOT / "policies" / "default.yaml", env={})
    assert p.server.host == "0.0.0.0"
    assert p.backends.fallback is not None
    assert p.backends.fallback.kind == "transformers"


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_reference_and_schemas_are_current() -> None:
    assert (ROOT / "docs" / "policy-reference.md").read_text() == doc.render()
    assert (ROOT / "policies" / "policy.schema.json").read_text() == jsonschema.render()
    assert (ROOT / "policies" / "faq.schema.json").read_text() == jsonschema.render(faq=True)
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "schema"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert json.loads(out.stdout) == jsonschema.policy_schema()


def test_reference_shows_ranges_and_reload_column() -> None:
    text = doc.render()
    assert "| range | reload |" in text
    assert "| `server.port` | `int` | `8080` | 1 ≤ x ≤ 65535 | restart |" in text
    assert (
        "| `ladder.throttle.kv_cache_high` | `number` | `0.95` | 0 < x ≤ 1 ratio | live |" in text
    )


def _validator(faq: bool = False) -> Draft202012Validator:
    schema = jsonschema.policy_schema(faq)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _shipped() -> list[tuple[str, str]]:
    files = [
        (str(p), p.read_text())
        for p in sorted((ROOT / "policies").glob("*.yaml"))
        if not p.name.startswith("eval.")  # eval sets: tests/unit/test_evalset.py
    ]
    files.append(
        ("docker/brownout/policy.yaml", (ROOT / "docker/brownout/policy.yaml").read_text())
    )
    k8s = ROOT / "deploy/k8s/base/policy"
    files.append(("configmap policy.yaml", (k8s / "policy.yaml").read_text()))
    files.append(("configmap faq.yaml", (k8s / "faq.yaml").read_text()))
    return files


def test_every_shipped_policy_validates_against_the_schema() -> None:
    assert len(_shipped()) >= 6
    for name, text in _shipped():
        is_faq = name.endswith("faq.yaml")
        errors = [e.message for e in _validator(is_faq).iter_errors(yaml.safe_load(text))]
        assert errors == [], name
        if name.startswith(str(ROOT / "policies")):
            wanted = "faq.schema.json" if is_faq else "policy.schema.json"
            assert text.startswith(f"# yaml-language-server: $schema={wanted}\n"), name


# Broken per knob: the validator and the schema must both refuse each.
PER_KNOB = [
    "server:\n  port: 0\n",
    "server:\n  port: lots\n",
    "server:\n  bogus: 1\n",
    "server:\n  log_level: loud\n",
    "ladder:\n  breaker:\n    failure_rate: 3\n",
    "ladder:\n  throttle:\n    clear_ratio: 2\n",
    "ladder:\n  throttle:\n    kv_cache_high: 95\n",
    "ladder:\n  throttle:\n    queue_size: -1\n",
    "ladder:\n  throttle:\n    queue_timeout_s: 0\n",
    "ladder:\n  throttle:\n    mode: turbo\n",
    "ladder:\n  recovery:\n    window_s: 0\n",
    "ladder:\n  recovery:\n    ramp: [0.5, 7]\n",
    "ladder:\n  maintenance:\n    status_code: 502\n",
    "faq:\n  threshold: 9\n",
    "sessions:\n  max_turns: 0\n",
    "guard:\n  repetition:\n    min_repeats: 1\n",
]


@pytest.mark.parametrize("section", PER_KNOB)
def test_schema_agrees_with_the_validator(section: str) -> None:
    text = PRIMARY + section
    with pytest.raises(PolicyError):
        parse_policy(text, env={})
    assert list(_validator().iter_errors(yaml.safe_load(text))), section
    # The same file without the broken part is fine for both.
    assert not list(_validator().iter_errors(yaml.safe_load(PRIMARY)))


def test_schema_accepts_env_placeholders_where_numbers_go() -> None:
    text = PRIMARY + "server:\n  port: ${PORT:-9000}\n"
    assert not list(_validator().iter_errors(yaml.safe_load(text)))
    assert parse_policy(text, env={}).server.port == 9000


def test_schema_requires_the_primary_url() -> None:
    errors = list(_validator().iter_errors({"backends": {"primary": {}}}))
    assert any("'url' is a required property" in e.message for e in errors)


# --------------------------------------------------------------------------- secrets


def _policy(extra: str = "", url: str = "http://127.0.0.1:8000") -> Any:
    return parse_policy(f"backends:\n  primary:\n    url: {url}\n" + extra, env={})


def test_diff_redacts_by_the_schema_mark_not_by_key_name() -> None:
    old = _policy()
    new = _policy(
        "  fallback:\n    url: http://bob:hunter2@fb:8001\n    api_key: sk-fallback-secret\n"
        "server:\n  admin_token: t0ps3cret\n  api_keys: [client-key-1]\n"
        "sessions:\n  store: redis://:redispass@redis:6379/0\n"
        "  trimming: {margin_tokens: 99}\n"
        "ladder:\n  shared: {redis: 'redis://user:sharedpass@r:6379/1'}\n"
        "  throttle: {key_priorities: ['vip-key=critical']}\n",
    )
    lines = policy_diff(old, new)
    text = "\n".join(lines)
    for secret in (
        "hunter2",
        "sk-fallback-secret",
        "t0ps3cret",
        "client-key-1",
        "redispass",
        "sharedpass",
        "vip-key",
        "bob",
    ):
        assert secret not in text, secret
    assert "+ backends.fallback.api_key: '<redacted>'" in lines
    assert "+ backends.fallback.url: 'http://***@fb:8001'" in lines
    assert "~ sessions.trimming.margin_tokens: 64 -> 99" in lines
    assert "~ ladder.throttle.key_priorities: () -> ('<redacted>=critical',)" in lines
    assert "~ sessions.store: 'memory://' -> 'redis://***@redis:6379/0'" in lines


def test_redact_url() -> None:
    assert redact_url("http://u:p@h:1/x?y=1") == "http://***@h:1/x?y=1"
    assert redact_url("http://h:1/x") == "http://h:1/x"
    assert redact_url("redis://:p@h/0") == "redis://***@h/0"


# --------------------------------------------------------------------------- restart


def test_restart_only_knobs_keep_their_running_value() -> None:
    old = _policy("server:\n  port: 8080\n  log_level: info\n  body_timeout_s: 30\n")
    new = _policy("server:\n  port: 9090\n  log_level: debug\n  body_timeout_s: 5\n")
    kept, waiting = split_restart(old, new)
    assert waiting == ["server.log_level", "server.port"]
    assert kept.server.port == 8080
    assert kept.server.log_level == "info"
    assert kept.server.body_timeout_s == 5.0  # live knobs do change
    lines = policy_diff(old, new)
    assert "~ server.port: 8080 -> 9090  (needs restart)" in lines
    assert "~ server.body_timeout_s: 30.0 -> 5.0" in lines


def test_check_diff_lists_what_needs_a_restart(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(PRIMARY)
    b.write_text(PRIMARY + "server:\n  port: 9999\n  heartbeat_s: 5\n")
    res = check(a, "--diff", str(b))
    assert res.returncode == 0, res.stderr
    assert "~ server.port: 8080 -> 9999  (needs restart)" in res.stdout
    assert "~ server.heartbeat_s: 15.0 -> 5.0\n" in res.stdout


def test_flatten_skips_internal_fields() -> None:
    assert "source" not in flatten(_policy())


# --------------------------------------------------------------------------- leaf


def test_policy_package_is_a_leaf() -> None:
    code = (
        "import sys; import proxy.policy; from proxy.cli import main;"
        "rc = main(['check', 'policies/default.yaml']);"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('aiohttp', 'redis', 'pybreaker', 'structlog', 'prometheus_client', 'torch'));"
        "other = sorted(m for m in sys.modules if m.startswith('proxy.')"
        " and not m.startswith('proxy.policy') and m != 'proxy.cli');"
        "print(rc, heavy, other)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.splitlines()[-1] == "0 [] []", out.stdout
