"""The policy: YAML in, frozen typed objects out, `FILE:LINE: message` errors.

The YAML is composed into a node tree (which keeps line marks) and converted
against the dataclass schema below, so every error points at the line an SRE
has to fix. All errors of a file are collected, not just the first.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

BackendKind = Literal["vllm", "transformers", "openai"]
Tier = Literal["normal", "throttle", "failover", "maintenance"]


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    host: str = "127.0.0.1"
    port: int = 8080
    # Admin endpoints answer only when this is set, and only with it.
    admin_token: str = ""
    # Accepted client keys (`Authorization: Bearer ...`); empty = no client auth.
    api_keys: tuple[str, ...] = ()
    # Request bodies above this get 413.
    max_body_bytes: int = 4 * 1024 * 1024
    # SSE comment sent when the upstream has been silent this long (keeps
    # nginx's proxy_read_timeout and idle load balancers from cutting streams).
    heartbeat_s: float = 15.0
    # Prompts and completions never reach the logs unless this is true.
    log_prompts: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Seconds to let in-flight streams finish on shutdown.
    shutdown_grace_s: float = 10.0


@dataclass(frozen=True, slots=True)
class TimeoutPolicy:
    connect_s: float = 3.0
    # Until the first byte of the answer (response headers and, for streams,
    # the first event). Long prefills count here.
    first_byte_s: float = 60.0
    # Longest silence between two stream events once the answer has started.
    idle_s: float = 30.0
    # Whole request; 0 = no limit.
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    max_connections: int = 512
    keepalive_s: float = 30.0


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    path: str = "/health"
    interval_s: float = 2.0
    timeout_s: float = 1.0


@dataclass(frozen=True, slots=True)
class BackendPolicy:
    url: str
    kind: BackendKind = "vllm"
    # Rewrite the request's `model` to this name (None = pass through).
    model: str | None = None
    # Replaces the client's Authorization towards this backend when set.
    api_key: str | None = None
    timeouts: TimeoutPolicy = field(default_factory=TimeoutPolicy)
    pool: PoolPolicy = field(default_factory=PoolPolicy)
    health: HealthPolicy = field(default_factory=HealthPolicy)


@dataclass(frozen=True, slots=True)
class BackendsPolicy:
    primary: BackendPolicy
    fallback: BackendPolicy | None = None


@dataclass(frozen=True, slots=True)
class SessionsPolicy:
    store: str = "memory://"
    ttl_s: int = 86400
    max_turns: int = 20
    key_prefix: str = "brownout:"


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    enabled: bool = True
    # Normally equal to vLLM's --max-num-seqs.
    max_inflight: int = 64


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    enabled: bool = True
    # Route to the fallback when the primary refuses connections.
    on_connect_error: bool = True


@dataclass(frozen=True, slots=True)
class MaintenancePolicy:
    enabled: bool = True
    notice: str = "The assistant is under maintenance right now. Please try again in a few minutes."
    retry_after_s: int = 30
    status_code: Literal[200, 503] = 200


@dataclass(frozen=True, slots=True)
class LadderPolicy:
    throttle: ThrottlePolicy = field(default_factory=ThrottlePolicy)
    failover: FailoverPolicy = field(default_factory=FailoverPolicy)
    maintenance: MaintenancePolicy = field(default_factory=MaintenancePolicy)


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class FaqPolicy:
    file: str | None = None
    threshold: float = 0.5


@dataclass(frozen=True, slots=True)
class Policy:
    backends: BackendsPolicy
    server: ServerPolicy = field(default_factory=ServerPolicy)
    sessions: SessionsPolicy = field(default_factory=SessionsPolicy)
    ladder: LadderPolicy = field(default_factory=LadderPolicy)
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    faq: FaqPolicy = field(default_factory=FaqPolicy)
    # Where the policy came from (for status and reload), not a YAML key.
    source: str = field(default="<memory>", metadata={"internal": True})


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    file: str
    line: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class PolicyError(Exception):
    """A policy file that cannot be used; carries every issue found."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))

    def lines(self) -> list[str]:
        return [str(i) for i in self.issues]


