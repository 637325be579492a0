"""The deployment files under docker/: they parse, they validate, and they agree
(Kubernetes: tests/deploy/test_k8s.py).

Static facts are checked on the parsed YAML; when the tools are installed,
`docker compose config` (both stacks) and
`promtool check config` validate the files as their consumers would.
Missing tools skip those tests with the install line (helpers.INSTALL_HINT).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.policy import Policy, load_policy
from tests.deploy.helpers import (
    DOCKER,
    INSTALL_HINT,
    ROOT,
    compose_command,
    compose_variables,
    interpolate,
    load_all,
    load_one,
    tool,
)

COMPOSE = DOCKER / "compose.yaml"
COMPOSE_CPU = DOCKER / "compose.cpu.yaml"
SERVICES = {
    *("vllm", "fallback-model", "fallback", "brownout"),
    *("redis", "nginx", "prometheus", "grafana"),
}

# --------------------------------------------------------------------------- helpers


def yaml_files() -> list[Path]:
    return sorted(p for p in DOCKER.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def services(path: Path = COMPOSE) -> dict[str, Any]:
    result: dict[str, Any] = load_one(path)["services"]
    return result


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argument list."""
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def check_policy(policy_text: str, faq_text: str, tmp_path: Path, env: dict[str, str]) -> Policy:
    """Run `brownout check` on the policy (FAQ beside it), then load it for its facts."""
    (tmp_path / "policy.yaml").write_text(policy_text, encoding="utf-8")
    (tmp_path / "faq.yaml").write_text(faq_text, encoding="utf-8")
    base = {k: v for k, v in os.environ.items() if not k.startswith("BROWNOUT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check", str(tmp_path / "policy.yaml")],
        env={**base, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"brownout check failed:\n{proc.stderr}"
    return load_policy(tmp_path / "policy.yaml", env=env)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """target → host path of a service's bind mounts (short syntax)."""
    mounts: dict[str, Path] = {}
    for spec in service.get("volumes", []):
        source, target, *_ = str(spec).split(":")
        if source.startswith((".", "/")):
            mounts[target] = (DOCKER / source).resolve()
    return mounts


# --------------------------------------------------------------------------- all YAML


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DOCKER)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: every document must be a mapping"


def test_the_expected_files_exist() -> None:
    for rel in (
        "Dockerfile",
        "Dockerfile.fallback",
        "Dockerfile.vllm-cpu",
        "compose.yaml",
        "compose.cpu.yaml",
        "brownout/policy.yaml",
        "prometheus/prometheus.yml",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/brownout.yml",
        "README.md",
    ):
        assert (DOCKER / rel).is_file(), rel


# --------------------------------------------------------------------------- compose, static


def test_compose_has_the_stack() -> None:
    svc = services()
    assert set(svc) == SERVICES
    for name, s in svc.items():
        expected = "no" if name == "fallback-model" else "unless-stopped"
        assert s.get("restart") == expected, f"{name}: restart policy"
        image = s["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"


def test_compose_brownout_service() -> None:
    b = services()["brownout"]
    assert b["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    env = b["environment"]
    assert env["BROWNOUT_PRIMARY_URL"] == "http://vllm:8000"
    assert env["BROWNOUT_FALLBACK_URL"] == "http://fallback:8001"
    assert env["BROWNOUT_ADMIN_TOKEN"].startswith("${BROWNOUT_ADMIN_TOKEN")
    assert interpolate(env["BROWNOUT_ADMIN_TOKEN"]) == "", "admin endpoints off by default"
    assert env["BROWNOUT_SESSION_STORE"] == "redis://redis:6379/0"
    assert any(str(p).endswith(":8080") for p in b["ports"])
    assert b["command"] == ["serve", "--config", "/etc/brownout/policy.yaml"]
    mounts = bind_mounts(b)
    assert mounts["/etc/brownout/policy.yaml"] == DOCKER / "brownout" / "policy.yaml"
    assert mounts["/etc/brownout/faq.yaml"] == ROOT / "policies" / "faq.yaml"
    assert b.get("read_only") is True and b.get("cap_drop") == ["ALL"]


def test_compose_policy_passes_brownout_check(tmp_path: Path) -> None:
    b = services()["brownout"]
    env = environment(b)
    policy = check_policy(
        (DOCKER / "brownout" / "policy.yaml").read_text(encoding="utf-8"),
        (ROOT / "policies" / "faq.yaml").read_text(encoding="utf-8"),
        tmp_path,
        env,
    )
    assert policy.backends.primary.url == "http://vllm:8000"
    assert policy.backends.fallback is not None
    assert policy.backends.fallback.url == "http://fallback:8001"
    assert policy.sessions.store == "redis://redis:6379/0"
    assert policy.server.port == 8080 and policy.server.host == "0.0.0.0"
    assert policy.server.admin_token == ""
    assert policy.faq.entries, "the FAQ beside the policy was loaded"


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_CPU)], ids=["gpu", "cpu"])
def test_compose_max_num_seqs_matches_admission_limit(files: tuple[Path, ...]) -> None:
    # The file that sets vLLM's command last wins; env values merge.
    command: list[str] = []
    env: dict[str, str] = {}
    for f in files:
        svc = services(f)
        command = svc["vllm"].get("command", command)
        env.update(environment(svc["brownout"]))
    assert interpolate(flag(command, "--max-num-seqs")) == env["BROWNOUT_MAX_INFLIGHT"]


