"""`brownout reload` against a real `brownout serve` process.

`kill -HUP $(pidof brownout)` finds nothing (the process is `python`), so the
CLI reloads through `POST /brownout/reload` with the admin token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "reload-test-token"


def write_policy(
    path: Path, *, max_inflight: int = 16, admin: bool = True, extra: str = ""
) -> None:
    server = f"server:\n  admin_token: {TOKEN}\n" if admin else ""
    path.write_text(
        f"{server}"
        "backends:\n"
        "  primary:\n"
        "    url: http://127.0.0.1:9\n"  # nothing listens there: fine for reloads
        "ladder:\n"
        "  throttle:\n"
        f"    max_inflight: {max_inflight}\n"
        f"{extra}"
    )


@dataclass
class Served:
    url: str
    policy: Path

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/brownout/status", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data


def _start(policy: Path) -> tuple[subprocess.Popen[bytes], Served]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(policy), "--port", str(port)],
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    served = Served(f"http://127.0.0.1:{port}", policy)
    deadline = time.monotonic() + 30
    while True:
        try:
            served.status()
            return proc, served
        except OSError:
            assert proc.poll() is None, "brownout serve exited"
            assert time.monotonic() < deadline, "brownout serve did not answer"
            time.sleep(0.1)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    path = tmp_path / "policy.yaml"
    write_policy(path)
    proc, s = _start(path)
    try:
        yield s
    finally:
        proc.terminate()
        proc.wait(15)


def reload(*args: str, token_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BROWNOUT_ADMIN_TOKEN"}
    if token_env is not None:
        env["BROWNOUT_ADMIN_TOKEN"] = token_env
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "reload", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


def test_reload_applies_an_edit_and_lists_it(served: Served) -> None:
    assert served.status()["concurrency"]["max"] == 16
    write_policy(served.policy, max_inflight=8)
    res = reload("--url", served.url, "--token", TOKEN)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "reloaded: 1 change(s)"
    assert any("max_inflight" in line and "8" in line for line in lines[1:]), lines
    st = served.status()
    assert st["concurrency"]["max"] == 8
    assert st["policy"]["last_reload"]["ok"] is True
    assert st["policy"]["last_reload"]["trigger"] == "api"


def test_reload_takes_the_token_from_the_environment(served: Served) -> None:
    res = reload("--url", served.url, token_env=TOKEN)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["reloaded: no changes"]


def test_a_broken_policy_is_rejected_with_its_lines_and_exit_1(served: Served) -> None:
    write_policy(served.policy, extra="    mode: sideways\n")
    res = reload("--url", served.url, "--token", TOKEN)
    assert res.returncode == 1
    err = res.stderr.splitlines()
    assert err[0] == "brownout reload: rejected, the running policy is unchanged:"
    assert any(line.startswith(f"{served.policy}:9:") for line in err[1:]), err
    assert res.stdout == ""
    st = served.status()
    assert st["concurrency"]["max"] == 16
    assert st["policy"]["last_reload"]["ok"] is False


def test_a_wrong_token_exits_3_and_changes_nothing(served: Served) -> None:
    write_policy(served.policy, max_inflight=8)
    res = reload("--url", served.url, "--token", "not-it")
    assert res.returncode == 3
    assert res.stderr.strip() == "brownout reload: HTTP 401: missing or wrong admin token"
    assert served.status()["concurrency"]["max"] == 16
    assert served.status()["policy"]["last_reload"] is None


def test_no_proxy_there_exits_3() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    res = reload("--url", url, "--token", TOKEN, "--timeout", "5")
    assert res.returncode == 3
    assert res.stderr.startswith(f"brownout reload: cannot reach {url}: "), res.stderr


def test_admin_disabled_exits_3_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    write_policy(path, admin=False)
    proc, s = _start(path)
    try:
        res = reload("--url", s.url, "--token", TOKEN)
    finally:
        proc.terminate()
        proc.wait(15)
    assert res.returncode == 3
    assert "HTTP 403: admin endpoints are disabled" in res.stderr