# --------------------------------------------------------------------------- loading

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
T = TypeVar("T")


class _Converter:
    """Walks a YAML node tree against a dataclass schema, collecting issues."""

    def __init__(self, file: str, env: Mapping[str, str]) -> None:
        self.file = file
        self.env = env
        self.issues: list[PolicyIssue] = []

    def issue(self, node: yaml.Node, message: str) -> None:
        self.issues.append(PolicyIssue(self.file, node.start_mark.line + 1, message))

    def interpolate(self, node: yaml.ScalarNode) -> str:
        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in self.env:
                return self.env[name]
            if default is not None:
                return default
            self.issue(node, f"environment variable {name} is not set")
            return ""

        return _ENV_RE.sub(sub, node.value)

    def scalar(self, node: yaml.Node, path: str) -> Any:
        """A scalar's value with YAML 1.1 typing applied after ${ENV} expansion."""
        if not isinstance(node, yaml.ScalarNode):
            self.issue(node, f"{path}: expected a single value, got a {_kind(node)}")
            return _INVALID
        before = len(self.issues)
        text = self.interpolate(node) if "${" in node.value else node.value
        if len(self.issues) != before:
            return _INVALID
        if node.style in ("'", '"'):
            return text
        if text == "":
            # An empty ${VAR} means "empty text", not null.
            return "" if "${" in node.value else None
        # Resolve the plain scalar's type as YAML would (int, float, bool, null);
        # an expanded value that parses as a structure stays text.
        value = yaml.safe_load(text)
        return value if not isinstance(value, dict | list) else text

    def convert(self, node: yaml.Node, tp: Any, path: str) -> Any:
        origin = get_origin(tp)
        if origin is typing.Union or origin is types.UnionType:
            args = [a for a in get_args(tp) if a is not type(None)]
            if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
                return None
            if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
                return None
            return self.convert(node, args[0], path)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(node, tp, path)
        if origin is tuple:
            (item_tp, _ellipsis) = get_args(tp)
            if isinstance(node, yaml.ScalarNode) and self.scalar(node, path) is None:
                return ()
            if not isinstance(node, yaml.SequenceNode):
                self.issue(node, f"{path}: expected a list, got a {_kind(node)}")
                return _INVALID
            return tuple(self.convert(n, item_tp, f"{path}[{i}]") for i, n in enumerate(node.value))
        if origin is Literal:
            value = self.scalar(node, path)
            allowed = get_args(tp)
            if value is _INVALID:
                return value
            if value not in allowed:
                choices = " | ".join(str(a) for a in allowed)
                self.issue(node, f"{path}: {value!r} is not one of {choices}")
                return _INVALID
            return value
        value = self.scalar(node, path)
        if value is _INVALID:
            return value
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
            # Numbers where text is expected (tokens, names) are kept as written.
            return str(value)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            self.issue(node, f"{path}: expected {_type_name(tp)}, got {value!r}")
            return _INVALID
        return value

    def dataclass(self, node: yaml.Node, cls: type[T], path: str) -> T:
        if not isinstance(node, yaml.MappingNode):
            self.issue(node, f"{path or 'policy'}: expected a mapping, got a {_kind(node)}")
            return typing.cast(T, _INVALID)
        hints = get_type_hints(cls)
        fields = {
            f.name: f
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if not f.metadata.get("internal")
        }
        values: dict[str, Any] = {}
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            where = f"{path}.{key}" if path else str(key)
            if key is None or key not in fields:
                known = ", ".join(sorted(fields))
                self.issue(key_node, f"unknown key {where!r} (known here: {known})")
                continue
            if key in seen:
                self.issue(key_node, f"duplicate key {where!r}")
                continue
            seen.add(key)
            values[key] = self.convert(value_node, hints[key], where)
        for name, f in fields.items():
            if (
                name not in values
                and f.default is dataclasses.MISSING
                and (f.default_factory is dataclasses.MISSING)
            ):
                where = f"{path}.{name}" if path else name
                self.issue(node, f"missing required key {where!r}")
        if any(v is _INVALID for v in values.values()) or self.issues:
            return typing.cast(T, _INVALID)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            self.issue(node, f"{path}: {exc}")
            return typing.cast(T, _INVALID)


