"""Drill results as Markdown: a summary table, then a table and a timeline per drill."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tests.chaos.badcanary import CANARY_STEPS, ROLLBACK_LIMIT_S, ROUTED_GRACE_S, CanarySummary
from tests.chaos.hostile import HostileSummary
from tests.chaos.scenarios import DrillResult, Durations

__all__ = ["canary_section", "hostile_section", "render", "replay_section", "summary_table"]


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} s"


def _detect(r: DrillResult) -> str:
    parts = []
    for f in r.faults:
        if f.detect == "none":
            continue
        parts.append(_s(f.detect_s))
    return " / ".join(parts) if parts else "—"


def _tiers(r: DrillResult) -> str:
    if not r.transitions:
        return "normal (no change)"
    path = [r.transitions[0]["from"]] + [t["to"] for t in r.transitions]
    return " → ".join(path)


def _fidelity(r: DrillResult) -> str:
    rep = r.replay
    if rep is None:
        return "—"
    if "error" in rep:
        return "error"
    agree = rep.get("tier_agreement")
    return "—" if agree is None else f"{agree:.1%}" + ("" if rep.get("trustworthy") else " (!)")


def replay_section(r: DrillResult) -> str:
    """The drill's recording replayed under its own policy (issue 22)."""
    rep = r.replay
    if rep is None:
        return ""
    if "error" in rep:
        return f"**Replay**: {rep['error']}\n"
    rec, out = rep["recorded"], rep["replayed"]
    lines = [
        f"**Replay of the drill's flight recording** under its own policy "
        f"(`brownout replay --trace {Path(rep['file']).name}`, {rep['requests']} requests, "
        f"{rep['cpu_s']:.2f} s of CPU): tier agreement **{rep['tier_agreement']:.1%}**, "
        + (
            "trustworthy."
            if rep["trustworthy"]
            else "**not trustworthy**: " + "; ".join(rep["reasons"]) + "."
        ),
        "",
        "| | recorded | replayed |",
        "|---|---:|---:|",
    ]
    for tier in ("normal", "throttle", "failover", "maintenance"):
        lines.append(
            f"| seconds in {tier} | {rec['tier_seconds'][tier]:.1f} "
            f"| {out['tier_seconds'][tier]:.1f} |"
        )
    for key in (
        "transitions",
        "client_errors",
        "maintenance_answers",
        "failovers",
        "rescues",
        "ttft_p50_s",
        "ttft_p95_s",
    ):
        lines.append(f"| {key.replace('_', ' ')} | {rec[key]} | {out[key]} |")
    lines.append(f"| shed | {sum(rec['shed'].values())} | {sum(out['shed'].values())} |")
    return "\n".join(lines) + "\n"


def summary_table(results: Sequence[DrillResult]) -> str:
    head = (
        "| # | drill | sent | complete | rescued | maintenance | explicit errors "
        "| truncated as success | hung | detect | back to normal | lost turns | tiers "
        "| replay fidelity | verdict |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---|\n"
    )
    rows = []
    for r in results:
        c = r.counts
        rows.append(
            f"| {r.number} | {r.title} | {c['sent']} | {c['complete']} | {c['rescued']} "
            f"| {c['maintenance']} | {c['error']} | {c['truncated']} | {c['hung']} "
            f"| {_detect(r)} | {_s(r.back_to_normal_s)} | {r.sessions['lost']} "
            f"| {_tiers(r)} | {_fidelity(r)} | {'pass' if r.ok else 'FAIL'} |"
        )
    return head + "\n".join(rows) + "\n"


def _labels(labels: str) -> str:
    return labels.strip("{}").replace('"', "") or "-"


