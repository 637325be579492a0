"""The chaos stack, the load generator and the tier timeline.

    load (N asyncio clients, raw SSE) ─► nginx (nginx/brownout.conf)
        ─► `brownout serve` (subprocess, policy FILE: SIGHUP reloads are real)
             ├─► vLLM CPU server (primary; the session's `VLLMServer`)
             ├─► `brownout fallback-server` (fallback, Transformers)
             └─► redis-server (sessions; AOF on, so a stop/start keeps them)

`Stack` starts and stops everything but vLLM, which is passed in (one per
test session, ≈ 25 s to start). Every component listens on a fixed port for
the stack's lifetime, so a killed one comes back where the proxy expects it.

`Load` runs clients through nginx, each with its own `X-Session-Id`, and
classifies every request from the raw bytes (see `classify`): a client-side
verdict, independent of the proxy's own bookkeeping. `Timeline` polls
`/brownout/status` and keeps what changed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

from tests.harness.procs import free_port, http_json, terminate_tree, wait_for_http
from tests.harness.vllm import VLLMServer
from tests.integration.conftest import RANDOM_MODEL_GUARD

__all__ = [
    "ADMIN_TOKEN",
    "FallbackProc",
    "Load",
    "NginxProc",
    "ProxyProc",
    "Req",
    "Sample",
    "SessionRedis",
    "Stack",
    "Timeline",
    "classify",
    "in_owner_thread",
]

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
ADMIN_TOKEN = "chaos-admin"
KEY_PREFIX = "chaos:"
RESCUE_MARK = b": brownout-rescue"

Outcome = Literal["complete", "maintenance", "error", "truncated", "hung"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in a child before exec: SIGTERM it when the drill process dies
    (a killed pytest or bench run must not leave servers behind)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


T = TypeVar("T")

# Children started with PR_SET_PDEATHSIG (ours, and VLLMServer's) get SIGTERM
# when the *thread* that forked them exits, and asyncio.to_thread's threads
# end with each test's event loop: a vLLM restarted that way dies after the
# test. Blocking starts and stops therefore run on these long-lived threads.
_OWNER = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="chaos-owner")


async def in_owner_thread(fn: Callable[[], T]) -> T:
    """Run a blocking start/stop off the event loop, on a thread that outlives it."""
    return await asyncio.get_running_loop().run_in_executor(_OWNER, fn)


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with {proc.returncode} before listening"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {port} within {timeout} s") from None
            time.sleep(0.05)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- components


class FallbackProc:
    """`brownout fallback-server` on the tiny model, always on the same port."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        concurrency: int = 2,
        queue: int = 32,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.concurrency = concurrency
        self.queue = queue
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running():
            return
        cmd = [
            sys.executable, "-m", "proxy.cli", "fallback-server",
            "--model", str(self.model_dir), "--port", str(self.port),
            "--served-model-name", "tiny",
            "--max-concurrency", str(self.concurrency), "--max-queue", str(self.queue),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        proc = self.proc
        try:
            wait_for_http(
                self.url + "/health",
                timeout=self.startup_timeout,
                interval=0.2,
                alive=lambda: proc.poll() is None,
            )
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RuntimeError(
                f"fallback server did not start: {exc}\n{_tail(self.log_path)}"
            ) from exc

    def kill(self) -> None:
        """The fault: SIGKILL, no goodbye to open streams."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            terminate_tree(self.proc.pid, timeout=15.0, reap=self.proc.poll)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None


class SessionRedis:
    """A private redis-server that keeps its data across stop/start.

    Like `tests.sessions.conftest.PrivateRedis`, but with an append-only file
    (fsynced every second, and on shutdown): a session store in production survives a
    restart, and a drill that stops Redis must not count the restart's
    amnesia as turns the proxy lost.
    """

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running():
            return
        cmd = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--daemonize", "no", "--dir", str(self.workdir),
        ]  # fmt: skip
        with (self.workdir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + 15
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on {self.port}")
            time.sleep(0.02)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ProxyProc:
    """`brownout serve --config FILE` as a real process (SIGHUP reloads it)."""

    def __init__(self, policy_path: Path, log_path: Path) -> None:
        self.policy_path = policy_path
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "proxy.cli", "serve", "--config", str(self.policy_path),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        proc = self.proc
        try:
            wait_for_http(
                self.url + "/healthz", timeout=30, interval=0.1, alive=lambda: proc.poll() is None
            )
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RuntimeError(
                f"brownout serve did not start: {exc}\n{_tail(self.log_path)}"
            ) from exc

    def sighup(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Strings of nginx/brownout.conf the drills rewrite (production → test values).
UPSTREAM_LINE = "server 127.0.0.1:8080;"
LISTEN_LINE = "listen 80;"
EXEMPT_BLOCK = "geo $brownout_limit_exempt {\n    default 0;\n"
# The load's workers' own addresses when they stand for end users (Load(own_addresses=True)).
LOAD_NET = "127.0.1.0/24"


def worker_address(sid: str) -> str:
    """A load worker's own loopback address in LOAD_NET, from its session id's index."""
    return f"127.0.1.{int(sid.rsplit('-', 1)[1]) % 250 + 1}"


class NginxProc:
    """The real nginx with the repo's site file in front of the proxy.

    The load generator stands for a frontend that serves many users from
    one address, so 127.0.0.1 goes on the site's own exemption list
    (`geo $brownout_limit_exempt`): the per-address rate limits are meant
    for end users, and the drills measure Brownout's shedding, not nginx's.
    So does LOAD_NET, where the load's workers stand for end users of their
    own (drill 8: one hostile user among many, not one user against the
    frontend that serves all the others — fair share splits by client).
    """

    def __init__(self, prefix: Path, upstream_port: int) -> None:
        prefix.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.upstream_port = upstream_port
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_conf(self) -> Path:
        site_path = ROOT / "nginx" / "brownout.conf"
        site = site_path.read_text()
        for line in (UPSTREAM_LINE, LISTEN_LINE, EXEMPT_BLOCK):
            if line not in site:
                raise RuntimeError(f"{site_path} no longer contains {line!r}")
        site = site.replace(UPSTREAM_LINE, f"server 127.0.0.1:{self.upstream_port};")
        site = site.replace(LISTEN_LINE, f"listen 127.0.0.1:{self.port};")
        site = site.replace(EXEMPT_BLOCK, EXEMPT_BLOCK + f"    127.0.0.1 1;\n    {LOAD_NET} 1;\n")
        (self.prefix / "site.conf").write_text(site)
        conf = self.prefix / "nginx.conf"
        p = self.prefix
        conf.write_text(
            f"""
worker_processes 1;
error_log {p}/error.log warn;
pid {p}/nginx.pid;
events {{ worker_connections 2048; }}
http {{
    access_log off;
    client_body_temp_path {p}/body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    include {p}/site.conf;
}}
"""
        )
        return conf

    def start(self) -> None:
        if not Path(NGINX).exists():
            raise RuntimeError("nginx is not installed (.ci/run installs it with apt-get)")
        conf = self.write_conf()
        glob = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
        with (self.prefix / "stderr.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [NGINX, "-p", str(self.prefix), "-c", str(conf), "-g", glob],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        _wait_port(self.port, self.proc, "nginx", 10)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the stack


@dataclass(frozen=True)
class Tuning:
    """The fast ladder every drill runs with (seconds, not minutes)."""

    max_inflight: int = 8
    primary_first_byte_s: float = 10.0
    primary_idle_s: float = 3.0
    fallback_first_byte_s: float = 30.0
    fallback_idle_s: float = 10.0
    heartbeat_s: float = 1.0


class Stack:
    """Fallback, Redis, `brownout serve` and nginx around a given vLLM server."""

    def __init__(
        self,
        vllm: VLLMServer,
        model_dir: Path,
        workdir: Path,
        *,
        tuning: Tuning | None = None,
        fallback_concurrency: int = 2,
        fallback_queue: int = 32,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.vllm = vllm
        self.workdir = workdir
        self.tuning = tuning or Tuning()
        self.fallback = FallbackProc(
            model_dir,
            workdir / "fallback.log",
            concurrency=fallback_concurrency,
            queue=fallback_queue,
        )
        self.redis = SessionRedis(workdir / "redis")
        self.policy_path = workdir / "policy.yaml"
        # The proxy's flight recording (each drill's window is replayed: issue 22).
        self.recording_dir = workdir / "recordings"
        self.proxy = ProxyProc(self.policy_path, workdir / "proxy.log")
        self.nginx = NginxProc(workdir / "nginx", self.proxy.port)

    # -- addresses ---------------------------------------------------------------

    @property
    def api_url(self) -> str:
        """Where clients go: nginx."""
        return self.nginx.url

    @property
    def status_url(self) -> str:
        """The operator's view, straight from the proxy."""
        return self.proxy.url + "/brownout/status"

    # -- the policy --------------------------------------------------------------

    def policy_text(self, notice: str = "Maintenance drill in progress.") -> str:
        t = self.tuning
        return f"""# Chaos drill policy: the fast ladder (tests/chaos/drill.py writes it).
server:
  admin_token: {ADMIN_TOKEN}
  heartbeat_s: {t.heartbeat_s}
  shutdown_grace_s: 2
backends:
  primary:
    url: {self.vllm.base_url}
    kind: vllm
    model: tiny
    timeouts: {{connect_s: 1, first_byte_s: {t.primary_first_byte_s}, idle_s: {t.primary_idle_s}}}
    health: {{interval_s: 0.2, timeout_s: 3}}
  fallback:
    url: {self.fallback.url}
    kind: transformers
    model: tiny
    timeouts: {{connect_s: 1, first_byte_s: {t.fallback_first_byte_s}, idle_s: {t.fallback_idle_s}}}
    health: {{interval_s: 0.2, timeout_s: 3}}
sessions:
  store: {self.redis.url}
  key_prefix: "{KEY_PREFIX}"
  max_turns: 100000
ladder:
  throttle:
    max_inflight: {t.max_inflight}
    # Sessions here grow without bound (so every turn can be audited), which
    # makes prompts, and so the engine's TTFT, drift up over the run against
    # the rolling baseline; deployed sessions plateau at max_turns. A looser
    # factor keeps that drift from reading as load (overload still shows in
    # queue wait and TTFT well past 2.5x).
    ttft_factor: 2.5
  breaker: {{fail_max: 2, reset_timeout_s: 1}}
  recovery:
    window_s: 0.2
    min_dwell_s: 2
    healthy_windows: 2
    ramp: [0.5, 1.0]
    ramp_step_s: 1
  maintenance:
    notice: "{notice}"
    retry_after_s: 5
recorder:
  enabled: true
  dir: {self.recording_dir}
faq:
  entries:
    - question: How do I reset my password?
      keywords: [password, reset]
      answer: Use the forgot-password link on the sign-in page.
{RANDOM_MODEL_GUARD.strip()}
"""

    def write_policy(self, text: str) -> None:
        """Atomically, as a config-management tool would (no half-written file)."""
        tmp = self.policy_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.policy_path)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self.vllm.ensure_running()
        self.fallback.start()
        self.redis.start()
        self.write_policy(self.policy_text())
        self.proxy.start()
        self.nginx.start()

    def stop(self) -> None:
        for stop in (self.nginx.stop, self.proxy.stop, self.fallback.stop, self.redis.stop):
            with contextlib.suppress(Exception):
                stop()

    def restart_proxy(self) -> None:
        """A fresh `brownout serve` on the same port (nginx keeps pointing at it)."""
        self.proxy.stop()
        self.write_policy(self.policy_text())
        self.proxy.start()

    def repair(self) -> None:
        """Bring back whatever an earlier drill left broken (blocking)."""
        if not self.redis.running():
            self.redis.start()
        if not self.fallback.running():
            self.fallback.start()
        self.vllm.ensure_running()
        if self.policy_path.read_text() != self.policy_text():
            self.write_policy(self.policy_text())
            self.proxy.sighup()

    def status(self) -> dict[str, Any]:
        code, body = http_json("GET", self.status_url, timeout=5)
        if code != 200 or not isinstance(body, dict):
            raise RuntimeError(f"/brownout/status answered {code}: {body!r}")
        return body

    def log_tails(self) -> str:
        """The proxy's warnings and errors, and the other logs' tails."""
        try:
            lines = self.proxy.log_path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        quiet = ('"level": "info"', '"level": "debug"')
        loud = [ln for ln in lines if not any(q in ln for q in quiet)]
        return "\n".join(
            [
                "--- proxy (warnings and errors)",
                *loud[-25:],
                *(
                    f"--- {name}\n{_tail(path, 10)}"
                    for name, path in (
                        ("fallback", self.fallback.log_path),
                        ("nginx", self.nginx.prefix / "error.log"),
                    )
                ),
            ]
        )

    def proxy_log_for(self, request_ids: set[str]) -> list[str]:
        """The proxy's log lines about these requests (`X-Request-Id`s)."""
        try:
            lines = self.proxy.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln for ln in lines if any(f'"{rid}"' in ln for rid in request_ids)]


