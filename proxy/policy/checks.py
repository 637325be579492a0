"""Cross-field rules that one knob's type and range cannot express.

Each rule names the knob to fix and points at its line (or at the nearest
enclosing key written in the file). Rules that involve a knob already
rejected by the converter are skipped, so one mistake is reported once.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import yaml

from proxy.policy.diff import redact
from proxy.policy.priority import parse_key_priority
from proxy.policy.schema import Policy

if TYPE_CHECKING:
    from proxy.policy.loader import Converter

_URL_RE = re.compile(r"^https?://[^/\s]+")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def node_at(root: yaml.Node, path: str) -> yaml.Node:
    """The value node of a dotted path, or the deepest enclosing one written."""
    node = root
    for key in path.split("."):
        if not isinstance(node, yaml.MappingNode):
            return node
        for kn, vn in node.value:
            if getattr(kn, "value", None) == key:
                node = vn
                break
        else:
            return node
    return node


def cross_checks(policy: Policy, root: yaml.Node, conv: Converter) -> None:
    def bad(path: str, message: str, *involved: str) -> None:
        if any(p in conv.invalid for p in (path, *involved)):
            return
        conv.issue(node_at(root, path), f"{path}: {message}")

    heartbeat = policy.server.heartbeat_s
    rollout_checks(policy, bad)
    if policy.recorder.enabled and not policy.recorder.dir.strip():
        bad("recorder.dir", "must name a directory when the recorder is enabled")
    telemetry_checks(policy, bad)
    for name in ("primary", "fallback", "candidate"):
        b = getattr(policy.backends, name)
        if b is None:
            continue
        pre = f"backends.{name}"
        why = None if _URL_RE.match(b.url) else "not an http(s) URL"
        if why is None:
            why = _url_problem(b.url)
        if why is not None:
            bad(f"{pre}.url", f"{why}: {redact(f'{pre}.url', b.url)!r}")
        if not b.health.path.startswith("/"):
            bad(f"{pre}.health.path", f"must start with '/', got {b.health.path!r}")
        if not b.probe.path.startswith("/"):
            bad(f"{pre}.probe.path", f"must start with '/', got {b.probe.path!r}")
        if b.probe.body:
            try:
                probe_body = json.loads(b.probe.body)
            except ValueError as exc:
                probe_body = exc
            if not isinstance(probe_body, dict):
                bad(f"{pre}.probe.body", "must be a JSON object (as text)")
        for t in ("idle_s", "first_byte_s"):
            limit = getattr(b.timeouts, t)
            if 0 < limit <= heartbeat:
                bad(
                    "server.heartbeat_s",
                    f"must be shorter than {pre}.timeouts.{t} ({limit:g} s): the heartbeat "
                    "would never be sent before the stream is cut",
                    f"{pre}.timeouts.{t}",
                )
    store = policy.sessions.store
    if not (store == "memory://" or store.startswith(_REDIS_SCHEMES)):
        shown = redact("sessions.store", store)
        bad("sessions.store", f"expected memory:// or redis://host:port/db, got {shown!r}")
    elif store != "memory://" and (why := _redis_problem(store)) is not None:
        bad("sessions.store", f"{why}: {redact('sessions.store', store)!r}")
    shared = policy.ladder.shared.redis
    if shared and not shared.startswith(_REDIS_SCHEMES):
        shown = redact("ladder.shared.redis", shared)
        bad("ladder.shared.redis", f"expected redis://host:port/db, got {shown!r}")
    elif shared and (why := _redis_problem(shared)) is not None:
        bad("ladder.shared.redis", f"{why}: {redact('ladder.shared.redis', shared)!r}")
    trim = policy.sessions.trimming
    if trim.low_water >= trim.high_water:
        bad(
            "sessions.trimming.low_water",
            f"must be < high_water ({trim.high_water:g})",
            "sessions.trimming.high_water",
        )

    th = policy.ladder.throttle
    for i, kp in enumerate(th.key_priorities):
        try:
            parse_key_priority(kp)
        except ValueError as exc:  # the message never quotes the key
            bad("ladder.throttle.key_priorities", f"item {i} {exc}")
    # throttled_limit only matters in fixed mode, min_limit only in adaptive mode.
    for knob_name in ("min_limit" if th.mode == "adaptive" else "throttled_limit",):
        value = getattr(th, knob_name)
        if value > th.max_inflight:
            bad(
                f"ladder.throttle.{knob_name}",
                f"must be <= max_inflight ({th.max_inflight}), got {value}",
                "ladder.throttle.max_inflight",
            )
    if th.baseline_window_s <= th.ttft_window_s:
        bad(
            "ladder.throttle.baseline_window_s",
            f"must be longer than ttft_window_s ({th.ttft_window_s:g} s)",
            "ladder.throttle.ttft_window_s",
        )

    ramp = policy.ladder.recovery.ramp
    if not ramp:
        bad("ladder.recovery.ramp", "must list at least one share (ending at 1)")
    elif any(b <= a for a, b in itertools.pairwise(ramp)):
        bad("ladder.recovery.ramp", f"shares must rise step by step, got {list(ramp)}")
    elif ramp[-1] != 1.0:
        bad("ladder.recovery.ramp", f"must end at 1 (all traffic), got {ramp[-1]:g}")

    g = policy.guard
    rc = g.replacement_chars
    if rc.max_in_window >= rc.window_chars:
        bad(
            "guard.replacement_chars.max_in_window",
            f"must be < window_chars ({rc.window_chars})",
            "guard.replacement_chars.window_chars",
        )
    for i, tok in enumerate(g.special_tokens.tokens):
        if not tok or len(tok) > 256:
            bad("guard.special_tokens.tokens", f"item {i} must be 1–256 characters")


def _url_problem(url: str) -> str | None:
    """Why a URL's host, port or userinfo would not be used as written."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if "@" in url and "@" not in parts.netloc:
        # Checked first: the text before that '@' is a password, never shown.
        return "not a valid URL (escape '@', '/', '?' and '#' in the password as %XX)"
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError as exc:  # the port comes after any userinfo: not a secret
        return f"not a valid URL ({exc})"
    if not parts.hostname and not parts.path.startswith("/"):
        return "not a valid URL (no host)"
    return None