def test_compose_vllm_service() -> None:
    v = services()["vllm"]
    assert v["image"].startswith("vllm/vllm-openai:v")
    devices = v["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    for name in ("--model", "--served-model-name", "--max-num-seqs", "--max-model-len"):
        flag(v["command"], name)
    assert interpolate(flag(v["command"], "--port")) == "8000"
    assert "/health" in " ".join(v["healthcheck"]["test"])
    assert "/root/.cache/huggingface" in " ".join(v["volumes"])


def test_compose_cpu_override_swaps_vllm() -> None:
    v = services(COMPOSE_CPU)["vllm"]
    assert v["build"]["dockerfile"] == "docker/Dockerfile.vllm-cpu"
    assert v["deploy"] is None, "deploy: !reset null drops the GPU reservation"
    assert interpolate(flag(v["command"], "--dtype")) == "float32"
    assert interpolate(flag(v["command"], "--gpu-memory-utilization")) == "0.2"
    assert "VLLM_CPU_KVCACHE_SPACE" in v["environment"]
    assert set(services(COMPOSE_CPU)) <= SERVICES


def test_compose_dependencies_wait_on_real_checks() -> None:
    svc = services()
    dockerfiles = {name: ROOT / s["build"]["dockerfile"] for name, s in svc.items() if "build" in s}
    for name, s in svc.items():
        for dep, spec in (s.get("depends_on") or {}).items():
            assert dep in svc, f"{name} depends on unknown {dep}"
            condition = spec["condition"]
            if condition == "service_healthy":
                has_check = "healthcheck" in svc[dep] or (
                    dep in dockerfiles and "HEALTHCHECK" in dockerfiles[dep].read_text()
                )
                assert has_check, f"{name} waits for {dep} to be healthy, which has no check"
            elif condition == "service_completed_successfully":
                assert svc[dep]["restart"] == "no", f"{dep} is a one-shot"
    assert svc["nginx"]["depends_on"]["brownout"]["condition"] == "service_healthy"
    assert svc["fallback"]["depends_on"]["fallback-model"]["condition"] == (
        "service_completed_successfully"
    )
    # Brownout must come up while vLLM still loads: it may not wait for it.
    assert "vllm" not in svc["brownout"].get("depends_on", {})


def test_compose_bind_mount_sources_exist() -> None:
    for name, s in services().items():
        for target, source in bind_mounts(s).items():
            assert source.exists(), f"{name}: {source} (for {target}) does not exist"


def test_compose_nginx_runs_the_repository_site() -> None:
    n = services()["nginx"]
    mounts = bind_mounts(n)
    hook = mounts["/docker-entrypoint.d/40-brownout-site.sh"]
    assert os.access(hook, os.X_OK), "the nginx entrypoint skips hooks that are not executable"
    assert mounts["/etc/brownout-nginx/brownout.conf"] == ROOT / "nginx" / "brownout.conf"
    assert n["environment"]["BROWNOUT_UPSTREAM"] == "brownout:8080"
    # Every file the site serves from disk (alias/root) is mounted where it expects it.
    site = (ROOT / "nginx" / "brownout.conf").read_text(encoding="utf-8")
    for path in re.findall(r"^\s*(?:alias|root)\s+(\S+);", site, flags=re.M):
        assert path in mounts, f"nginx/brownout.conf serves {path}: mount it in compose"
        assert mounts[path].exists()


def test_compose_prometheus_scrapes_and_loads_rules() -> None:
    p = services()["prometheus"]
    assert bind_mounts(p)["/etc/prometheus"] == DOCKER / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in p["command"]
    conf = load_one(DOCKER / "prometheus" / "prometheus.yml")
    targets = {
        (job["job_name"], target, job.get("metrics_path", "/metrics"))
        for job in conf["scrape_configs"]
        for sc in job.get("static_configs", [])
        for target in sc["targets"]
    }
    assert ("brownout", "brownout:8080", "/metrics") in targets
    assert ("vllm", "vllm:8000", "/metrics") in targets
    assert conf["rule_files"] == ["alerts.yml"]
    assert (DOCKER / "prometheus" / "alerts.yml").is_file()


def test_compose_grafana_provisioning() -> None:
    g = services()["grafana"]
    mounts = bind_mounts(g)
    assert mounts["/etc/grafana/provisioning"] == DOCKER / "grafana" / "provisioning"
    ds = load_one(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert source["isDefault"] is True
    dash = load_one(DOCKER / "grafana" / "provisioning" / "dashboards" / "brownout.yml")
    (provider,) = dash["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert path == "/var/lib/grafana/dashboards"
    assert mounts[path] == DOCKER / "grafana" / "dashboards"
    for board in sorted((DOCKER / "grafana" / "dashboards").glob("*.json")):
        assert isinstance(json.loads(board.read_text(encoding="utf-8")), dict), board


# --------------------------------------------------------------------------- compose, tool


def compose_config(files: tuple[Path, ...]) -> dict[str, Any]:
    cmd = compose_command()
    if cmd is None:
        pytest.skip(f"no Docker Compose v2+ (`docker compose` / `docker-compose`): {INSTALL_HINT}")
    # The files' defaults, not whatever this shell happens to export.
    read = compose_variables(*files)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in read and not k.startswith(("COMPOSE_", "DOCKER_"))
    }
    args = [a for f in files for a in ("-f", str(f))]
    proc = subprocess.run(
        [*cmd, *args, "config", "--format", "json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"compose config failed:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_docker_compose_config_gpu() -> None:
    conf = compose_config((COMPOSE,))
    svc = conf["services"]
    assert set(svc) == SERVICES
    devices = svc["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert svc["brownout"]["environment"]["BROWNOUT_MAX_INFLIGHT"] == "32"
    assert flag(svc["vllm"]["command"], "--max-num-seqs") == "32"
    published = {(p["target"], p.get("host_ip")) for p in svc["brownout"]["ports"]}
    assert published == {(8080, "127.0.0.1")}


def test_docker_compose_config_cpu() -> None:
    conf = compose_config((COMPOSE, COMPOSE_CPU))
    v = conf["services"]["vllm"]
    assert v.get("deploy") is None, "no GPU reservation left after the CPU override"
    assert v["build"]["dockerfile"] == "docker/Dockerfile.vllm-cpu"
    assert flag(v["command"], "--dtype") == "float32"
    assert "--enforce-eager" in v["command"]
    assert v["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert v["healthcheck"]["test"][-1].endswith("timeout=5)"), "base healthcheck kept"
    env = conf["services"]["brownout"]["environment"]
    assert env["BROWNOUT_MAX_INFLIGHT"] == flag(v["command"], "--max-num-seqs") == "4"


def test_promtool_check_config() -> None:
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    proc = subprocess.run(
        [promtool, "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