def session_key(session_id: str) -> str:
    """The Redis hash of an anonymous client's session (proxy/sessions/store.py)."""
    return f"{KEY_PREFIX}session:anon:{session_id}"


# --------------------------------------------------------------------------- classification


@dataclass
class Req:
    """One request as the client saw it (times: wall clock, seconds)."""

    group: str
    session: str
    n: int  # the session's question number ("Question {n}: ...")
    started: float
    ended: float = 0.0
    headers_at: float | None = None
    status: int = 0
    backend: str = ""
    tier: str = ""
    session_state: str = ""  # X-Brownout-Session
    outcome: Outcome = "hung"
    rescued: bool = False
    code: str = ""  # error code, for errors
    retry_after: float | None = None  # Retry-After of a 429/503


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    rescued: bool = False
    code: str = ""


def _error_code(obj: Any) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return str(code) if code is not None else str(err.get("type") or "error")
    return "error"


def classify(status: int, content_type: str, raw: bytes, transport_error: str = "") -> Verdict:
    """What a client holds at the end of one request.

    complete: a `finish_reason` and `[DONE]`, no error event; error: an HTTP
    error, an in-band `{"error": ...}` event, or a broken connection (the
    client's HTTP library raises); truncated: the stream ended cleanly
    without an error, but also without `finish_reason` or `[DONE]` — what an
    OpenAI SDK would hand to the application as a finished answer.
    """
    if status != 200:
        try:
            code = _error_code(json.loads(raw))
        except ValueError:
            code = f"http_{status}"
        return Verdict("error", code=f"{status}:{code}")
    if not content_type.startswith("text/event-stream"):
        try:
            obj = json.loads(raw)
        except ValueError:
            return (
                Verdict("error", code="transport:" + transport_error)
                if transport_error
                else (Verdict("truncated", code="unparsable body"))
            )
        if isinstance(obj, dict) and "error" in obj:
            return Verdict("error", code=_error_code(obj))
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
            return Verdict("complete")
        return Verdict("truncated", code="no finish_reason")
    done = finish = False
    error = ""
    text = raw.replace(b"\r\n", b"\n")
    for block in text.split(b"\n\n"):
        data = [
            line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")
        ]
        if not data:
            continue
        payload = b"\n".join(data)
        if payload == b"[DONE]":
            done = True
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            error = error or _error_code(obj)
            continue
        for ch in obj.get("choices") or ():
            if isinstance(ch, dict) and ch.get("finish_reason"):
                finish = True
    rescued = RESCUE_MARK in raw
    if error:
        return Verdict("error", rescued, error)
    if transport_error:
        return Verdict("error", rescued, "transport:" + transport_error)
    if done and finish:
        return Verdict("complete", rescued)
    missing = " and ".join(x for x, ok in (("finish_reason", finish), ("[DONE]", done)) if not ok)
    return Verdict("truncated", rescued, f"no {missing}")


