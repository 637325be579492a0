"""Pytest plugin: session-wide real components (tiny model, vLLM server).

Enabled from ``tests/conftest.py`` with
``pytest_plugins = ["tests.harness.fixtures"]``. Session fixtures are lazy:
a run that uses none of them starts nothing.

Environment knobs:
  BROWNOUT_TINY_MODEL_DIR  use/create the tiny model there instead of the cache
  BROWNOUT_VLLM_VENV       vLLM venv (default ~/.cache/brownout/vllm-venv)
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.harness.vllm import VLLMServer

__all__ = ["live_vllm_server", "tiny_model_dir", "vllm_server"]

# Where the running server is remembered for the failure-report hook below.
_SERVER_KEY = pytest.StashKey[VLLMServer]()


def _tiny_model_cache() -> Path:
    from proxy.tinymodel import TINY_MODEL_VERSION

    env = os.environ.get("BROWNOUT_TINY_MODEL_DIR")
    if env:
        return Path(env)
    # Versioned so a format change never reuses an old model.
    return Path.home() / ".cache" / "brownout" / f"tiny-model-v{TINY_MODEL_VERSION}"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random-weight Llama; generated once (≈ 5 s), then reused across runs."""
    from proxy.tinymodel import is_tiny_model, write_tiny_model

    path = _tiny_model_cache()
    if not is_tiny_model(path):
        # Atomic write: a parallel session either sees a whole model or none.
        write_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def vllm_server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VLLMServer]:
    """One real vLLM server for the whole session (≈ 25 s to start, ≈ 3 GB RSS).

    Tests that kill or stop its engine should use ``live_vllm_server``, or
    call ``restart()`` themselves, so later tests get a working server.
    """
    log_path = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    server = VLLMServer(tiny_model_dir, log_path)
    request.config.stash[_SERVER_KEY] = server
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def live_vllm_server(vllm_server: VLLMServer) -> VLLMServer:
    """The session server, restarted first if an earlier test broke it."""
    vllm_server.ensure_running()
    return vllm_server


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the vLLM log path and tail to failures of tests that used the server."""
    report = yield
    server = item.config.stash.get(_SERVER_KEY, None)
    if report.failed and server is not None and "vllm_server" in getattr(item, "fixturenames", ()):
        report.sections.append(
            ("vLLM server log", f"{server.log_path}\n...\n{server.log_tail(40)}")
        )
    return report
