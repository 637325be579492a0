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

from proxy.breaker import BreakerPolicy
from proxy.guard import GuardPolicy
from proxy.knobs import knob
from proxy.ladder import RecoveryPolicy
from proxy.pressure import ThrottlePolicy
from proxy.sessions import SessionsPolicy
from proxy.shared import SharedPolicy

BackendKind = Literal["vllm", "transformers", "openai"]


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    host: str = knob("127.0.0.1", "Address to listen on (`--host` overrides).")
    port: int = knob(8080, "Port to listen on (`--port` overrides).")
    admin_token: str = knob(
        "", "Bearer token for the admin endpoints; empty = admin endpoints disabled."
    )
    api_keys: tuple[str, ...] = knob(
        (), "Accepted client keys (`Authorization: Bearer ...`); empty = no client auth."
    )
    max_body_bytes: int = knob(4 * 1024 * 1024, "Request bodies above this get 413.")
    body_timeout_s: float = knob(
        30.0, "A request body not fully received within this gets 408 (slow clients)."
    )
    heartbeat_s: float = knob(
        15.0,
        "Send an SSE comment (`: ping`) when the backend has been silent this long, so "
        "nginx's proxy_read_timeout and idle load balancers keep the stream.",
    )
    max_event_bytes: int = knob(
        1024 * 1024,
        "A backend stream event larger than this (no blank line yet) ends the stream with "
        "an in-band error (a 502 before the first byte): bounds memory and CPU per stream.",
    )
    max_kept_bytes: int = knob(
        8 * 1024 * 1024,
        "Stream bytes kept per answer for a rescue or a session save; a longer answer is "
        "still relayed, but neither rescued nor saved.",
    )
    log_prompts: bool = knob(False, "Prompts and completions reach the logs only when true.")
    log_level: Literal["debug", "info", "warning", "error"] = knob("info", "Log level.")
    shutdown_grace_s: float = knob(10.0, "Seconds in-flight requests get to finish on shutdown.")
    watch_policy: bool = knob(
        False, "Reload the policy when its file changes (besides SIGHUP and the API)."
    )
    watch_interval_s: float = knob(2.0, "How often the policy file is checked when watched.")

    def __post_init__(self) -> None:
        if self.max_event_bytes < 1024:
            raise ValueError("max_event_bytes must be >= 1024")
        if self.max_kept_bytes < 0:
            raise ValueError("max_kept_bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class TimeoutPolicy:
    connect_s: float = knob(3.0, "TCP connect to the backend.")
    first_byte_s: float = knob(
        60.0,
        "Until the first answer event (response headers and, for streams, the first "
        "event); long prefills count here.",
    )
    idle_s: float = knob(30.0, "Longest silence between two stream events mid-answer.")


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    max_connections: int = knob(512, "Connection pool size towards this backend.")
    keepalive_s: float = knob(30.0, "Idle keep-alive connections are closed after this.")


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    path: str = knob("/health", "Probe path (vLLM: 200 = fine, 503 = engine dead).")
    interval_s: float = knob(2.0, "Seconds between probes.")
    timeout_s: float = knob(1.0, "A probe slower than this fails.")


@dataclass(frozen=True, slots=True)
class BackendPolicy:
    url: str = field(
        metadata={"doc": "Root URL of the OpenAI-compatible server (`/v1/...` is appended)."}
    )
    kind: BackendKind = knob(
        "vllm", "`vllm`, `transformers` (brownout fallback-server) or `openai`."
    )
    model: str | None = knob(
        None, "Rewrite the request's `model` to this name; unset = pass through."
    )
    api_key: str | None = knob(
        None, "Sent as `Authorization: Bearer` to this backend instead of the client's header."
    )
    tokenizer: str | None = knob(
        None,
        "Local directory of this backend's Hugging Face tokenizer, for token-exact "
        "trimming (never downloaded); unset = the backend's /tokenize endpoint.",
    )
    max_model_len: int | None = knob(
        None, "Context window in tokens; unset = read from the backend's /v1/models."
    )
    supports_continuation: bool | None = knob(
        None,
        "Whether the backend continues a partial assistant message "
        "(`continue_final_message`); unset = yes for vllm and transformers.",
    )
    drop_params: tuple[str, ...] = knob(
        (), "Request parameters removed before sending to this backend (it lacks them)."
    )
    timeouts: TimeoutPolicy = knob(TimeoutPolicy, "")
    pool: PoolPolicy = knob(PoolPolicy, "")
    health: HealthPolicy = knob(HealthPolicy, "")


@dataclass(frozen=True, slots=True)
class BackendsPolicy:
    primary: BackendPolicy = field(metadata={"doc": "The main engine (vLLM)."})
    fallback: BackendPolicy | None = knob(None, "The fallback (Transformers server); optional.")


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    enabled: bool = knob(True, "Tier 2: send traffic to the fallback when the primary fails.")
    on_connect_error: bool = knob(
        True, "Try the other backend when one cannot be reached or fails before any byte."
    )
    max_attempts: int = knob(
        2, "Backends tried per request before its first byte (never 4xx errors)."
    )
    rescue_streams: bool = knob(
        True,
        "Continue a stream that dies mid-answer on the fallback (partial assistant "
        "message + continue_final_message) instead of ending it with an error event.",
    )
    ttft_limit_s: float = knob(
        0.0, "A time to first token above this counts as a backend failure (0 = off)."
    )
    probe_failures: int = knob(
        2,
        "Consecutive failed health probes that mark a backend down (HTTP 503 from vLLM "
        "and refused connections count at once).",
    )
    recovery_probe: bool = knob(
        True,
        "While a breaker is open, test the backend with /health plus a 1-token completion "
        "before letting real traffic back.",
    )


@dataclass(frozen=True, slots=True)
class MaintenancePolicy:
    enabled: bool = knob(True, "Tier 3: answer with the FAQ / maintenance notice.")
    notice: str = knob(
        "The assistant is under maintenance right now. Please try again in a few minutes.",
        "Text of the maintenance answer.",
    )
    retry_after_s: int = knob(30, "`Retry-After` on maintenance answers.")
    status_code: Literal[200, 503] = knob(200, "200 suits chat UIs; 503 suits API clients.")


@dataclass(frozen=True, slots=True)
class LadderPolicy:
    throttle: ThrottlePolicy = knob(ThrottlePolicy, "")
    failover: FailoverPolicy = knob(FailoverPolicy, "")
    maintenance: MaintenancePolicy = knob(MaintenancePolicy, "")
    recovery: RecoveryPolicy = knob(RecoveryPolicy, "")
    breaker: BreakerPolicy = knob(BreakerPolicy, "")
    shared: SharedPolicy = knob(SharedPolicy, "")


@dataclass(frozen=True, slots=True)
class FaqEntry:
    question: str = field(metadata={"doc": "A question this entry answers."})
    answer: str = field(metadata={"doc": "The answer sent in maintenance."})
    keywords: tuple[str, ...] = knob((), "Extra words that point to this entry.")


@dataclass(frozen=True, slots=True)
class FaqFile:
    entries: tuple[FaqEntry, ...] = knob((), "FAQ entries.")


@dataclass(frozen=True, slots=True)
class FaqPolicy:
    file: str | None = knob(
        None, "FAQ YAML (`entries: [{question, answer, keywords}]`), relative to the policy."
    )
    entries: tuple[FaqEntry, ...] = knob((), "Inline FAQ entries (added to the file's).")
    threshold: float = knob(
        0.35, "Minimum match score (0–1) of the user's question for an FAQ answer."
    )


@dataclass(frozen=True, slots=True)
class Policy:
    backends: BackendsPolicy = field(metadata={"doc": ""})
    server: ServerPolicy = knob(ServerPolicy, "")
    sessions: SessionsPolicy = knob(SessionsPolicy, "")
    ladder: LadderPolicy = knob(LadderPolicy, "")
    guard: GuardPolicy = knob(GuardPolicy, "")
    faq: FaqPolicy = knob(FaqPolicy, "")
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
    shared = policy.ladder.shared.redis
    if shared and not shared.startswith(("redis://", "rediss://", "unix://")):
        conv.issue(
            at("ladder", "shared", "redis"),
            f"ladder.shared.redis: expected redis://host:port/db, got {shared!r}",
        )
    if policy.sessions.max_turns < 1:
        conv.issue(at("sessions", "max_turns"), "sessions.max_turns: must be >= 1")
    for kp in policy.ladder.throttle.key_priorities:
        key, sep, prio = kp.rpartition("=")
        if not sep or not key or prio not in ("critical", "normal", "sheddable"):
            conv.issue(
                at("ladder", "throttle", "key_priorities"),
                f"ladder.throttle.key_priorities: {kp!r} is not KEY=critical|normal|sheddable",
            )
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
    """Read a policy file and the files it names (blocking I/O: call at start-up
    or from a thread)."""
    p = Path(path)
    policy = parse_policy(_read_text(p), str(p), env)
    if policy.faq.file:
        faq_path = p.parent / policy.faq.file
        faq = _parse_faq(_read_text(faq_path), str(faq_path))
        policy = dataclasses.replace(
            policy,
            faq=dataclasses.replace(policy.faq, entries=faq.entries + policy.faq.entries),
        )
    return policy


def _read_text(p: Path) -> str:
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise PolicyError([PolicyIssue(str(p), 1, f"cannot read file: {exc.strerror}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PolicyError([PolicyIssue(str(p), line, "file is not valid UTF-8")]) from None


def _parse_faq(text: str, file: str) -> FaqFile:
    conv = _Converter(file, {})
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise PolicyError([PolicyIssue(file, line, f"YAML syntax: {exc.problem}")]) from None
    if root is None:
        return FaqFile()
    faq = conv.dataclass(root, FaqFile, "")
    if conv.issues:
        raise PolicyError(sorted(conv.issues, key=lambda i: i.line))
    return faq


def _type_label(tp: Any) -> str:
    if tp in (int, float, bool, str):
        return str(tp.__name__)
    return str(tp).replace("typing.", "")


def policy_fields(cls: type[Any] = Policy, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every policy knob, for the generated reference."""
    out: list[tuple[str, str, str, str]] = []
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
        out.append((key, _type_label(tp), default, str(f.metadata.get("doc", ""))))
    return out
