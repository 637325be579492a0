"""Policy loading: defaults, ${ENV}, FILE:LINE errors, and the CLI check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.policy import PolicyError, load_policy, parse_policy
from proxy.policy.schema import knobs

ROOT = Path(__file__).resolve().parents[2]


def errors(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", env or {})
    return info.value.lines()


def test_minimal_policy_gets_defaults() -> None:
    p = parse_policy("backends:\n  primary:\n    url: http://127.0.0.1:8000\n", env={})
    assert p.backends.primary.kind == "vllm"
    assert p.backends.fallback is None
    assert p.server.port == 8080
    assert p.sessions.ttl_s == 86400
    assert p.backends.primary.timeouts.idle_s == 30.0


def test_shipped_policies_are_valid() -> None:
    for name in ("default.yaml", "quickstart.yaml"):
        p = load_policy(ROOT / "policies" / name, env={})
        assert p.backends.fallback is not None
    p = load_policy(ROOT / "policies" / "default.yaml", env={})
    assert p.backends.primary.url == "http://127.0.0.1:8000"
    assert p.backends.fallback is not None
    assert p.backends.fallback.url == "http://127.0.0.1:8001"


def test_env_interpolation() -> None:
    text = (
        "server:\n  admin_token: ${TOK}\n  port: ${PORT:-9000}\n"
        "backends:\n  primary:\n    url: http://${HOST}:8000\n"
    )
    p = parse_policy(text, env={"TOK": "s3cret", "HOST": "vllm"})
    assert p.server.admin_token == "s3cret"
    assert p.server.port == 9000
    assert p.backends.primary.url == "http://vllm:8000"
    assert errors(text, {"HOST": "x"}) == [
        "p.yaml:2: server.admin_token: environment variable TOK is not set"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "backends:\n  primary:\n    url: http://x:1\n    kind: tgi\n",
            "p.yaml:4: backends.primary.kind: 'tgi' is not one of vllm | transformers | openai",
        ),
        (
            "server:\n  port: lots\nbackends:\n  primary: {url: http://x:1}\n",
            "p.yaml:2: server.port: expected an integer, got 'lots'",
        ),
        (
            "backends:\n  primary: {url: http://x:1}\nsesions: {}\n",
            "p.yaml:3: sesions: unknown key",
        ),
        ("server: {}\n", "p.yaml:1: backends: missing required key"),
        (
            "backends:\n  primary:\n    url: ftp://x\n",
            "p.yaml:3: backends.primary.url: not an http(s) URL: 'ftp://x'",
        ),
        ("backends:\n  primary: [1, 2\n", "p.yaml:3: YAML syntax:"),
        (
            "backends:\n  primary: {url: http://x:1}\nserver:\n  heartbeat_s: true\n",
            "p.yaml:4: server.heartbeat_s: expected a number, got True",
        ),
        (
            "backends:\n  primary: {url: http://x:1}\nserver:\n  api_keys: k1\n",
            "p.yaml:4: server.api_keys: expected a list",
        ),
    ],
)
def test_errors_name_the_line(text: str, expected: str) -> None:
    assert any(line.startswith(expected) for line in errors(text)), errors(text)


def test_every_error_is_reported_not_just_the_first() -> None:
    text = (
        "server:\n  port: x\n  bogus: 1\nbackends:\n  primary:\n    url: http://x:1\n    kind: y\n"
    )
    assert [line.split(":")[1] for line in errors(text)] == ["2", "3", "7"]


def test_policy_fields_cover_every_knob() -> None:
    keys = {k.path for k in knobs()}
    assert "backends.primary.timeouts.first_byte_s" in keys
    assert "server.heartbeat_s" in keys
    assert "source" not in keys


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_cli_check(tmp_path: Path) -> None:
    ok = _check(ROOT / "policies" / "default.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  primary:\n    url: http://x:1\n    timeouts:\n      idle: 3\n")
    res = _check(bad)
    assert res.returncode != 0
    assert res.stderr.startswith(f"{bad}:5: backends.primary.timeouts.idle: unknown key")
    missing = _check(tmp_path / "nope.yaml")
    assert missing.returncode != 0
    assert "nope.yaml:1: cannot read file" in missing.stderr


def test_policy_reference_doc_is_current() -> None:
    from proxy.policy.doc import render

    committed = (ROOT / "docs" / "policy-reference.md").read_text()
    assert committed == render(), "run: python -m proxy.policy.doc > docs/policy-reference.md"
