"""Policy files nobody types by hand: alias bombs, huge numbers, tags, broken
`${ENV}`, odd bytes. `brownout check` answers each with `FILE:LINE: path:
message` lines and exit 1, fast, never a traceback; what it accepts, the
JSON Schema accepts too; and no error or diff line shows a secret."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from proxy.policy import PolicyError, jsonschema, parse_policy, policy_diff
from proxy.policy.diff import redact, redact_url

ROOT = Path(__file__).resolve().parents[2]
PRIMARY = "backends:\n  primary:\n    url: http://127.0.0.1:8000\n"


def errors(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml", env={} if env is None else env)
    return info.value.lines()


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )


def test_an_alias_bomb_is_refused_quickly_at_its_line() -> None:
    # 11 KB that the converter used to walk as a million values (10 s; the
    # same shape at 3000x3000 took over 100 s): faq entries aliasing one
    # entry whose keywords alias one long list.
    n = 1000
    text = (
        PRIMARY
        + "faq:\n  entries:\n    - &e\n      question: q\n      answer: a\n"
        + "      keywords: ["
        + ",".join(["w"] * n)
        + "]\n"
        + "".join("    - *e\n" for _ in range(n))
    )
    started = time.monotonic()
    lines = errors(text)
    assert time.monotonic() - started < 5
    assert len(lines) == 1
    assert re.match(r"p\.yaml:\d+: YAML aliases expand this file to more values", lines[0])


def test_aliases_that_repeat_a_little_are_fine() -> None:
    text = (
        "backends:\n  primary: &b\n    url: http://127.0.0.1:8000\n    drop_params: &d [a, b]\n"
        "  fallback:\n    url: http://127.0.0.1:8001\n    drop_params: *d\n"
    )
    p = parse_policy(text, env={})
    assert p.backends.fallback is not None and p.backends.fallback.drop_params == ("a", "b")


def test_a_number_with_thousands_of_digits_is_an_error_not_a_traceback() -> None:
    big = "9" * 5000
    assert errors(PRIMARY + f"server:\n  port: {big}\n") == [
        "p.yaml:5: server.port: number too large, got 5000 characters"
    ]
    assert errors(PRIMARY + "server:\n  port: ${P}\n", {"P": big}) == [
        "p.yaml:5: server.port: number too large, got 5000 characters"
    ]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e+400"])
def test_numbers_must_be_finite(value: str) -> None:
    (line,) = errors(PRIMARY + f"server:\n  body_timeout_s: {value}\n")
    assert line.startswith("p.yaml:5: server.body_timeout_s: expected a number, got ")


def test_text_knobs_keep_a_plain_number_as_written() -> None:
    # `admin_token: 0123` used to become "83" (YAML 1.1 octal): an operator
    # sending the token they wrote was refused.
    p = parse_policy(
        PRIMARY
        + "    api_key: 0x1F\n"
        + "server:\n  admin_token: 0123\n  api_keys: [1_000, 12:30, 1.50, 2024-01-01]\n",
        env={},
    )
    assert p.server.admin_token == "0123"
    assert p.server.api_keys == ("1_000", "12:30", "1.50", "2024-01-01")
    assert p.backends.primary.api_key == "0x1F"
    # Numbers where numbers go are still numbers; an integral float is an integer.
    assert parse_policy(PRIMARY + "server:\n  port: 0x1F90\n", env={}).server.port == 8080
    assert parse_policy(PRIMARY + "sessions:\n  max_turns: 20.0\n", env={}).sessions.max_turns == 20


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "server:\n  host: !!python/object:os.system ls\n",
            "server.host: YAML tag !!python/object",
        ),
        ("server:\n  host: !!binary aGVsbG8=\n", "server.host: YAML tag !!binary"),
        ("server:\n  host: !custom x\n", "server.host: YAML tag !custom"),
        ("server: !!python/object:x {port: 1}\n", "server: YAML tag !!python/object:x"),
        ("server:\n  api_keys: !!set {a: null}\n", "server.api_keys: YAML tag !!set"),
        ("server:\n  port: !!str 80\n", "server.port: expected an integer, got '80'"),
        ("server:\n  port: !!int eighty\n", "server.port: 'eighty' is not a valid !!int"),
    ],
)
def test_yaml_tags_are_refused_or_honoured(section: str, message: str) -> None:
    assert any(
        line.startswith(f"p.yaml:4: {message}") or line.startswith(f"p.yaml:5: {message}")
        for line in errors(PRIMARY + section)
    ), errors(PRIMARY + section)


@pytest.mark.parametrize("value", ["${FOO", "${FOO:-${BAR}}", "a${1X}", "${}"])
def test_a_malformed_env_placeholder_is_an_error(value: str) -> None:
    # These used to stay in the value as literal text ("${BAR}" as a host).
    (line,) = errors(PRIMARY + f'server:\n  host: "{value}"\n', {"FOO": "f", "BAR": "b"})
    assert line.startswith("p.yaml:5: server.host: malformed ${...}")


def test_env_placeholders_that_are_fine() -> None:
    p = parse_policy(
        PRIMARY + 'server:\n  host: "${FOO:-a}b}"\n  port: "${PORT}"\n  admin_token: ${T:-007}\n',
        env={"PORT": "9000"},
    )
    assert p.server.host == "ab}"
    assert p.server.port == 9000  # quoted, like the schema allows, still a number
    assert p.server.admin_token == "007"


def test_a_key_that_is_a_list_or_mapping_is_named_as_such() -> None:
    lines = errors(PRIMARY + "server:\n  ? [a, b]\n  : c\n  ? {a: 1}\n  : d\n")
    assert lines == [
        "p.yaml:5: server: a key must be a name, got a list",
        "p.yaml:7: server: a key must be a name, got a mapping",
    ]


def _bytes_cases(tmp: Path) -> dict[str, bytes | None]:
    return {
        "bom": b"\xef\xbb\xbf" + PRIMARY.encode(),
        "crlf": PRIMARY.replace("\n", "\r\n").encode(),
        "long_line": (PRIMARY + "server:\n  host: " + "a" * 2_000_000 + "\n").encode(),
    }


def test_odd_but_valid_bytes_pass(tmp_path: Path) -> None:
    for name, raw in _bytes_cases(tmp_path).items():
        f = tmp_path / f"{name}.yaml"
        f.write_bytes(raw or b"")
        res = check(f)
        assert (res.returncode, res.stderr) == (0, ""), name


@pytest.mark.parametrize(
    ("raw", "line", "message"),
    [
        (PRIMARY.encode() + b"server:\n  host: a\x00b\n", 5, "YAML: character '\\x00'"),
        (b"", 1, "backends.primary: empty policy"),
        (b"a: " + b"[" * 50_000, 1, "YAML: nested too deeply"),
        (PRIMARY.encode() + b"server:\n  host: \xff\n", 5, "file is not valid UTF-8"),
        (PRIMARY.encode() + b"server:\n  port: " + b"9" * 5000 + b"\n", 5, "server.port:"),
    ],
)
def test_bad_bytes_get_file_line_messages_and_exit_1(
    tmp_path: Path, raw: bytes, line: int, message: str
) -> None:
    f = tmp_path / "p.yaml"
    f.write_bytes(raw)
    res = check(f)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith(f"{f}:{line}: {message}"), res.stderr


def test_a_directory_or_an_endless_file_is_refused(tmp_path: Path) -> None:
    res = check(tmp_path)
    assert (res.returncode, res.stderr) == (1, f"{tmp_path}:1: cannot read file: Is a directory\n")
    res = check(Path("/dev/zero"))
    assert (res.returncode, res.stderr) == (1, "/dev/zero:1: file is larger than 16 MiB\n")


# --------------------------------------------------------------------------- schema


def _schema_errors(text: str) -> list[str]:
    validator = Draft202012Validator(jsonschema.policy_schema())
    return [e.message for e in validator.iter_errors(yaml.safe_load(text))]


@pytest.mark.parametrize(
    "section",
    [
        "server:\n  admin_token: 12345\n",  # the schema said "not a string"
        "server:\n  api_keys: [12345]\n",
        "sessions:\n  max_turns: 20.0\n",  # the validator said "not an integer"
    ],
)
def test_schema_and_validator_both_accept(section: str) -> None:
    parse_policy(PRIMARY + section, env={})
    assert _schema_errors(PRIMARY + section) == []


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pa#s3cret@host:8000",
        "http://user:pa/s3cret@host:8000",
        "http://user:pa?s3cret@host:8000",
        "user:s3cret@host:8000",
        "http://user:s3cret@[::1",
    ],
)
def test_redact_url_never_shows_a_password_the_parser_misread(url: str) -> None:
    assert "s3cret" not in redact_url(url)


def test_redact_pairs_without_a_separator_hides_the_whole_item() -> None:
    assert redact("ladder.throttle.key_priorities", ("vip-key",)) == ("<redacted>",)


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ("  fallback:\n    url: 'htp://bob:s3cret@fb:8001'\n", "backends.fallback.url"),
        ("  fallback:\n    url: 'http://bob:pa#s3cret@fb:8001'\n", "backends.fallback.url"),
        ("  fallback:\n    url: 'http://bob:s3cret@fb:port'\n", "backends.fallback.url"),
        ("sessions:\n  store: 'rediss//:s3cret@r:6379/0'\n", "sessions.store"),
        ("sessions:\n  store: 'redis://:s3cret@r:port/0'\n", "sessions.store"),
        ("sessions:\n  store: 'redis://:s3cret@r:6379/zero'\n", "sessions.store"),
        ("sessions:\n  store: 'redis://:pa#s3cret@r:6379/0'\n", "sessions.store"),
        ("ladder:\n  shared:\n    redis: 'redis:/:s3cret@r/1'\n", "ladder.shared.redis"),
    ],
)
def test_errors_about_urls_never_show_the_password(section: str, path: str) -> None:
    # These errors reach /brownout/status (unauthenticated) after a reload.
    (line,) = errors(PRIMARY + section)
    assert f": {path}: " in line
    assert "s3cret" not in line


def test_a_redis_url_redis_py_would_refuse_is_refused_by_check() -> None:
    # `check` said ok; `serve` then failed to build the store.
    for store in ("redis://r:port/0", "redis://r:6379/zero", "redis://r:99999/0"):
        (line,) = errors(PRIMARY + f"sessions:\n  store: '{store}'\n")
        assert line.startswith("p.yaml:5: sessions.store: not a valid "), line
    for store in ("redis://r:6379/0", "redis://r", "unix:///tmp/r.sock?db=1", "rediss://:p@r/2"):
        parse_policy(PRIMARY + f"sessions:\n  store: '{store}'\n", env={})


def test_an_api_key_from_the_environment_is_redacted_in_the_diff() -> None:
    old = parse_policy(PRIMARY, env={})
    new = parse_policy(PRIMARY + "    api_key: ${KEY}\n", env={"KEY": "0123s3cret"})
    assert new.backends.primary.api_key == "0123s3cret"
    assert policy_diff(old, new) == ["~ backends.primary.api_key: None -> '<redacted>'"]


@pytest.mark.parametrize(
    "section",
    [
        "server:\n  host: '${FOO'\n",
        "server:\n  host: '${FOO:-${BAR}}'\n",
        "server:\n  port: '${FOO:-${BAR}}'\n",
        "server:\n  api_keys: ['a${}']\n",
    ],
)
def test_schema_and_validator_both_refuse_a_malformed_placeholder(section: str) -> None:
    with pytest.raises(PolicyError):
        parse_policy(PRIMARY + section, env={"FOO": "1", "BAR": "2"})
    assert _schema_errors(PRIMARY + section), section


def test_schema_accepts_well_formed_placeholders_in_text() -> None:
    section = "server:\n  host: '${FOO:-a$b}x'\n  admin_token: '$${T}'\n  port: '${P:-80}'\n"
    parse_policy(PRIMARY + section, env={"T": "t"})
    assert _schema_errors(PRIMARY + section) == []


def test_the_starting_log_line_shows_no_backend_password() -> None:
    from proxy.server import starting_fields

    p = parse_policy(
        "backends:\n  primary:\n    url: http://u:s3cret@h:8000\n"
        "  fallback:\n    url: 'http://u:s3cret@h:8001'\n",
        env={},
    )
    fields = starting_fields(p, "127.0.0.1", 8080)
    assert fields["primary"] == "http://***@h:8000"
    assert "s3cret" not in repr(fields)


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ("server:\n  body_timeout_s: {big}\n", "server.body_timeout_s"),
        ("ladder:\n  recovery:\n    ramp: [{big}]\n", "ladder.recovery.ramp[0]"),
        ("faq:\n  threshold: -{big}\n", "faq.threshold"),
    ],
)
def test_an_integer_beyond_any_float_where_a_number_goes(section: str, path: str) -> None:
    # float(10**400) raised OverflowError: a traceback from `brownout check`.
    (line,) = errors(PRIMARY + section.format(big="9" * 400))
    assert line.startswith("p.yaml:") and f": {path}: number too large" in line, line


MERGED = """\
backends:
  primary: &primary
    url: http://127.0.0.1:8000
    model: m
    timeouts: &t {connect_s: 1, idle_s: 20}
  fallback:
    <<: *primary
    url: http://127.0.0.1:8001
    timeouts: {<<: *t, first_byte_s: 30}
