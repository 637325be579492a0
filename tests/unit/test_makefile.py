"""`make run` installs what running needs; `make test` everything the tests need.

Dry runs (`make -n`) against an empty venv path: the commands make would run,
without running them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MAKE_VARS = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(target: str, venv: Path) -> list[str]:
    res = subprocess.run(
        # --no-print-directory, and none of an outer make's variables: under
        # `make test` the nested make would print "make[1]: Entering ..." lines.
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        env={k: v for k, v in os.environ.items() if k not in _MAKE_VARS},
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line.split("pip install -q ", 1)[1] for line in lines if "pip install -q " in line]


def test_make_run_installs_only_what_running_needs(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    lines = _dry_run("run", venv)
    assert _installs(lines) == ["torch==2.13.0", "-e '.[fallback]'"]
    assert lines[-1] == f"PATH={venv}/bin:$PATH scripts/quickstart.sh"


def test_make_test_installs_the_test_tools_on_top(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert _installs(_dry_run("test", venv)) == [
        "torch==2.13.0",
        "-e '.[fallback]'",
        "-e '.[fallback,test]'",
    ]


def test_stamps_skip_what_is_installed(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    lines = _dry_run("run", venv)
    run_stamp = next(line.split()[1] for line in lines if line.startswith("touch "))
    Path(run_stamp).parent.mkdir(parents=True)
    Path(run_stamp).touch()
    # After `make run`, `make run` installs nothing and `make test` only the test extra.
    assert _installs(_dry_run("run", venv)) == []
    test_lines = _dry_run("test", venv)
    assert _installs(test_lines) == ["-e '.[fallback,test]'"]
    test_stamp = next(line.split()[1] for line in test_lines if line.startswith("touch "))
    assert test_stamp != run_stamp
    Path(test_stamp).touch()
    assert _installs(_dry_run("test", venv)) == []
    assert _installs(_dry_run("run", venv)) == []
