"""Start-up failures: exit code 2 and one clear line, no hub download attempted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # An unreachable proxy makes any accidental network access fail fast.
    env = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "fallback-server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


@pytest.mark.parametrize("kind", ["missing", "empty", "no-weights", "bad-config"])
def test_invalid_model_dir_exits_2_with_one_line(
    kind: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tmp_path / "model"
    if kind != "missing":
        model.mkdir()
    if kind == "no-weights":
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / name, model / name)
    if kind == "bad-config":
        (model / "config.json").write_text("{not json")
    result = _run("--model", str(model), "--port", "9")
    assert result.returncode == 2, result.stderr
    line = _last_line(result.stderr)
    assert line.startswith("brownout fallback-server: error: ")
    assert str(model) in line
    assert "Traceback" not in result.stderr


def test_max_model_len_beyond_the_model_is_refused(tiny_model_dir: Path) -> None:
    result = _run("--model", str(tiny_model_dir), "--max-model-len", "999999", "--port", "9")
    assert result.returncode == 2
    assert "--max-model-len" in _last_line(result.stderr)


def test_negative_side_slots_are_refused_before_loading(tmp_path: Path) -> None:
    result = _run("--model", str(tmp_path / "absent"), "--side-slots", "-1", "--port", "9")
    assert result.returncode == 2
    assert "--side-slots must be at least 0" in _last_line(result.stderr)