"""


def test_yaml_merge_keys_work_as_the_schema_sees_them() -> None:
    # `<<: *base` was "unknown key" for the validator, fine for the schema.
    assert _schema_errors(MERGED) == []
    p = parse_policy(MERGED, env={})
    fb = p.backends.fallback
    assert fb is not None
    assert (fb.url, fb.model) == ("http://127.0.0.1:8001", "m")
    assert (fb.timeouts.connect_s, fb.timeouts.first_byte_s, fb.timeouts.idle_s) == (1, 30, 20)
    assert p.backends.primary.timeouts.first_byte_s == 60  # merging copies, never writes back


def test_a_merge_key_bomb_is_refused_quickly() -> None:
    levels = ["l0: &l0 {connect_s: 1}"]
    for i in range(1, 9):
        refs = ", ".join([f"*l{i - 1}"] * 10)
        levels.append(f"l{i}: &l{i} {{<<: [{refs}]}}")
    text = (
        "x:\n" + "".join(f"  {line}\n" for line in levels) + PRIMARY + "    timeouts: {<<: *l8}\n"
    )
    started = time.monotonic()
    lines = errors(text)
    assert time.monotonic() - started < 5
    assert any("YAML aliases expand this file" in line for line in lines), lines


def test_a_mapping_that_merges_itself_is_an_error() -> None:
    (line,) = errors("backends:\n  primary: &p\n    url: http://h:1\n    <<: *p\n")
    assert line == "p.yaml:2: backends.primary.<<: a mapping cannot merge itself"


def test_a_deep_chain_of_merges_is_an_error_not_a_recursion_error() -> None:
    levels = ["  l0: &l0 {connect_s: 1}"] + [
        f"  l{i}: &l{i} {{<<: *l{i - 1}}}" for i in range(1, 1500)
    ]
    text = "x:\n" + "\n".join(levels) + "\n" + PRIMARY + "    timeouts: {<<: *l1499}\n"
    lines = errors(text)
    assert any("merges nested over 32 deep" in line for line in lines), lines[:3]
