"""Process and HTTP helpers for tests that drive real servers.

Linux only: process trees are read from ``/proc`` so tests need no psutil and
can find vLLM's engine processes by the titles vLLM gives them
(``VLLM::EngineCore``, ``VLLM::Worker``…) to kill or SIGSTOP them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ProcInfo",
    "descendants",
    "find_descendants",
    "free_port",
    "http_json",
    "is_alive",
    "terminate_tree",
    "wait_for_http",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def http_json(method: str, url: str, body: Any = None, *, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP request with an optional JSON body; returns (status, decoded JSON or text).

    Error statuses are returned, not raised, so tests can assert on them.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status: int = resp.status
            raw: bytes = resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_for_http(
    url: str,
    *,
    timeout: float,
    interval: float = 0.25,
    alive: Callable[[], bool] | None = None,
) -> float:
    """Poll ``url`` until it answers 200; return the seconds waited.

    Raises ``TimeoutError`` at the deadline, or ``RuntimeError`` as soon as
    ``alive()`` turns false (the server died: no point waiting the full
    timeout).
    """
    started = time.monotonic()
    deadline = started + timeout
    last_error = "no attempt"
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"process exited before {url} answered 200 ({last_error})")
        try:
            with urllib.request.urlopen(url, timeout=max(interval, 2.0)) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
                last_error = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused, reset, timeout, bad status line
            last_error = repr(exc)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s ({last_error})")
        time.sleep(interval)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str
    comm: str  # kernel name, truncated to 15 chars; setproctitle changes it too
    cmdline: str  # argv joined by spaces; setproctitle rewrites it

    @property
    def title(self) -> str:
        """The longest name we know: cmdline if set, else comm."""
        return self.cmdline or self.comm


def _read_proc(pid: int) -> ProcInfo | None:
    base = Path("/proc", str(pid))
    try:
        stat = (base / "stat").read_text()
        raw_cmd = (base / "cmdline").read_bytes()
    except OSError:  # exited meanwhile, or not ours to read
        return None
    # comm is in parentheses and may itself contain spaces or parentheses.
    lpar, rpar = stat.index("("), stat.rindex(")")
    comm = stat[lpar + 1 : rpar]
    fields = stat[rpar + 2 :].split()
    cmdline = raw_cmd.replace(b"\0", b" ").decode(errors="replace").strip()
    return ProcInfo(pid=pid, ppid=int(fields[1]), state=fields[0], comm=comm, cmdline=cmdline)


def _all_procs() -> list[ProcInfo]:
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _read_proc(int(entry))) is not None:
            procs.append(info)
    return procs


def descendants(pid: int) -> list[ProcInfo]:
    """All living descendants of ``pid`` (children, grandchildren…), zombies excluded."""
    by_parent: dict[int, list[ProcInfo]] = {}
    for info in _all_procs():
        by_parent.setdefault(info.ppid, []).append(info)
    found: list[ProcInfo] = []
    stack = [pid]
    while stack:
        for child in by_parent.get(stack.pop(), []):
            if child.state != "Z":
                found.append(child)
            stack.append(child.pid)
    return found


def find_descendants(pid: int, name: str) -> list[ProcInfo]:
    """Descendants whose cmdline or comm contains ``name`` (e.g. ``"VLLM::Worker"``)."""
    return [p for p in descendants(pid) if name in p.cmdline or name in p.comm]


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    info = _read_proc(pid)
    return info is not None and info.state != "Z"


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def terminate_tree(
    pid: int, *, timeout: float = 15.0, reap: Callable[[], object] | None = None
) -> None:
    """Stop ``pid`` and everything it started: SIGTERM, then SIGKILL at the deadline.

    Descendants are listed before signalling, because once the parent dies
    they are re-parented and no longer findable from it. Stopped processes
    (a test may have SIGSTOPped a worker) get SIGCONT, or they would never
    act on SIGTERM. ``reap`` (e.g. ``Popen.poll``) is called while waiting so
    our own child does not linger as a zombie.
    """
    tree = [pid, *(p.pid for p in descendants(pid))]
    for p in tree:
        _signal(p, signal.SIGCONT)
    _signal(pid, signal.SIGTERM)  # vLLM's API server shuts its engine down itself
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        if not any(is_alive(p) for p in tree):
            return
        time.sleep(0.1)
    for p in tree:
        if is_alive(p):
            _signal(p, signal.SIGKILL)
    kill_deadline = time.monotonic() + 5.0
    while time.monotonic() < kill_deadline:
        if reap is not None:
            reap()
        if not any(is_alive(p) for p in tree):
            return
        time.sleep(0.05)
