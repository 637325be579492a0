"""The admin endpoints from the command line: `brownout reload` and the HTTP
call `brownout rollout` shares with it (`call`).

A signal needs the process id, and `pidof brownout` finds nothing for a
Python console script (the process is `python`), so the CLI calls the admin
endpoint `POST /brownout/reload` instead, with the admin token. Standard
library only: the command must start fast and needs no event loop.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXIT_REJECTED",
    "EXIT_UNREACHABLE",
    "ReloadOutcome",
    "call",
    "render",
    "request_reload",
]

#: The proxy answered and kept its running policy (the new one is invalid).
EXIT_REJECTED = 1
#: The proxy could not be reached, or refused the request (token, admin off).
EXIT_UNREACHABLE = 3

# Keys of the reload answer shown as a list of lines, in this order; any other
# list in the answer (e.g. a future "needs_restart") is shown after them.
_KNOWN = ("ok", "at", "trigger", "changes", "errors")


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What the proxy answered: the HTTP status and the decoded JSON body
    (None when it could not be reached or did not answer JSON)."""

    status: int | None
    body: dict[str, Any] | None
    problem: str | None = None


def request_reload(url: str, token: str | None, timeout_s: float) -> ReloadOutcome:
    """POST {url}/brownout/reload with the token; never raises for HTTP or network errors."""
    return call(url, "/brownout/reload", token, timeout_s, method="POST", data=b"")


def call(
    url: str,
    path: str,
    token: str | None,
    timeout_s: float,
    *,
    method: str = "GET",
    data: bytes | None = None,
) -> ReloadOutcome:
    """One admin request (a JSON body when `data` is given); never raises for
    HTTP or network errors: they come back as the outcome's `problem`."""
    try:
        req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
        if data:
            req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
    # Refused, timeout, DNS, a bad URL, or something that is not an HTTP
    # server (a bad status line, a body cut short).
    except (OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        return ReloadOutcome(None, None, f"cannot reach {url}: {reason}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return ReloadOutcome(status, None, f"{url} answered HTTP {status} without JSON")
    if not isinstance(body, dict):
        return ReloadOutcome(status, None, f"{url} answered HTTP {status} with unexpected JSON")
    return ReloadOutcome(status, body)


def render(outcome: ReloadOutcome) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) for an outcome."""
    body = outcome.body
    if outcome.problem is not None or body is None:
        return EXIT_UNREACHABLE, [], [f"brownout reload: {outcome.problem or 'no answer'}"]
    if body.get("ok") is False and isinstance(body.get("errors"), list):
        # The proxy read the new policy and kept the running one (HTTP 422);
        # its answer carries an error object too, but this is no refusal.
        errors = [str(e) for e in body["errors"]]
        return (
            EXIT_REJECTED,
            [],
            ["brownout reload: rejected, the running policy is unchanged:", *errors],
        )
    if "error" in body and isinstance(body["error"], dict):
        message = body["error"].get("message", "error")
        return EXIT_UNREACHABLE, [], [f"brownout reload: HTTP {outcome.status}: {message}"]
    if body.get("ok") is True and isinstance(body.get("changes", []), list):
        changes = [str(c) for c in body.get("changes") or ()]
        out = ["reloaded: " + (f"{len(changes)} change(s)" if changes else "no changes")]
        out += [f"  {c}" for c in changes]
        for key, value in body.items():
            if key not in _KNOWN and isinstance(value, list) and value:
                out.append(f"{key.replace('_', ' ')}:")
                out += [f"  {v}" for v in value]
        return 0, out, []
    return (
        EXIT_UNREACHABLE,
        [],
        [f"brownout reload: HTTP {outcome.status}: not a reload answer: {str(body)[:200]}"],
    )
