"""What a replay says: the figures of each run, the recording's own, the
fidelity of the baseline, the comparison and `--fail-on`.

Figures (per run, and the recording's own where it has them):

- `tier_seconds`: seconds in each tier over the trace; `transitions`: tier changes;
- `client_errors`: requests a client saw fail (an HTTP 5xx other than a
  maintenance answer, a stream ended by an error event that was not
  rescued) — not sheds (429) and not requests refused for their own sake;
- `maintenance_answers`; `shed` by priority (429s from admission);
- `failovers`: requests answered by the fallback (rescues not included);
- `rescues`: streams cut mid-answer and finished on the fallback;
- `ttft_p50_s`, `ttft_p95_s`: arrival → first byte of the streamed requests
  a backend answered (a non-streaming answer's first byte is its last;
  maintenance answers and errors are not in them).

Fidelity (only when the baseline is the policy the trace was recorded
with): `tier_agreement` is the share of the trace's time the replay spends
in the recorded tier; shed, maintenance and error counts are compared with
the recording (within 10 %, or 2 requests for small counts) and so are the
TTFT percentiles (within 25 %, or 50 ms). The replay is called trustworthy
for the trace when the agreement is at least 0.95 and every comparison
holds; otherwise the report says which did not, and where the tiers
parted.

Worse (`--fail-on`): a count is worse when the candidate's exceeds the
baseline's by more than max(1, 2 %); `ttft_p95` when it is more than 5 %
(and 5 ms) slower; `shed` compares the total over priorities.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from proxy.control.ladder import TIERS
from proxy.replay.sim import Run, tier_at, tier_seconds
from proxy.replay.trace import Trace

AGREEMENT_MIN = 0.95
COUNT_TOLERANCE = 0.10
COUNT_SLACK = 2
TTFT_TOLERANCE = 0.25
TTFT_SLACK_S = 0.05


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _p50_p95(xs: list[float]) -> tuple[float | None, float | None]:
    """`percentile(xs, 0.5)`, `percentile(xs, 0.95)` from one sort."""
    if not xs:
        return None, None
    s = sorted(xs)
    n = len(s)
    return (
        s[min(n - 1, max(0, math.ceil(0.5 * n) - 1))],
        s[min(n - 1, max(0, math.ceil(0.95 * n) - 1))],
    )


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def summary(run: Run) -> dict[str, Any]:
    secs = tier_seconds(run.tiers, run.duration)
    p50, p95 = _p50_p95(run.ttfts)
    return {
        "tier_seconds": {t: round(v, 2) for t, v in secs.items()},
        "transitions": len(run.transitions),
        "client_errors": run.client_errors,
        "maintenance_answers": run.maintenance_answers,
        "shed": dict(run.shed),
        "failovers": run.failovers,
        "rescues": run.rescues,
        "ttft_p50_s": _r(p50),
        "ttft_p95_s": _r(p95),
        "requests": run.requests,
        "answered": dict(run.answered),
        "timeline": [
            {"t": round(t, 2), "from": a, "to": b, "reason": why}
            for t, a, b, why in run.transitions
        ],
    }


def recorded_tiers(trace: Trace) -> list[tuple[float, str]]:
    out = [(0.0, trace.initial_tier)]
    out.extend((t, to) for t, _frm, to, _why in trace.tiers)
    return out


def observed(trace: Trace) -> dict[str, Any]:
    """The recording's own figures (what happened)."""
    shed = {"critical": 0, "normal": 0, "sheddable": 0}
    errors = maint = failovers = rescues = 0
    ttfts: list[float] = []
    answered = {"primary": 0, "fallback": 0}
    for q in trace.requests:  # (Request's properties inline: a day is millions)
        outcome, status, backend = q.outcome, q.status, q.backend
        if outcome.startswith("shed"):  # q.shed
            shed[q.priority] = shed.get(q.priority, 0) + 1
        elif backend == "maintenance":  # q.maintenance
            maint += 1
        elif (
            outcome == "rejected"  # q.intrinsic (not shed)
            or (400 <= status < 500 and status != 429)
            or outcome == "client_disconnect"  # q.client_gone
        ):
            continue
        elif status >= 500 or outcome != "complete":
            errors += 1
        else:
            if q.rescued:
                rescues += 1
            elif backend == "fallback":
                failovers += 1
            if backend in answered:
                answered[backend] += 1
            if q.ttft is not None and q.stream:
                ttfts.append(q.ttft)
    tiers = recorded_tiers(trace)
    secs = tier_seconds(tiers, trace.end)
    p50, p95 = _p50_p95(ttfts)
    return {
        "tier_seconds": {t: round(v, 2) for t, v in secs.items()},
        "transitions": len(trace.tiers),
        "client_errors": errors,
        "maintenance_answers": maint,
        "shed": shed,
        "failovers": failovers,
        "rescues": rescues,
        "ttft_p50_s": _r(p50),
        "ttft_p95_s": _r(p95),
        "requests": len(trace.requests),
        "answered": answered,
        "timeline": [
            {"t": round(t, 2), "from": a, "to": b, "reason": why} for t, a, b, why in trace.tiers
        ],
    }


