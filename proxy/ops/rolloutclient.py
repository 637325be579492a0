"""`brownout rollout status|start|pause|resume|abort|promote`: the gray
release from the command line, through `GET/POST /brownout/rollout`.

The answer is rendered as a short summary an SRE reads at a glance (state,
step i/n and share, time held, each gate's verdict and figures, the failed
gate and why, the rollback bundles), or printed as the proxy's JSON with
`--json`. Exit codes as `brownout reload`'s: 0 done, 1 the proxy refused the
action (409: it does not apply in this state, or no candidate is configured;
400), 3 the proxy could not be reached or refused the request (token, admin
endpoints off). Standard library only, like `adminclient`.

Every string shown comes from the proxy, and some from a backend (a
candidate's error detail becomes the rollback reason): control characters
and lone surrogates are escaped and long texts cut, so a hostile upstream
cannot drive the operator's terminal, nor make `print` raise.
"""

from __future__ import annotations

import json
import math
from typing import Any

from proxy.ops.adminclient import EXIT_REJECTED, EXIT_UNREACHABLE, ReloadOutcome, call

__all__ = ["ACTIONS", "render_rollout", "request_rollout", "summary"]

ACTIONS = ("status", "start", "pause", "resume", "abort", "promote")
_DONE = {
    "start": "started",
    "pause": "paused",
    "resume": "resumed",
    "abort": "aborted",
    "promote": "promoted",
}
STATES = ("idle", "mirror", "step", "paused", "complete", "rolled_back", "aborted")
_RATIO_GATES = ("ttft_ratio", "p99_ratio")  # value: a ratio; arms: seconds
_SHARE_GATES = ("error_rate", "quality")  # value and arms: shares
_MAX_TEXT = 300


def request_rollout(url: str, action: str, token: str | None, timeout_s: float) -> ReloadOutcome:
    """GET /brownout/rollout for `status`, else POST {"action": action}."""
    if action == "status":
        return call(url, "/brownout/rollout", token, timeout_s)
    data = json.dumps({"action": action}).encode()
    return call(url, "/brownout/rollout", token, timeout_s, method="POST", data=data)


