"""`brownout rollout` in its own process against a running proxy with a
candidate (scripted fakes, the real evaluation loop): the lines and the exit
code an operator gets for each answer."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from aiohttp import web

from proxy.policy import parse_policy
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port
from tests.integration.test_pipeline import CHAT
from tests.integration.test_rollout_flow import (
    TOKEN,
    ask,
    candidate_upstream,
    rollout_policy,
    state,
    streaming,
)

__all__ = ["candidate_upstream"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parents[2]


async def cli(*args: str, token_env: str | None = None) -> tuple[int, str, str]:
    """`brownout rollout ARGS` in its own process (the proxy serves from this one's loop)."""
    env = {k: v for k, v in os.environ.items() if k != "BROWNOUT_ADMIN_TOKEN"}
    if token_env is not None:
        env["BROWNOUT_ADMIN_TOKEN"] = token_env
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy.cli",
        "rollout",
        *args,
        "--timeout",
        "5",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_start_conflict_pause_resume_promote_abort(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)
    candidate_upstream.handlers[CHAT] = streaming("candidate", 0.0)
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, steps=[0.2, 0.5, 1.0], step_s=3600
    )
    proxy = await start_proxy(pol)
    url = proxy.url

    # Before the start: idle, the steps it will take; exit 0.
    rc, out, err = await cli("status", "--url", url, "--token", TOKEN)
    assert (rc, err) == (0, ""), err
    lines = out.splitlines()
    assert lines[0] == "rollout: idle (not started)"
    assert "  steps        20 % → 50 % → 100 %, 3600 s each" in lines
    assert "  candidate    healthy · breaker closed" in lines

    # Start (token from the environment): step 1/3 at 20 %, and the proxy agrees.
    rc, out, err = await cli("start", "--url", url, token_env=TOKEN)
    assert (rc, err) == (0, ""), err
    lines = out.splitlines()
    snap = await state(proxy)
    assert snap["state"] == "step" and snap["step"] == 0 and snap["share"] == 0.2
    assert lines[:2] == ["rollout started", f"rollout {snap['id']}: step 1/3 · 20 %"]
    assert lines[2].startswith("  held ") and lines[2].endswith(" of 3600 s"), lines

    # Start again: the proxy refuses (409) with its reason; exit 1, nothing on stdout.
    rc, out, err = await cli("start", "--url", url, "--token", TOKEN)
    assert (rc, out) == (1, "")
    assert err.strip() == (
        "brownout rollout start: refused (HTTP 409): a rollout is already running (step)"
    )
    assert (await state(proxy))["id"] == snap["id"]  # the same rollout goes on

    # Resume what is not paused: refused too.
    rc, _, err = await cli("resume", "--url", url, "--token", TOKEN)
    assert rc == 1 and "not paused (state step)" in err

    rc, out, _ = await cli("pause", "--url", url, "--token", TOKEN)
    assert rc == 0
    assert out.splitlines()[:2] == [
        "rollout paused",
        f"rollout {snap['id']}: paused at step 1/3 · 20 %",
    ]
    assert "  reason       by the operator" in out.splitlines()
    assert (await state(proxy))["state"] == "paused"

    rc, out, _ = await cli("resume", "--url", url, "--token", TOKEN)
    assert rc == 0 and out.splitlines()[1] == f"rollout {snap['id']}: step 1/3 · 20 %"
    assert not any(line.startswith("  reason") for line in out.splitlines())  # no longer paused

    # Some traffic: the gates line counts both arms' samples.
    for i in range(20):
        assert (await ask(proxy, f"s{i}"))[0] == 200
    await asyncio.sleep(0.3)  # a few evaluation windows
    rc, out, _ = await cli("--url", url, "--token", TOKEN)  # status is the default
    assert rc == 0
    gates = [line for line in out.splitlines() if line.startswith("  gates ")]
    assert len(gates) == 1 and "samples primary " in gates[0] and "candidate " in gates[0]
    assert any(line.startswith("    oom ") and "pass" in line for line in out.splitlines())

    rc, out, _ = await cli("promote", "--url", url, "--token", TOKEN)
    assert rc == 0
    assert out.splitlines()[:2] == ["rollout promoted", f"rollout {snap['id']}: complete · 100 %"]
    assert (await ask(proxy, "anyone"))[1] == "candidate"

    rc, out, _ = await cli("abort", "--url", url, "--token", TOKEN)
    assert rc == 0
    assert out.splitlines()[:2] == [
        "rollout aborted",
        f"rollout {snap['id']}: aborted at step 3/3 · all traffic on the primary",
    ]
    assert (await ask(proxy, "anyone"))[1] == "primary"
    rc, _, err = await cli("abort", "--url", url, "--token", TOKEN)
    assert rc == 1 and "no rollout to abort (state aborted)" in err