def hostile_section(h: HostileSummary) -> str:
    """Drill 8's own figures: everyone else, the hostile client, the counters."""
    share = f"{h.others_share:.1%}" if h.others_total else "—"
    out = [
        "**Other clients** (the load, requests that ended during and after the hostile "
        f"client): **{h.others_normal} of {h.others_total} answered normally = {share}** "
        f"(goal 100 %); of those {h.others_fallback} by the fallback."
        + (f" Not normal: {h.others_bad}." if h.others_bad else ""),
        "",
        f"**Hostile client** (127.0.0.2 through nginx): {sum(h.hostile_verdicts.values())} "
        "requests; "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(h.hostile_verdicts.items()))
        + " (answer: a valid answer; clear error: an OpenAI error object with a 4xx, 502 or "
        "504, or in-band in a stream; bad: a 500, a broken reply, or none within the "
        "client's timeout).",
        "",
        "| hostile kind | answers by status and error code |",
        "|---|---|",
    ]
    out.extend(
        f"| `{k}` | " + ", ".join(f"{lab} × {n}" for lab, n in sorted(v.items())) + " |"
        for k, v in h.hostile_by_kind.items()
    )
    slow, longs, longest = h.slow_non_stream
    out.append(
        f"\nLong non-stream answers that took longer than the primary's first_byte_s "
        f"({h.first_byte_s:g} s; before issue 20 each was a backend fault): {slow} of "
        f"{longs} answered (longest {longest:.1f} s)."
    )
    seen = "; ".join(f"{k}: {', '.join(v)}" for k, v in h.breakers_seen.items())
    out.append(f"\nBackend states seen in /brownout/status (health/breaker): {seen or '—'}.")
    if h.bad_examples:
        out.append("\nHostile requests without a clear error:\n")
        out.extend(f"- {e}" for e in h.bad_examples)
    out.append("\nCounters during the drill (deltas of the proxy's /metrics):\n")
    if h.metrics:
        out.append("| counter | labels | Δ |\n|---|---|---:|")
        for fam, series in sorted(h.metrics.items()):
            out.extend(f"| `{fam}` | {_labels(lab)} | {v:g} |" for lab, v in sorted(series.items()))
    else:
        out.append("(none moved)")
    if not h.metrics.get("brownout_breaker_transitions_total"):
        out.append(
            "\n`brownout_breaker_transitions_total`: no change (both breakers stayed closed)."
        )
    return "\n".join(out) + "\n"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"