def _redis_problem(url: str) -> str | None:
    """What redis-py would refuse in a redis://, rediss:// or unix:// URL."""
    why = _url_problem(url)
    if why is not None:
        return why
    parts = urlsplit(url)
    db = parse_qs(parts.query).get("db", [""])[0]
    if parts.scheme in ("redis", "rediss") and not db:
        db = parts.path.lstrip("/")
    if db and not db.isdigit():
        return f"not a valid Redis URL (the database must be a number, got {db!r})"
    return None


_WINDOW_RE = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")
_HEADER_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def telemetry_checks(policy: Policy, bad: Callable[..., None]) -> None:
    """`telemetry:`: the collector's URL, the export headers, batch within queue."""
    t = policy.telemetry
    if t.otlp_endpoint:
        url = t.otlp_endpoint
        why = None if _URL_RE.match(url) else "not an http(s) URL"
        if why is None:
            why = _url_problem(url)
        if why is not None:
            bad("telemetry.otlp_endpoint", f"{why}: {redact('telemetry.otlp_endpoint', url)!r}")
    for item in t.otlp_headers:
        name, eq, _ = item.partition("=")
        if not eq or not _HEADER_RE.match(name):
            shown = f"{name}=***" if eq else "***"
            bad("telemetry.otlp_headers", f"must be NAME=value items, got {shown!r}")
    if t.max_batch_spans > t.max_queue_spans:
        bad(
            "telemetry.max_batch_spans",
            f"must not exceed telemetry.max_queue_spans ({t.max_queue_spans})",
            "telemetry.max_queue_spans",
        )


def rollout_checks(policy: Policy, bad: Callable[..., None]) -> None:
    """`rollout:`: steps, sticky, priorities, advance window, time zone."""
    r = policy.rollout
    steps = r.steps
    if not steps:
        bad("rollout.steps", "must list at least one share (the last one 1)")
    else:
        if any(b <= a for a, b in itertools.pairwise(steps)):
            bad("rollout.steps", f"must rise step by step, got {list(steps)}")
        if steps[-1] != 1:
            bad("rollout.steps", f"must end at 1 (all eligible traffic), got {steps[-1]:g}")
    sticky = r.sticky
    if sticky not in ("session", "api_key", "none") and not (
        sticky.startswith("header:") and _HEADER_RE.match(sticky[7:])
    ):
        bad(
            "rollout.sticky",
            f"must be session, api_key, header:NAME or none, got {sticky!r}",
        )
    from proxy.policy.priority import PRIORITIES

    for p in r.priorities:
        if p not in PRIORITIES:
            bad("rollout.priorities", f"unknown priority {p!r} (one of {', '.join(PRIORITIES)})")
    for g in r.gates.advance_on:
        if g not in ("ttft_ratio", "p99_ratio"):
            bad("rollout.gates.advance_on", f"unknown ratio gate {g!r} (ttft_ratio, p99_ratio)")
    if r.advance_window is not None and not _WINDOW_RE.match(r.advance_window):
        bad("rollout.advance_window", f'must be "HH:MM-HH:MM", got {r.advance_window!r}')
    try:
        import zoneinfo

        zoneinfo.ZoneInfo(r.timezone)
    except (ValueError, KeyError, OSError):  # ZoneInfoNotFoundError is a KeyError
        bad("rollout.timezone", f"unknown time zone {r.timezone!r}")
    if r.auto_start and policy.backends.candidate is None:
        bad("rollout.auto_start", "needs backends.candidate (the engine to roll out)")
