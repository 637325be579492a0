"""The `brownout` command line as a user meets it: --version, --help of every
subcommand (each option explained, with its default), documented exit codes."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import __version__
from proxy.cli import EXIT_CODES, build_parser, main
from proxy.ops.adminclient import ReloadOutcome, render
from proxy.ops.rolloutclient import clean, render_rollout

ROOT = Path(__file__).resolve().parents[2]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _help(*argv: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", *argv, "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "100"},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_version() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "--version"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert res.returncode == 0
    # The version, and which run scanner runs (tests/unit/test_runscan.py).
    assert res.stdout.startswith(f"brownout {__version__} (")
    assert res.stdout.endswith(" run scanner)\n")


def test_the_expected_subcommands_exist() -> None:
    assert set(_subparsers()) >= {
        "serve",
        "check",
        "reload",
        "rollout",
        "fallback-server",
        "make-tiny-model",
    }


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_option_is_explained_with_its_default(name: str) -> None:
    """Each option's entry in `brownout NAME --help` has a help text and says
    its default, unless it is required."""
    text = _help(name)
    sub = _subparsers()[name]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.dest}: no help text"
        if not action.option_strings:
            continue  # positionals are required
        flag = action.option_strings[-1]
        # The entry: from the flag at the start of a line to the next entry.
        match = re.search(rf"^  {re.escape(flag)}\b(.*?)(?=^  -|^\S|\Z)", text, re.M | re.S)
        assert match, f"{name} {flag} missing from --help:\n{text}"
        entry = " ".join(match.group(1).split())
        if action.required:
            continue
        assert "(default: " in entry, f"{name} {flag}: no default shown: {entry!r}"
        assert "(default: None)" not in entry, f"{name} {flag}: {entry!r}"


def test_defaults_shown_are_the_real_defaults() -> None:
    text = " ".join(_help("fallback-server").split())
    assert "--port PORT listen port (default: 8001)" in text
    reload = " ".join(_help("reload").split())
    assert "the proxy's base URL (default: http://127.0.0.1:8080)" in reload
    # The token's default is the environment variable's name, never its value.
    assert "(default: $BROWNOUT_ADMIN_TOKEN)" in reload
    rollout = " ".join(_help("rollout").split())
    assert "{status,start,pause,resume,abort,promote} what to do (default: status)" in rollout
    assert "(default: $BROWNOUT_ADMIN_TOKEN)" in rollout


def test_exit_codes_are_in_every_help_and_in_the_readme() -> None:
    top = _help()
    assert EXIT_CODES in top
    for name in _subparsers():
        assert "exit codes: 0 " in " ".join(_help(name).split()), name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert EXIT_CODES in readme, "the README's exit-code table differs from `brownout --help`"


def test_a_bad_command_line_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve"])  # --config is required
    assert exc.value.code == 2
    assert "--config" in capsys.readouterr().err


def test_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("backends:\n  primary:\n    url: http://127.0.0.1:8000\n")
    bad.write_text("backends:\n  primary:\n    url: http://127.0.0.1:8000\n    kind: nope\n")
    assert main(["check", str(good)]) == 0
    assert main(["check", str(bad)]) == 1
    assert f"{bad}:4:" in capsys.readouterr().err


def test_make_tiny_model_refuses_a_foreign_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import proxy.tinymodel

    def refuse(dir: Path, seed: int = 0) -> Path:
        raise FileExistsError(f"{dir} exists and is not a brownout tiny model")

    monkeypatch.setattr(proxy.tinymodel, "write_tiny_model", refuse)
    assert main(["make-tiny-model", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("brownout make-tiny-model: error: ")


# -- how `brownout reload` renders the proxy's answers -------------------------------


def test_render_a_reload_that_changed_things() -> None:
    outcome = ReloadOutcome(
        200,
        {
            "ok": True,
            "at": 1.0,
            "trigger": "api",
            "changes": ["ladder.throttle.max_inflight: 16 -> 8"],
            "needs_restart": ["server.port: 8080 -> 9090"],
        },
    )
    assert render(outcome) == (
        0,
        [
            "reloaded: 1 change(s)",
            "  ladder.throttle.max_inflight: 16 -> 8",
            "needs restart:",
            "  server.port: 8080 -> 9090",
        ],
        [],
    )


def test_render_an_answer_that_is_not_json() -> None:
    rc, out, err = render(ReloadOutcome(502, None, "http://x answered HTTP 502 without JSON"))
    assert (rc, out) == (3, [])
    assert err == ["brownout reload: http://x answered HTTP 502 without JSON"]


# -- how `brownout rollout` renders the proxy's answers ------------------------------


def _rolled_back() -> dict[str, object]:
    return {
        "id": "20260101T000000Z-abc123",
        "state": "rolled_back",
        "step": None,
        "steps": [0.05, 0.2, 0.5, 1.0],
        "share": 0.0,
        "step_held_s": None,
        "step_s": 900,
        "reason": "p99 ratio 1.31 above 1.05",
        "failed_gate": "p99_ratio",
        "configured": True,
        "candidate": {"healthy": True, "down": False, "breaker": "closed"},
        "gates": {
            "ready": False,
            "samples": {"primary": 412, "candidate": 97},
            "gates": [
                {"gate": "oom", "verdict": "pass", "value": 0.0, "limit": 0, "arms": {}},
                {
                    "gate": "p99_ratio",
                    "verdict": "fail",
                    "value": 1.31,
                    "limit": 1.05,
                    "low": 1.12,
                    "high": 1.5,
                    "arms": {"primary": 0.84, "candidate": 1.1},
                },
                {
                    "gate": "error_rate",
                    "verdict": "pass",
                    "value": 0.0,
                    "limit": 0.0,
                    "arms": {"candidate": 0.0},
                },
            ],
        },
        "bundles": ["/var/lib/brownout/rollouts/20260101T000000Z-abc123"],
        "bundle_error": None,
        "history": [
            {"change": "started", "step": 0},
            {"change": "step", "step": 1},
            {"change": "rolled_back", "step": 1},
        ],
    }


def test_render_a_rollback_names_the_gate_its_figures_and_the_bundle() -> None:
    rc, out, err = render_rollout(ReloadOutcome(200, _rolled_back()), "status")
    assert (rc, err) == (0, [])
    assert out == [
        "rollout 20260101T000000Z-abc123: rolled back at step 2/4 · all traffic on the primary",
        "  failed gate  p99_ratio",
        "  reason       p99 ratio 1.31 above 1.05",
        "  candidate    healthy · breaker closed",
        "  gates        last evaluation · samples primary 412, candidate 97",
        "    oom          pass  0 (limit 0)",
        "    p99_ratio    fail  1.31 (limit 1.05) [1.12–1.50]  primary 840 ms · candidate 1.10 s",
        "    error_rate   pass  0 % (limit 0 %)  candidate 0 %",
        "  bundles      /var/lib/brownout/rollouts/20260101T000000Z-abc123",
    ]


def test_render_json_prints_the_answer_as_it_came() -> None:
    body = _rolled_back()
    rc, out, err = render_rollout(ReloadOutcome(200, body), "status", as_json=True)
    assert (rc, err) == (0, [])
    assert json.loads("\n".join(out)) == body


@pytest.mark.parametrize(
    ("status", "body", "rc", "err"),
    [
        (
            409,
            {"error": {"message": "not paused (state step)", "code": "rollout_conflict"}},
            1,
            "brownout rollout resume: refused (HTTP 409): not paused (state step)",
        ),
        (
            400,
            {"error": {"message": "expected an action", "code": "invalid_action"}},
            1,
            "brownout rollout resume: refused (HTTP 400): expected an action",
        ),
        (
            403,
            {"error": {"message": "admin endpoints are disabled"}},
            3,
            "brownout rollout resume: HTTP 403: admin endpoints are disabled",
        ),
        # An older proxy without the route.
        (
            404,
            {"error": {"message": "no such route"}},
            3,
            "brownout rollout resume: HTTP 404: no such route",
        ),
        (
            200,
            {"ok": True},
            3,
            'brownout rollout resume: HTTP 200: not a rollout answer: {"ok": true}',
        ),
    ],
)
def test_render_refusals_and_strange_answers(
    status: int, body: dict[str, object], rc: int, err: str
) -> None:
    assert render_rollout(ReloadOutcome(status, body), "resume") == (rc, [], [err])


def test_render_unreachable_exits_3() -> None:
    outcome = ReloadOutcome(None, None, "cannot reach http://x: [Errno 111] Connection refused")
    assert render_rollout(outcome, "start") == (
        3,
        [],
        ["brownout rollout start: cannot reach http://x: [Errno 111] Connection refused"],
    )


def test_render_escapes_what_a_hostile_backend_put_in_the_reason() -> None:
    """The rollback reason carries a candidate's error detail: terminal escapes,
    NULs, lone surrogates and a megabyte of text reach the operator as one
    printable line, and printing it cannot raise."""
    snap = _rolled_back()
    snap["reason"] = "boom\x1b[2J\x1b]0;pwned\x07\x00\ud800\u2028next" + "x" * 1_000_000
    snap["failed_gate"] = "oom\r\nfake line"
    rc, out, _ = render_rollout(ReloadOutcome(200, snap), "status")
    assert rc == 0
    (reason,) = [line for line in out if line.startswith("  reason ")]
    assert reason.startswith(
        "  reason       boom\\x1b[2J\\x1b]0;pwned\\x07\\x00\\ud800\\u2028nextxxx"
    )
    assert len(reason) < 400 and reason.endswith("…")
    assert "  failed gate  oom\\x0d\\x0afake line" in out
    for line in out:
        assert line.isprintable()
        line.encode("utf-8")  # no lone surrogate left
    assert clean("plain ascii") == "plain ascii"
    assert clean("ünïcode · 20 %") == "ünïcode · 20 %"


def test_render_survives_malformed_fields() -> None:
    snap: dict[str, object] = {
        "state": "step",
        "step": "two",
        "steps": "all",
        "share": float("nan"),
        "step_held_s": "long",
        "gates": {"gates": [None, 3, {"gate": {"x": 1}, "value": "high", "arms": []}]},
        "bundles": "nope",
        "candidate": [],
    }
    rc, out, _ = render_rollout(ReloadOutcome(200, snap), "status")
    assert rc == 0
    assert out[0] == "rollout: step ? · ? %"
    assert any("high" in line for line in out)


def test_render_the_mirror_and_a_started_rollout() -> None:
    snap = {**_rolled_back(), "state": "mirror", "failed_gate": None, "reason": None}
    snap.update(step=None, step_held_s=42.0, gates=None, bundles=[])
    rc, out, _ = render_rollout(ReloadOutcome(200, snap), "start")
    assert rc == 0
    assert out[:3] == [
        "rollout started",
        "rollout 20260101T000000Z-abc123: mirror (live traffic copied, no user on the candidate)",
        "  held         42 s of 900 s",
    ]


def test_readme_route_table_is_generated_from_the_routes() -> None:
    from proxy.ingress.routes import markdown_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- routes:begin -->\n", 1)[1].split("\n<!-- routes:end -->", 1)[0]
    assert block == markdown_table(), "regenerate the README's route table"