async def test_json_prints_the_proxy_answer(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    proxy = await start_proxy(
        rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path, step_s=3600)
    )
    rc, out, err = await cli("start", "--json", "--url", proxy.url, "--token", TOKEN)
    assert (rc, err) == (0, "")
    started = json.loads(out)
    assert started["state"] == "step" and started["configured"] is True
    rc, out, _ = await cli("status", "--json", "--url", proxy.url, "--token", TOKEN)
    assert rc == 0
    now = json.loads(out)
    want = await state(proxy)
    for key in ("id", "state", "step", "share", "steps", "bundles", "candidate"):
        assert now[key] == want[key], key
    # A refusal: the error object on stdout, the reason on stderr, exit 1.
    rc, out, err = await cli("start", "--json", "--url", proxy.url, "--token", TOKEN)
    assert rc == 1
    assert json.loads(out)["error"]["code"] == "rollout_conflict"
    assert err.startswith("brownout rollout start: refused (HTTP 409): ")


async def test_a_rollback_shows_the_failed_gate_the_reason_and_the_bundle(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    fake_upstream.handlers[CHAT] = streaming("primary", 0.0)

    async def oom(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "CUDA out of memory. Tried to allocate 2.00 GiB", "code": 500}},
            status=500,
        )

    candidate_upstream.handlers[CHAT] = oom
    pol = rollout_policy(
        fake_upstream.url, candidate_upstream.url, tmp_path, steps=[0.5, 1.0], step_s=3600
    )
    proxy = await start_proxy(pol)
    assert (await cli("start", "--url", proxy.url, "--token", TOKEN))[0] == 0
    t0 = time.monotonic()
    while (await state(proxy))["state"] != "rolled_back":
        assert time.monotonic() - t0 < 10
        await ask(proxy, f"u{time.monotonic()}")
    while not (snap := await state(proxy))["bundles"]:  # written off the loop
        assert time.monotonic() - t0 < 10
        await asyncio.sleep(0.02)
    (bundle,) = [p.parent for p in tmp_path.glob("[!.]*/verdict.json")]
    rc, out, err = await cli("status", "--url", proxy.url, "--token", TOKEN)
    assert (rc, err) == (0, "")  # a rollback is a state to show, not a failure of the command
    lines = out.splitlines()
    assert lines[0] == f"rollout {snap['id']}: rolled back at step 1/2 · all traffic on the primary"
    assert "  failed gate  oom" in lines
    (reason,) = [line for line in lines if line.startswith("  reason ")]
    assert reason == f"  reason       {snap['reason']}"
    assert f"  bundles      {bundle}" in lines


async def test_wrong_token_unreachable_and_no_candidate(
    fake_upstream: FakeUpstream,
    candidate_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    tmp_path: Path,
) -> None:
    proxy = await start_proxy(rollout_policy(fake_upstream.url, candidate_upstream.url, tmp_path))
    rc, out, err = await cli("start", "--url", proxy.url, "--token", "not-it")
    assert (rc, out) == (3, "")
    assert err.strip() == "brownout rollout start: HTTP 401: missing or wrong admin token"
    assert (await state(proxy))["state"] == "idle"
    rc, _, err = await cli("status", "--url", proxy.url)  # no token at all
    assert rc == 3 and "HTTP 401" in err

    gone = f"http://127.0.0.1:{free_port()}"
    rc, out, err = await cli("status", "--url", gone, "--token", TOKEN)
    assert (rc, out) == (3, "")
    assert err.startswith(f"brownout rollout status: cannot reach {gone}: "), err

    # A proxy without backends.candidate: status says so (exit 0), start is refused (exit 1).
    text = (
        f"server:\n  admin_token: {TOKEN}\n  heartbeat_s: 0\n"
        f"backends:\n  primary:\n    url: {fake_upstream.url}\n"
    )
    plain = await start_proxy(parse_policy(text, "plain.yaml"))
    rc, out, err = await cli("status", "--url", plain.url, "--token", TOKEN)
    assert (rc, out, err) == (
        0,
        "rollout: not configured (set backends.candidate in the policy)\n",
        "",
    )
    rc, out, err = await cli("start", "--url", plain.url, "--token", TOKEN)
    assert (rc, out) == (1, "")
    assert err.strip() == (
        "brownout rollout start: refused (HTTP 409): "
        "no rollout is configured: set backends.candidate in the policy"
    )