def agreement(a: list[tuple[float, str]], b: list[tuple[float, str]], end: float) -> float:
    """Share of [0, end] where the two tier timelines agree."""
    if end <= 0:
        return 1.0
    cuts = sorted({0.0, end, *(t for t, _ in a if 0 < t < end), *(t for t, _ in b if 0 < t < end)})
    same = 0.0
    for lo, hi in itertools.pairwise(cuts):
        mid = (lo + hi) / 2
        if tier_at(a, mid) == tier_at(b, mid):
            same += hi - lo
    return same / end


def _parted(a: list[tuple[float, str]], b: list[tuple[float, str]], end: float) -> str:
    """The longest stretch where the timelines disagree, in words."""
    cuts = sorted({0.0, end, *(t for t, _ in a if 0 < t < end), *(t for t, _ in b if 0 < t < end)})
    best: tuple[float, float, str, str] | None = None
    run_start: float | None = None
    for lo, hi in itertools.pairwise(cuts):
        mid = (lo + hi) / 2
        ta, tb = tier_at(a, mid), tier_at(b, mid)
        if ta != tb:
            if run_start is None:
                run_start = lo
            if best is None or hi - run_start > best[1] - best[0]:
                best = (run_start, hi, ta, tb)
        else:
            run_start = None
    if best is None:
        return ""
    lo, hi, ta, tb = best
    return f"longest disagreement {hi - lo:.1f} s from t={lo:.1f} s: recorded {ta}, replayed {tb}"


def _close(a: float, b: float, rel: float, slack: float) -> bool:
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), slack)


