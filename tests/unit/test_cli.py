"""The `brownout` command line as a user meets it: --version, --help of every
subcommand (each option explained, with its default), documented exit codes."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import __version__
from proxy.cli import EXIT_CODES, build_parser, main
from proxy.ops.adminclient import ReloadOutcome, render

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
    assert res.stdout == f"brownout {__version__}\n"


def test_the_expected_subcommands_exist() -> None:
    assert set(_subparsers()) >= {"serve", "check", "reload", "fallback-server", "make-tiny-model"}


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


def test_readme_route_table_is_generated_from_the_routes() -> None:
    from proxy.ingress.routes import markdown_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- routes:begin -->\n", 1)[1].split("\n<!-- routes:end -->", 1)[0]
    assert block == markdown_table(), "regenerate the README's route table"