class _Invalid:
    def __repr__(self) -> str:
        return "<invalid>"


_INVALID: Any = _Invalid()


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "mapping"
    if isinstance(node, yaml.SequenceNode):
        return "list"
    return "value"


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _semantic_checks(policy: Policy, root: yaml.Node, conv: _Converter) -> None:
    """Cross-field rules that types alone cannot express."""

    def at(*keys: str) -> yaml.Node:
        node = root
        for k in keys:
            if not isinstance(node, yaml.MappingNode):
                return node
            for kn, vn in node.value:
                if getattr(kn, "value", None) == k:
                    node = vn
                    break
            else:
                return node
        return node

    for name in ("primary", "fallback"):
        b = getattr(policy.backends, name)
        if b is None:
            continue
        if not re.match(r"^https?://[^/\s]+", b.url):
            conv.issue(
                at("backends", name, "url"), f"backends.{name}.url: not an http(s) URL: {b.url!r}"
            )
        t = b.timeouts
        for k in ("connect_s", "first_byte_s", "idle_s"):
            if getattr(t, k) <= 0:
                conv.issue(
                    at("backends", name, "timeouts", k),
                    f"backends.{name}.timeouts.{k}: must be > 0",
                )
        if b.pool.max_connections < 1:
            conv.issue(
                at("backends", name, "pool", "max_connections"),
                f"backends.{name}.pool.max_connections: must be >= 1",
            )
    s = policy.server
    if not 0 < s.port < 65536:
        conv.issue(at("server", "port"), "server.port: must be 1..65535")
    if s.max_body_bytes < 1024:
        conv.issue(at("server", "max_body_bytes"), "server.max_body_bytes: must be >= 1024")
    if s.heartbeat_s <= 0:
        conv.issue(at("server", "heartbeat_s"), "server.heartbeat_s: must be > 0")
    store = policy.sessions.store
    if not (store == "memory://" or store.startswith(("redis://", "rediss://", "unix://"))):
        conv.issue(
            at("sessions", "store"),
            f"sessions.store: expected memory:// or redis://host:port/db, got {store!r}",
        )
    if policy.sessions.max_turns < 1:
        conv.issue(at("sessions", "max_turns"), "sessions.max_turns: must be >= 1")
    if policy.ladder.throttle.max_inflight < 1:
        conv.issue(
            at("ladder", "throttle", "max_inflight"), "ladder.throttle.max_inflight: must be >= 1"
        )


def parse_policy(text: str, file: str = "<string>", env: Mapping[str, str] | None = None) -> Policy:
    """Parse and validate policy text; raise PolicyError listing every issue."""
    conv = _Converter(file, os.environ if env is None else env)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise PolicyError([PolicyIssue(file, line, f"YAML syntax: {exc.problem}")]) from None
    if root is None:
        raise PolicyError([PolicyIssue(file, 1, "empty policy: 'backends.primary' is required")])
    policy = conv.dataclass(root, Policy, "")
    if not conv.issues:
        _semantic_checks(policy, root, conv)
    if conv.issues:
        raise PolicyError(sorted(conv.issues, key=lambda i: i.line))
    return dataclasses.replace(policy, source=file)


def load_policy(path: str | Path, env: Mapping[str, str] | None = None) -> Policy:
    """Read a policy file (blocking I/O: call at start-up or from a thread)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise PolicyError([PolicyIssue(str(p), 1, f"cannot read policy: {exc.strerror}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PolicyError([PolicyIssue(str(p), line, "policy is not valid UTF-8")]) from None
    return parse_policy(text, str(p), env)


def policy_fields(cls: type[Any] = Policy, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, default) for every policy knob, for the generated reference."""
    out: list[tuple[str, str, str]] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        inner = [a for a in get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            out.extend(policy_fields(inner[0], key + "."))  # type: ignore[arg-type]
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        out.append((key, str(tp).replace("typing.", ""), default))
    return out