def fidelity(
    trace: Trace,
    baseline: Run,
    rec: dict[str, Any] | None = None,
    rep: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`rec`, `rep`: `observed(trace)` and `summary(baseline)` where the
    caller has them already."""
    rec = observed(trace) if rec is None else rec
    rep = summary(baseline) if rep is None else rep
    rec_tiers = recorded_tiers(trace)
    agree = agreement(rec_tiers, baseline.tiers, trace.end)
    reasons: list[str] = []
    counts: dict[str, dict[str, Any]] = {}
    pairs = {
        "shed": (sum(rec["shed"].values()), sum(rep["shed"].values())),
        "maintenance_answers": (rec["maintenance_answers"], rep["maintenance_answers"]),
        "client_errors": (rec["client_errors"], rep["client_errors"]),
    }
    for key, (r, p) in pairs.items():
        ok = _close(r, p, COUNT_TOLERANCE, COUNT_SLACK)
        counts[key] = {"recorded": r, "replayed": p, "ok": ok}
        if not ok:
            reasons.append(f"{key}: recorded {r}, replayed {p} (more than 10 % apart)")
    for key in ("ttft_p50_s", "ttft_p95_s"):
        r, p = rec[key], rep[key]
        ok = r is None or p is None or _close(r, p, TTFT_TOLERANCE, TTFT_SLACK_S)
        counts[key] = {"recorded": r, "replayed": p, "ok": ok}
        if not ok:
            reasons.append(f"{key}: recorded {r} s, replayed {p} s (more than 25 % apart)")
    if agree < AGREEMENT_MIN:
        where = _parted(rec_tiers, baseline.tiers, trace.end)
        reasons.insert(
            0, f"tier agreement {agree:.3f} < {AGREEMENT_MIN}" + (f": {where}" if where else "")
        )
    if trace.gaps:
        reasons.append(f"the recorder dropped {trace.gaps} records: the trace has holes")
    stalls = trace.stalls()
    if stalls and reasons:
        longest = max(b - a for a, b in stalls)
        reasons.append(
            f"the recorded proxy's event loop stood still {len(stalls)} time(s), up to "
            f"{longest:.1f} s (a busy host?): its timing there is not reproducible"
        )
    if trace.truncated:
        reasons.append(f"{trace.truncated} segment(s) cut short by a crash")
    return {
        "tier_agreement": round(agree, 4),
        "counts": counts,
        "trustworthy": agree >= AGREEMENT_MIN
        and all(c["ok"] for c in counts.values())
        and not trace.gaps,
        "reasons": reasons,
    }


def worse_on(base: dict[str, Any], cand: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    out = []
    for key in keys:
        if key == "ttft_p95":
            b, c = base["ttft_p95_s"], cand["ttft_p95_s"]
            if c is not None and (b is None or c > b * 1.05 + 0.005):
                out.append(key)
            continue
        b = sum(base[key].values()) if key == "shed" else base[key]
        c = sum(cand[key].values()) if key == "shed" else cand[key]
        if c - b > max(1.0, 0.02 * b):
            out.append(key)
    return out


def better_on(base: dict[str, Any], cand: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    return worse_on(cand, base, keys)


# --------------------------------------------------------------------------- text


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if isinstance(v, dict):
        return " / ".join(str(v.get(p, 0)) for p in ("critical", "normal", "sheddable"))
    return str(v)


def text(report: dict[str, Any]) -> str:
    tr = report["trace"]
    lines = [
        f"trace {tr['source']}: {tr['duration_s']:.1f} s, {tr['requests']} requests"
        + (f", recorded under policy {tr['policy_hash']}" if tr.get("policy_hash") else "")
        + (" (synthetic)" if tr.get("synthetic") else ""),
    ]
    fid = report.get("fidelity")
    if fid is not None:
        verdict = "trustworthy" if fid["trustworthy"] else "NOT trustworthy for this trace"
        lines.append(f"fidelity: tier agreement {fid['tier_agreement']:.1%}; {verdict}")
        for why in fid["reasons"]:
            lines.append(f"  - {why}")
    cols = [("baseline", report["baseline"]), ("candidate", report["candidate"])]
    if report.get("recorded") is not None:
        cols.insert(0, ("recorded", report["recorded"]))
    head = f"{'':28}" + "".join(f"{name:>16}" for name, _ in cols)
    lines += ["", head]
    rows: list[tuple[str, Any]] = [
        (f"s in {t}", lambda d, t=t: d["tier_seconds"][t]) for t in TIERS
    ]
    rows += [
        ("tier transitions", lambda d: d["transitions"]),
        ("client errors", lambda d: d["client_errors"]),
        ("maintenance answers", lambda d: d["maintenance_answers"]),
        ("shed (crit/normal/shed.)", lambda d: d["shed"]),
        ("failovers (fallback)", lambda d: d["failovers"]),
        ("rescues", lambda d: d["rescues"]),
        ("TTFT p50 s", lambda d: d["ttft_p50_s"]),
        ("TTFT p95 s", lambda d: d["ttft_p95_s"]),
    ]
    for label, get in rows:
        lines.append(f"{label:28}" + "".join(f"{_fmt(get(d)):>16}" for _, d in cols))
    if report.get("worse_on"):
        lines.append(f"\ncandidate worse on: {', '.join(report['worse_on'])}")
    if report.get("better_on"):
        lines.append(f"candidate better on: {', '.join(report['better_on'])}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
