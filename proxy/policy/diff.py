"""What a reload changes, shown safely.

`policy_diff` lists one line per changed knob; values of knobs marked secret
in the schema are redacted by that mark (`proxy.policy.knobs`), never by
guessing from key names. Knobs marked `restart` cannot change in a running
process: `split_restart` keeps their running values in the new policy and
says which ones wait for a restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proxy.policy.schema import Policy, knob_index

REDACTED = "<redacted>"
RESTART_MARK = "  (needs restart)"


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """`a.b.c: value` pairs of a policy, for diffs."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.metadata.get("internal"):
                continue
            out.update(flatten(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    out[prefix[:-1]] = obj
    return out


def redact_url(url: str) -> str:
    """The URL without its `user:password@` part (`***@` marks that one was there)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    if "@" not in parts.netloc:
        # An '@' elsewhere is a password the URL parser did not see as one
        # (an unescaped '#', '/' or '?' in it, or no scheme): hide it all.
        return REDACTED if "@" in url else url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def redact(path: str, value: Any) -> Any:
    """`value` as it may be shown outside the process (status, events, logs)."""
    k = knob_index().get(path)
    kind = k.meta.get("secret") if k is not None else None
    if kind is None or value is None or value in ("", ()):
        return value
    if kind == "userinfo":
        return redact_url(str(value))
    if kind == "pairs":
        return tuple(
            f"{REDACTED}={str(v).rpartition('=')[2]}" if "=" in str(v) else REDACTED for v in value
        )
    if isinstance(value, tuple):
        return tuple(REDACTED for _ in value)
    return REDACTED


def policy_hash(policy: Policy) -> str:
    """A short, stable digest of the policy in force (every knob, secrets as
    redacted: a changed token does not change it, and it says nothing of
    one): `brownout_build_info{policy_hash}` and `/brownout/status` tell
    which edit a replica runs."""
    lines = "\n".join(f"{k}={redact(k, v)!r}" for k, v in sorted(flatten(policy).items()))
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def needs_restart(path: str) -> bool:
    k = knob_index().get(path)
    return bool(k is not None and k.meta.get("restart"))


def policy_diff(old: Policy, new: Policy) -> list[str]:
    """What a reload from `old` to `new` would change, one line per knob;
    knobs a running process cannot change end with `(needs restart)`."""
    a, b = flatten(old), flatten(new)
    lines = []
    for key in sorted(a.keys() | b.keys()):
        tail = RESTART_MARK if needs_restart(key) else ""
        if key not in a:
            lines.append(f"+ {key}: {redact(key, b[key])!r}{tail}")
        elif key not in b:
            lines.append(f"- {key}: {redact(key, a[key])!r}{tail}")
        elif a[key] != b[key]:
            lines.append(f"~ {key}: {redact(key, a[key])!r} -> {redact(key, b[key])!r}{tail}")
    return lines


def _replace_path(obj: Any, path: list[str], value: Any) -> Any:
    head, *rest = path
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    child = getattr(obj, head)
    if child is None:
        return obj
    return dataclasses.replace(obj, **{head: _replace_path(child, rest, value)})


def split_restart(old: Policy, new: Policy) -> tuple[Policy, list[str]]:
    """`new` with every restart-only knob set back to its running value in
    `old`, and the paths of those that differ (what a restart would apply)."""
    a, b = flatten(old), flatten(new)
    waiting = [k for k in sorted(a.keys() & b.keys()) if a[k] != b[k] and needs_restart(k)]
    kept = new
    for key in waiting:
        kept = _replace_path(kept, key.split("."), a[key])
    return kept, waiting
