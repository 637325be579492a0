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
    out = []
    for line in lines:
        if "scripts/install-torch.sh " in line:
            out.append("torch (CPU)")
        elif "pip install -q " in line:
            out.append(line.split("pip install -q ", 1)[1])
    return out


def test_make_run_installs_only_what_running_needs(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    lines = _dry_run("run", venv)
    assert _installs(lines) == ["torch (CPU)", "-e '.[fallback]'"]
    assert lines[-1] == f"PATH={venv}/bin:$PATH scripts/quickstart.sh"


def test_make_test_installs_the_test_tools_and_otel_on_top(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert _installs(_dry_run("test", venv)) == [
        "torch (CPU)",
        "-e '.[fallback]'",
        "-e '.[fallback,test,otel]'",
    ]


def test_stamps_skip_what_is_installed(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    lines = _dry_run("run", venv)
    run_stamp = next(line.split()[1] for line in lines if line.startswith("touch "))
    Path(run_stamp).parent.mkdir(parents=True)
    Path(run_stamp).touch()
    # After `make run`, `make run` installs nothing and `make test` only the test and otel extras.
    assert _installs(_dry_run("run", venv)) == []
    test_lines = _dry_run("test", venv)
    assert _installs(test_lines) == ["-e '.[fallback,test,otel]'"]
    test_stamp = next(line.split()[1] for line in test_lines if line.startswith("touch "))
    assert test_stamp != run_stamp
    Path(test_stamp).touch()
    assert _installs(_dry_run("test", venv)) == []
    assert _installs(_dry_run("run", venv)) == []


def test_torch_is_the_cpu_build_wherever_it_comes_from() -> None:
    """A bare `torch` on Linux x86-64 is the multi-GB CUDA build: the script
    takes a wheel on the disk, else PyTorch's CPU index, never plain PyPI first."""
    script = (ROOT / "scripts/install-torch.sh").read_text()
    local = script.index("--dry-run --no-index")
    cpu = script.index("https://download.pytorch.org/whl/cpu")
    plain = script.rindex('exec "${pip[@]}" "torch==$version"')
    assert local < cpu < plain