# --------------------------------------------------------------------------- load


@dataclass
class _Group:
    stop: asyncio.Event
    tasks: list[asyncio.Task[None]]


class Load:
    """Concurrent streaming chat clients with sessions, through nginx."""

    def __init__(
        self,
        base_url: str,
        *,
        run_id: str | None = None,
        max_tokens: int = 48,
        think_s: float = 0.2,
        deadline_s: float = 90.0,
        own_addresses: bool = False,
    ) -> None:
        self.base_url = base_url
        self.run_id = run_id or uuid.uuid4().hex[:8]
        # Each worker an end user with its own loopback address (LOAD_NET),
        # not one frontend: drill 8 measures one hostile user among many.
        self.own_addresses = own_addresses
        self.max_tokens = max_tokens
        self.think_s = think_s
        self.deadline_s = deadline_s
        self.max_retry_after_s = 10.0
        self.records: list[Req] = []
        # Answers in their first third right now: content seen, most of it to come.
        self.early = 0
        self._more_early = asyncio.Event()
        self._groups: dict[str, _Group] = {}
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name in list(self._groups):
            await self.stop(name)
        if self._http is not None:
            await self._http.close()
            self._http = None

    @property
    def sessions(self) -> list[str]:
        return sorted({r.session for r in self.records})

    @staticmethod
    def session_id(run_id: str, group: str, i: int) -> str:
        """The `X-Session-Id` of client `i` of a load group (also its request ids' prefix)."""
        return f"{run_id}-{group}-{i}"

    def start(self, group: str, workers: int, think_s: float | None = None) -> None:
        """`workers` clients, each looping: ask, read the whole answer, think."""
        if group in self._groups:
            raise ValueError(f"load group {group!r} already runs")
        stop = asyncio.Event()
        think = self.think_s if think_s is None else think_s
        tasks = [
            asyncio.create_task(
                self._worker(self.session_id(self.run_id, group, i), group, stop, think)
            )
            for i in range(workers)
        ]
        self._groups[group] = _Group(stop, tasks)

    def halt(self, group: str) -> None:
        """No new requests from this group from now on (returns at once)."""
        g = self._groups.get(group)
        if g is not None:
            g.stop.set()

    async def stop(self, group: str) -> None:
        """No new requests; the ones in flight finish (each bounded by its deadline)."""
        g = self._groups.pop(group, None)
        if g is None:
            return
        g.stop.set()
        await asyncio.gather(*g.tasks)

    async def _worker(self, sid: str, group: str, stop: asyncio.Event, think: float) -> None:
        async with contextlib.AsyncExitStack() as own:
            http = self._http
            if self.own_addresses:
                http = await own.enter_async_context(
                    aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(
                            limit=0, local_addr=(worker_address(sid), 0)
                        ),
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                    )
                )
            await self._ask_loop(sid, group, stop, think, http)

    async def _ask_loop(
        self,
        sid: str,
        group: str,
        stop: asyncio.Event,
        think: float,
        http: aiohttp.ClientSession | None,
    ) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            rec = await self.one(sid, group, n, http)
            self.records.append(rec)
            # Like the OpenAI SDKs: a refusal's Retry-After is honoured.
            pause = max(think, min(rec.retry_after or 0.0, self.max_retry_after_s))
            if pause > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)

    async def mid_stream(self, streams: int, limit_s: float = 10.0) -> int:
        """Wait until `streams` answers are early in their stream (content seen,
        less than a third of `max_tokens` events received); returns how many are."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                while self.early < streams:
                    self._more_early.clear()
                    await self._more_early.wait()
        return self.early

    async def one(
        self, sid: str, group: str, n: int, http: aiohttp.ClientSession | None = None
    ) -> Req:
        http = http or self._http
        assert http is not None, "use `async with Load(...)`"
        rec = Req(group=group, session=sid, n=n, started=time.time())
        body = {
            "model": "tiny",
            "stream": True,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Question {n}: what happened next?"}],
        }
        headers = {"X-Session-Id": sid, "X-Request-Id": f"{sid}-{n}"}
        raw = bytearray()
        status, ctype, transport = 0, "", ""
        try:
            async with (
                asyncio.timeout(self.deadline_s),
                http.post(
                    self.base_url + "/v1/chat/completions", json=body, headers=headers
                ) as resp,
            ):
                rec.headers_at = time.time()
                status = rec.status = resp.status
                ctype = resp.headers.get("Content-Type", "")
                rec.backend = resp.headers.get("X-Brownout-Backend", "")
                rec.tier = resp.headers.get("X-Brownout-Tier", "")
                rec.session_state = resp.headers.get("X-Brownout-Session", "")
                if status in (429, 503) and resp.headers.get("Retry-After", "").isdigit():
                    rec.retry_after = float(resp.headers["Retry-After"])
                early: bool | None = None  # None: no content yet; False: past the first third
                events = 0
                try:
                    async for chunk in resp.content.iter_any():
                        raw += chunk
                        if early is None and b'"content"' in raw:
                            early = True
                            self.early += 1
                            self._more_early.set()
                        if early:
                            events += chunk.count(b"data:")
                            if events * 3 > self.max_tokens:
                                early = False
                                self.early -= 1
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    transport = type(exc).__name__
                finally:
                    if early:
                        self.early -= 1
        except TimeoutError:
            rec.ended = time.time()
            rec.outcome, rec.code = "hung", f"no end after {self.deadline_s:.0f} s"
            rec.rescued = RESCUE_MARK in raw
            return rec
        except aiohttp.ClientError as exc:  # refused, reset before the status line
            rec.ended = time.time()
            rec.outcome, rec.code = "error", "transport:" + type(exc).__name__
            return rec
        rec.ended = time.time()
        v = classify(status, ctype, bytes(raw), transport)
        rec.outcome, rec.rescued, rec.code = v.outcome, v.rescued, v.code
        if v.outcome == "complete" and rec.backend == "maintenance":
            rec.outcome = "maintenance"
        return rec


# --------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Sample:
    """One look at /brownout/status (t: wall clock)."""

    t: float
    reachable: bool
    tier: str = ""
    ramp: float | None = None
    store_healthy: bool | None = None
    primary: str = ""  # "up" / "down" + breaker state
    fallback: str = ""
    reload_at: float | None = None
    reload_ok: bool | None = None
    limit: int | None = None
    pressure: str = ""  # the signals above their marks, e.g. "queue_wait, ttft"

    def key(self) -> tuple[object, ...]:
        return (
            self.reachable,
            self.tier,
            self.ramp,
            self.store_healthy,
            self.primary,
            self.fallback,
            self.reload_at,
            self.pressure,
        )


def _pressure_signals(st: dict[str, Any]) -> str:
    """While pressure is active: the signals at or above their marks; else the
    ones still above the clear ratio (0.5 by default) that keep it active."""
    p = st.get("pressure") or {}
    if not p.get("active"):
        return ""
    signals = {k: float(v) for k, v in (p.get("signals") or {}).items()}
    high = sorted(k for k, v in signals.items() if v >= 1.0)
    if high:
        return ", ".join(high)
    holding = sorted(k for k, v in signals.items() if v >= 0.5)
    return "held by " + (", ".join(holding) or "?") + " (below its mark, above the clear ratio)"


def sample_of(t: float, st: dict[str, Any]) -> Sample:
    def backend(name: str) -> str:
        b = st.get("backends", {}).get(name)
        if not isinstance(b, dict):
            return ""
        return f"{'up' if b.get('healthy') else 'down'}/{b.get('breaker')}"

    ramp = st.get("ladder", {}).get("ramp")
    last = (st.get("policy") or {}).get("last_reload") or {}
    return Sample(
        t=t,
        reachable=True,
        tier=str(st.get("tier")),
        ramp=float(ramp["share"]) if isinstance(ramp, dict) else None,
        store_healthy=(st.get("sessions") or {}).get("healthy"),
        primary=backend("primary"),
        fallback=backend("fallback"),
        reload_at=last.get("at"),
        reload_ok=last.get("ok"),
        limit=(st.get("concurrency") or {}).get("limit"),
        pressure=_pressure_signals(st),
    )


class Timeline:
    """Polls /brownout/status every `interval_s`; keeps the samples that differ."""

    def __init__(self, status_url: str, interval_s: float = 0.2) -> None:
        self.status_url = status_url
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        # The admission limit moves every ladder window under pressure: kept
        # apart from the samples, (time, limit) at each change.
        self.limits: list[tuple[float, int]] = []
        self.last_status: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[Sample], None]] = []

    async def __aenter__(self) -> Timeline:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                t = time.time()
                try:
                    async with http.get(self.status_url) as resp:
                        st = await resp.json()
                    self.last_status = st
                    s = sample_of(t, st)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    s = Sample(t=t, reachable=False)
                if s.limit is not None and (not self.limits or self.limits[-1][1] != s.limit):
                    self.limits.append((t, s.limit))
                # Only changes are kept, each with the time it was first seen.
                if not self.samples or self.samples[-1].key() != s.key():
                    self.samples.append(s)
                for fn in self._listeners:
                    fn(s)
                await asyncio.sleep(self.interval_s)

    async def wait_for(self, pred: Callable[[Sample], bool], limit_s: float) -> Sample | None:
        """The first sample (from now on) for which `pred` holds; None after `limit_s`."""
        found: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()

        def check(s: Sample) -> None:
            if not found.done() and pred(s):
                found.set_result(s)

        self._listeners.append(check)
        try:
            return await asyncio.wait_for(found, limit_s)
        except TimeoutError:
            return None
        finally:
            self._listeners.remove(check)


def is_normal(s: Sample) -> bool:
    return s.reachable and s.tier == "normal" and s.ramp is None


def wait_status(
    stack: Stack, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> dict[str, Any]:
    """Blocking poll of /brownout/status (between drills, not under load)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = stack.status()
            if pred(st):
                return st
        except (OSError, RuntimeError):
            st = {}
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not reached within {timeout} s; last status {st}")
        time.sleep(0.1)
