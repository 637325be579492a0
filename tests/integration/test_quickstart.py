"""`make run` as a new user meets it: `scripts/quickstart.sh` (what `make run`
starts) on free ports, with the real tiny model and the real fallback server.

- The README's curl, 50 times in a row: every answer is a finished stream
  (no error event, `finish_reason`, `[DONE]`), the tier is never
  `maintenance`. The random model emits control characters, so the
  quickstart policy keeps the guard's content rules in `log` mode — in
  `abort` mode this test fails within a dozen requests (the trips open the
  fallback's breaker and every later answer is the maintenance notice).
- Every command the script prints works, run exactly as printed (curl lines
  for status, force and release a tier, reload, and `brownout reload`) with
  the admin token it generated for the run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.procs import http_json
from tests.integration.conftest import free_port

pytestmark = [pytest.mark.real, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "Ctrl-C stops everything."


@dataclass
class Quickstart:
    url: str
    token: str
    printed: list[str]  # stdout of the script, up to the "Ctrl-C" line
    env: dict[str, str]

    def commands(self) -> list[str]:
        """The shell commands the script printed (continued lines joined)."""
        cmds: list[str] = []
        lines = iter(self.printed)
        for line in lines:
            if not (line.startswith("curl ") or re.match(r"\S*brownout reload ", line)):
                continue
            cmd = line
            while cmd.endswith("\\"):
                cmd = cmd[:-1] + next(lines)
            cmds.append(cmd)
        return cmds

    def run(self, cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", cmd],
            capture_output=True,
            text=True,
            check=False,
            env=self.env,
            timeout=120,
        )


def _read_until_ready(proc: subprocess.Popen[str], within: float) -> list[str]:
    """The script's stdout up to READY_LINE (a thread reads; the test waits)."""
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.strip() == READY_LINE:
                break
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(within) or not lines or lines[-1] != READY_LINE:
        raise AssertionError("quickstart.sh did not get ready:\n" + "\n".join(lines))
    return lines


@pytest.fixture(scope="module")
def quickstart(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Quickstart]:
    port, fallback_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "BROWNOUT_ADMIN_TOKEN"}
    env.update(
        # The venv's `brownout` first, as `make run` puts it.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        BROWNOUT_PORT=str(port),
        BROWNOUT_FALLBACK_PORT=str(fallback_port),
        # No vLLM: refused, as on a laptop without one.
        BROWNOUT_PRIMARY_URL=f"http://127.0.0.1:{free_port()}",
        BROWNOUT_TINY_MODEL_DIR=str(tiny_model_dir),
    )
    log = tmp_path_factory.mktemp("quickstart") / "quickstart.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            ["scripts/quickstart.sh"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its own process group, stopped as one
        )
    try:
        try:
            printed = _read_until_ready(proc, within=240)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- stderr:\n{log.read_text()[-3000:]}") from None
        match = re.search(r"admin token for this run: ([0-9a-f]{32})\)", "\n".join(printed))
        assert match, printed
        yield Quickstart(f"http://127.0.0.1:{port}", match.group(1), printed, env)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _chat_body(q: Quickstart) -> dict[str, Any]:
    """The JSON the README's (and the script's) curl line sends."""
    chat = next(c for c in q.commands() if "/v1/chat/completions" in c)
    args = shlex.split(chat)
    body: dict[str, Any] = json.loads(args[args.index("-d") + 1])
    return body


def test_fifty_quickstart_requests_all_answer(quickstart: Quickstart) -> None:
    import urllib.request

    body = json.dumps(_chat_body(quickstart)).encode()
    tiers: list[str] = []
    failures: list[str] = []
    for i in range(50):
        req = urllib.request.Request(
            quickstart.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
            tiers.append(resp.headers["X-Brownout-Tier"])
            assert resp.headers["X-Brownout-Backend"] == "fallback"
            text = resp.read().decode()
        data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        events = [json.loads(d) for d in data if d != "[DONE]"]
        if data[-1:] != ["[DONE]"] or any("error" in e for e in events):
            failures.append(f"request {i}: {text[-300:]!r}")
        elif not any(c.get("finish_reason") for e in events for c in e.get("choices", ())):
            failures.append(f"request {i}: no finish_reason: {text[-300:]!r}")
    assert failures == []
    assert "maintenance" not in tiers, tiers
    # The content rules saw the random output (they would have tripped in abort mode).
    status, st = http_json("GET", quickstart.url + "/brownout/status")
    assert status == 200 and st["tier"] != "maintenance"
    assert st["backends"]["fallback"]["breaker"] == "closed"


def test_every_printed_command_works(quickstart: Quickstart) -> None:
    cmds = quickstart.commands()
    kinds = [
        "/v1/chat/completions",
        "/brownout/status",
        '"maintenance"',
        "null",
        "/brownout/reload",
        "brownout reload",
    ]
    assert len(cmds) == len(kinds), cmds
    for cmd, kind in zip(cmds, kinds, strict=True):
        assert kind in cmd, (kind, cmd)
        if "Bearer" in cmd or "reload --url" in cmd:
            assert quickstart.token in cmd
    chat, status, force, release, reload, cli_reload = cmds

    res = quickstart.run(chat)
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("data: [DONE]"), res.stdout
    assert '"error"' not in res.stdout

    res = quickstart.run(status)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tier"] in ("normal", "failover")

    res = quickstart.run(force)
    assert res.returncode == 0, res.stderr
    forced = json.loads(res.stdout)
    assert forced["tier"] == "maintenance" and forced["ladder"]["forced"] == "maintenance"
    _, st = http_json("GET", quickstart.url + "/brownout/status")
    assert st["ladder"]["forced"] == "maintenance"

    res = quickstart.run(release)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ladder"]["forced"] is None

    res = quickstart.run(reload)
    assert res.returncode == 0, res.stderr
    reloaded = json.loads(res.stdout)
    assert reloaded["ok"] is True and reloaded["changes"] == []

    res = quickstart.run(cli_reload)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["reloaded: no changes"]
    _, st = http_json("GET", quickstart.url + "/brownout/status")
    assert st["policy"]["last_reload"]["ok"] is True

    # Without the token, the admin endpoints refuse.
    res = quickstart.run(force.replace(quickstart.token, "wrong"))
    assert json.loads(res.stdout)["error"]["code"] == "unauthorized"


def test_the_readme_shows_what_the_script_prints(quickstart: Quickstart) -> None:
    """The README's quickstart output block is the script's output, with this
    run's ports and token in place of the defaults and the example token."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    port = quickstart.url.rsplit(":", 1)[1]
    start = quickstart.printed.index(next(p for p in quickstart.printed if "is ready on" in p))
    for line in quickstart.printed[start:]:
        expected = line.replace(quickstart.token, README_TOKEN).replace(f":{port}", ":8080")
        # `brownout` as the script found it (here maybe another venv's).
        expected = re.sub(r"^\S*brownout reload", ".venv/bin/brownout reload", expected)
        assert expected in readme, f"README lacks the printed line {expected!r}"


# The token the README's example output shows.
README_TOKEN = "3f1c9a7e5b2d4c6a8e0f1a2b3c4d5e6f"