def render_rollout(
    outcome: ReloadOutcome, action: str, *, as_json: bool = False
) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines). With `as_json` stdout holds
    the proxy's JSON answer as it came (errors included) and stderr the
    reason of a non-zero exit."""
    who = f"brownout rollout {action}"
    body = outcome.body
    if outcome.problem is not None or body is None:
        return EXIT_UNREACHABLE, [], [f"{who}: {clean(outcome.problem or 'no answer')}"]
    out = [json.dumps(body, indent=2)] if as_json else []
    err = body.get("error")
    if isinstance(err, dict):
        message = clean(err.get("message", "error"))
        if outcome.status in (400, 409):
            return EXIT_REJECTED, out, [f"{who}: refused (HTTP {outcome.status}): {message}"]
        return EXIT_UNREACHABLE, out, [f"{who}: HTTP {outcome.status}: {message}"]
    if outcome.status != 200 or body.get("state") not in STATES:
        text = clean(json.dumps(body)[:200])
        return (
            EXIT_UNREACHABLE,
            out,
            [f"{who}: HTTP {outcome.status}: not a rollout answer: {text}"],
        )
    if as_json:
        return 0, out, []
    lines = summary(body)
    if action in _DONE:
        lines.insert(0, f"rollout {_DONE[action]}")
    return 0, lines, []


def summary(snap: dict[str, Any]) -> list[str]:
    """The lines of `brownout rollout status` for a `/brownout/rollout` answer."""
    if snap.get("configured") is False:
        return ["rollout: not configured (set backends.candidate in the policy)"]
    state = str(snap.get("state"))
    steps = [s for s in _list(snap.get("steps")) if _is_num(s)]
    n = len(steps)
    ident = f"rollout {clean(snap['id'])}" if snap.get("id") else "rollout"
    at = _step_of(snap)
    where = f"step {at + 1}/{n}" if at is not None and n else "step ?"
    share = _share(snap.get("share"))
    head = {
        "idle": "idle (not started)",
        "mirror": "mirror (live traffic copied, no user on the candidate)",
        "step": f"{where} · {share}",
        "paused": f"paused at {where} · {share}",
        "complete": f"complete · {share}",
        "rolled_back": f"rolled back at {where} · all traffic on the primary",
        "aborted": f"aborted at {where} · all traffic on the primary",
    }.get(state, clean(state))
    lines = [f"{ident}: {head}"]

    def row(key: str, value: str) -> None:
        lines.append(f"  {key:<12} {value}")

    held, step_s = snap.get("step_held_s"), snap.get("step_s")
    if _is_num(held):
        row("held", f"{_secs(held)} of {_secs(step_s)}" if _is_num(step_s) else _secs(held))
    if state == "idle" and steps:
        each = f", {_secs(step_s)} each" if _is_num(step_s) else ""
        row("steps", " → ".join(_share(s) for s in steps) + each)
    if snap.get("failed_gate"):
        row("failed gate", clean(snap["failed_gate"]))
    # The state machine keeps the last reason after a resume or a promote:
    # shown only where it explains the state.
    if snap.get("reason") and state in ("paused", "rolled_back", "aborted"):
        row("reason", clean(snap["reason"]))
    cand = snap.get("candidate")
    if isinstance(cand, dict):
        health = "healthy" if cand.get("healthy") and not cand.get("down") else "unhealthy"
        row("candidate", f"{health} · breaker {clean(cand.get('breaker', '?'))}")
    if snap.get("sticky"):
        prios = ", ".join(clean(p) for p in _list(snap.get("priorities")))
        row("sticky", clean(snap["sticky"]) + (f" · first: {prios}" if prios else ""))
    lines += _gates(snap.get("gates"), running=state in ("mirror", "step", "paused"))
    bundles = [clean(b) for b in _list(snap.get("bundles"))]
    if bundles:
        row("bundles", bundles[0])
        lines += [f"  {'':<12} {b}" for b in bundles[1:]]
    elif state == "rolled_back" and not snap.get("bundle_error"):
        row("bundles", f"(being written under {clean(snap.get('snapshot_dir', '?'))})")
    if snap.get("bundle_error"):
        row("bundle error", clean(snap["bundle_error"]))
    if snap.get("state_error"):
        row("state error", clean(snap["state_error"]))
    return lines


def _gates(report: Any, *, running: bool) -> list[str]:
    if not isinstance(report, dict):
        return []
    samples = report.get("samples")
    counts = ""
    if isinstance(samples, dict):
        counts = " · samples " + ", ".join(
            f"{clean(k)} {clean(v)}" for k, v in samples.items() if isinstance(k, str)
        )
    ready = "ready to advance" if report.get("ready") else "not ready to advance"
    if not running:
        ready = "last evaluation"
    lines = [f"  {'gates':<12} {ready}{counts}"]
    for g in _list(report.get("gates")):
        if not isinstance(g, dict):
            continue
        name = clean(g.get("gate", "?"))
        gate = str(g.get("gate"))
        value = _gate_num(gate, g.get("value"), arm=False)
        limit = _gate_num(gate, g.get("limit"), arm=False)
        line = f"    {name:<12} {clean(g.get('verdict', '?')):<5} {value} (limit {limit})"
        if _is_num(g.get("low")) and _is_num(g.get("high")):
            lo, hi = _gate_num(gate, g["low"], arm=False), _gate_num(gate, g["high"], arm=False)
            line += f" [{lo}–{hi}]"
        arms = g.get("arms")
        if isinstance(arms, dict) and arms:
            line += "  " + " · ".join(
                f"{clean(arm)} {_gate_num(gate, v, arm=True)}" for arm, v in arms.items()
            )
        if g.get("detail"):
            line += f"  {clean(g['detail'])}"
        lines.append(line)
    return lines


# -- formatting ------------------------------------------------------------------


def clean(value: Any) -> str:
    """A value from the proxy as one safe line: control characters (C0, C1,
    line separators) and lone surrogates escaped, at most 300 characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_TEXT:
        text = text[: _MAX_TEXT - 1] + "…"
    if text.isprintable() and text.isascii():
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o < 0xA0 or 0xD800 <= o < 0xE000 or o in (0x2028, 0x2029):
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else []


def _step_of(snap: dict[str, Any]) -> int | None:
    """The step now, or (rolled back, aborted) the step it ended at: the last
    history entry's."""
    step = snap.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    for h in reversed(_list(snap.get("history"))):
        if isinstance(h, dict) and isinstance(h.get("step"), int):
            return int(h["step"])
    return None


def _share(v: Any) -> str:
    return f"{v * 100:.4g} %" if _is_num(v) else "? %"


def _secs(v: Any) -> str:
    if not _is_num(v):
        return "?"
    return f"{v:.0f} s" if v >= 10 else f"{v:.3g} s"


def _gate_num(gate: str, v: Any, *, arm: bool) -> str:
    if v is None:
        return "–"
    if not _is_num(v):
        return clean(v)
    if gate in _RATIO_GATES:
        if arm:  # each arm's latency figure
            return f"{v * 1000:.3g} ms" if v < 1 else f"{v:.2f} s"
        return f"{v:.2f}"
    if gate in _SHARE_GATES:
        return f"{v * 100:.3g} %"
    if gate == "oom":
        return f"{v:.0f}"
    return f"{v:.3g}"