def canary_section(s: CanarySummary, sent: int) -> str:
    """Drill 9's own figures: the rollback, what users saw, the bundle."""
    steps = len(CANARY_STEPS)
    out = []
    if s.rolled_back_at is not None:
        step = (s.rolled_back_step or 0) + 1
        out.append(
            f"**Rollback: {_s(s.rollback_s)} after the fault** (goal ≤ {ROLLBACK_LIMIT_S:.0f} s), "
            f"by gate `{s.failed_gate}` at step {step} of {steps}: {s.gate_detail or '—'}. "
            f"Times: the proxy's own (its rollout history); `GET /brownout/rollout` "
            f"(polled every 0.1 s) showed `rolled_back` {_s(s.polled_s)} after the fault. The "
            f"candidate's first failed request came {_s(s.first_failure_s)} after the fault, "
            f"the rollback {_s(s.detect_to_rollback_s)} after that."
        )
    else:
        out.append(f"**No rollback** (state `{s.state}`).")
    out.append(
        f"\n**Requests that saw an error: {s.saw_error}** of {sent} (goal 0; explicit errors, "
        "truncated answers and hung requests of the whole drill)."
    )
    failed = sum(s.candidate_failed.values())
    out.append(
        f"\nThe candidate failed {failed} of the load's requests ("
        f"{_counts(s.candidate_failed)}: `oom` = a 500 before the first byte, `cut` = a "
        "stream ended mid-answer by the engine error event); what their clients got: "
        f"{_counts(s.failed_outcomes)}. Its other failed generation requests (the "
        f"proxy's own recovery probes): {s.probes_failed}. The load's requests that reached "
        f"the candidate more than {ROUTED_GRACE_S:g} s after the rollback: "
        f"{s.users_after_rollback} (goal 0)."
    )
    spread = "; ".join(
        f"step {i + 1} ({share:.0%}): {n} of {s.workers}"
        for i, (share, n) in enumerate(zip(CANARY_STEPS, s.spread, strict=True))
    )
    out.append(
        f"\nSessions on the candidate by their sticky bucket: {spread} (the run id, hence "
        "the session ids, is drawn until at least one session is on the candidate at the "
        "first step and two on each arm at the second)."
    )
    if s.arms:
        names = sorted({b for arms in s.arms.values() for b in arms})
        out.append(
            "\n`X-Brownout-Backend` of the load's requests, by when they were sent "
            "(`?`: no answer header):\n"
        )
        out.append("| stretch | " + " | ".join(names) + " |")
        out.append("|---|" + "---:|" * len(names))
        out.extend(
            f"| {name} | " + " | ".join(str(arms.get(b, 0)) for b in names) + " |"
            for name, arms in s.arms.items()
        )
    b = s.bundle
    if b is None:
        out.append("\n**Bundle:** none read.")
    elif b.path is None:
        out.append("\n**Bundle:** none written.")
    else:
        v = b.verdict
        sizes = ", ".join(f"`{n}` {sz:,} B" for n, sz in b.sizes.items())
        out.append(f"\n**Bundle** `{b.path}`: {sizes or 'no files'}.")
        if v:
            out.append(
                f"- `verdict.json`: gate `{v.get('gate')}`, step {v.get('step')} (share "
                f"{v.get('share')}), value {v.get('value')} / limit {v.get('limit')}, detail "
                f"{v.get('detail')!r}; {len((v.get('gates') or {}).get('gates') or [])} gates "
                "with their values per arm."
            )
        out.append(
            f"- `errors.jsonl`: {b.errors_lines} lines ({_counts(b.errors_by_arm)} by arm)"
            + (
                " — empty: a failed request's record is written when the request ends "
                "(`Canary.finished`), and none had ended when the gate fired"
                if b.errors_lines == 0
                else ""
            )
            + "."
        )
        out.append(
            "- `metrics.prom`: `brownout_rollout_rollbacks_total` "
            + (", ".join(f"{{gate={g}}} {x:g}" for g, x in b.metrics_rollbacks.items()) or "absent")
            + "."
        )
        out.append(f"- `timeline.jsonl`: events {_counts(b.timeline_events)}.")
        if b.problems:
            out.append("- problems: " + "; ".join(b.problems))
    if s.policy_added:
        out.append(
            "\nThe drill's policy: the stack's (at the end of this page) plus, by a reload:\n"
        )
        out.append("```yaml\n" + s.policy_added.strip() + "\n```")
    return "\n".join(out) + "\n"


def _drill_section(r: DrillResult) -> str:
    c, s = r.counts, r.sessions
    out = [f"## {r.number}. {r.title}\n"]
    for f in r.faults:
        out.append(f"- fault: {f.label}")
    out.append("")
    rows = [
        ("requests sent", c["sent"]),
        ("complete answers (model + maintenance)", c["complete"]),
        ("… from a model (primary / fallback)", c["model_answers"]),
        ("… rescued mid-stream (`: brownout-rescue`, then finished)", c["rescued"]),
        ("… maintenance answers (valid, `X-Brownout-Backend: maintenance`)", c["maintenance"]),
        ("explicit errors (HTTP error or in-band error event)", c["error"]),
        ("… of which a rescue was tried and failed", c["rescue_failed"]),
        ("**truncated answers presented as success** (must be 0)", c["truncated"]),
        ("**hung requests** (must be 0)", c["hung"]),
        ("time to detect (first tier change / first sign, per fault)", _detect(r)),
        ("time back to normal (fault removed → tier normal, no ramp)", _s(r.back_to_normal_s)),
        ("outage seen by the ladder (fault → normal)", _s(r.outage_s)),
        ("sessions / completed turns that used history / stored", ""),
        ("… sessions", s["sessions"]),
        ("… completed answers with `X-Brownout-Session: used`", s["expected_turns"]),
        ("… answers with `X-Brownout-Session: unavailable`", s["unavailable"]),
        ("… turns stored in Redis", s["stored_turns"]),
        ("**lost session turns** (must be 0)", s["lost"]),
        ("… turns stored for answers the client did not get whole", s["extra"]),
    ]
    out.append("| metric | value |\n|---|---:|")
    out.extend(f"| {k} | {v} |" for k, v in rows if v != "")
    out.append("")
    if r.hostile is not None:
        out.append(hostile_section(r.hostile))
    if r.canary is not None:
        out.append(canary_section(r.canary, c["sent"]))
    if r.phases:
        out.append(
            "| stretch | length | complete answers | of which maintenance | failed | answers/s |"
        )
        out.append("|---|---:|---:|---:|---:|---:|")
        out.extend(
            f"| {p.name} | {p.seconds:.1f} s | {p.complete} | {p.maintenance} | {p.failed} "
            f"| {p.rate:.1f} |"
            for p in r.phases
        )
        out.append("")
    if r.backends:
        out.append(
            "Complete answers by backend: "
            + ", ".join(f"{k or '?'} {v}" for k, v in sorted(r.backends.items()))
            + "."
        )
    if r.error_codes:
        out.append(
            "Explicit errors by code: "
            + ", ".join(f"`{k}` × {v}" for k, v in sorted(r.error_codes.items()))
            + "."
        )
    if r.lost:
        out.append("\nLost turns (completed, `used`, not in Redis):\n")
        for q in r.lost[:10]:
            out.append(
                f"- {q.session} question {q.n}: backend {q.backend}, tier {q.tier}, "
                f"t {q.started - r.t0:+.1f}…{q.ended - r.t0:+.1f} s"
                + (", rescued" if q.rescued else "")
            )
    if r.replay is not None:
        out.append("\n" + replay_section(r))
    facts = {k: v for k, v in r.facts.items() if v is not None}
    if facts:
        out.append("\nFacts: " + "; ".join(f"{k} = {v}" for k, v in facts.items()) + ".")
    if r.notes:
        out.append("\nNotes:\n")
        out.extend(f"- {n}" for n in r.notes)
    if r.problems:
        out.append("\n**Problems:**\n")
        out.extend(f"- {p}" for p in r.problems)
    out.append("\nTimeline (t = 0 at the first fault):\n")
    out.append("| t | event |\n|---:|---|")
    out.extend(f"| {t - r.t0:+.1f} s | {text} |" for t, text in r.timeline)
    return "\n".join(out) + "\n"


def render(
    results: Sequence[DrillResult],
    durations: Durations,
    *,
    setup: str,
    policy: str,
    run_seconds: float,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    d = durations
    parts = [
        "# Chaos drills\n",
        f"Generated by `bench/chaos.py` (`make chaos`) on {when}; the whole run took "
        f"{run_seconds / 60:.1f} min.\n",
        setup,
        f"Load: {d.workers} streaming chat clients through nginx, each with its own "
        f"`X-Session-Id`, asking one question after another ({d.max_tokens} tokens, "
        f"`ignore_eos`, {d.think_s:.1f} s think time); a request still open after "
        f"{d.deadline_s:.0f} s counts as hung. Every answer is classified from the raw SSE "
        "bytes the client got; every session's Redis history is audited at the end.\n",
        "## Summary\n",
        summary_table(results),
        "Detect: the first tier change after each fault (the proxy's own transition "
        "time), or for faults that leave the tier alone the first sign the proxy noticed "
        "(session store reported down, reload rejected; for the bad canary, the rollout's "
        "rollback). Back to normal: from the fault's removal (vLLM healthy again, "
        "SIGCONT, Redis up, burst over, good policy reloaded, the candidate healthy "
        "again) until `/brownout/status` shows tier `normal` with no ramp (polled "
        "every 0.2 s). Explicit errors include 429 sheds (Retry-After) during overload.\n",
    ]
    problems = [f"- drill {r.number} ({r.title}): {p}" for r in results for p in r.problems]
    parts.append("## Problems found\n\n" + ("\n".join(problems) if problems else "None.") + "\n")
    parts.extend(_drill_section(r) for r in results)
    parts.append("## Policy used\n\n```yaml\n" + policy.strip() + "\n```\n")
    return "\n".join(parts)
