"""`brownout replay --html`: one self-contained page (inline CSS and SVG, no
script, nothing fetched) a person looks at: the verdict and the figures,
the tier timelines of the recording, the baseline and the candidate one
under the other, and load and latency over time on the same axis.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from proxy.control.ladder import TIERS
from proxy.replay.report import percentile, recorded_tiers
from proxy.replay.sim import Run

if TYPE_CHECKING:
    from proxy.replay.main import Outcome

COLORS = {
    "normal": "#2e7d32",
    "throttle": "#f9a825",
    "failover": "#ef6c00",
    "maintenance": "#c62828",
}
WIDTH = 960  # the plots' drawing width (px); the page scales them
LANE = 26
LABEL = 110
BIN_S_MIN = 5.0

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1040px;
       color: #1b1b1b; padding: 0 16px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.meta { color: #555; }
.verdict { padding: 10px 14px; border-radius: 6px; margin: 14px 0; }
.ok { background: #e8f5e9; border: 1px solid #a5d6a7; }
.bad { background: #ffebee; border: 1px solid #ef9a9a; }
.warn { background: #fff8e1; border: 1px solid #ffe082; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { padding: 4px 12px; border-bottom: 1px solid #e0e0e0; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td.worse { color: #c62828; font-weight: 600; } td.better { color: #2e7d32; font-weight: 600; }
svg { display: block; width: 100%; height: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
            vertical-align: -1px; border-radius: 2px; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _x(t: float, end: float) -> float:
    return LABEL + (WIDTH - LABEL - 10) * (t / end if end > 0 else 0.0)


def _axis(end: float, y: float) -> str:
    step = _nice(end / 8)
    parts = []
    t = 0.0
    while t <= end + 1e-9:
        x = _x(t, end)
        parts.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 4:.1f}" '
            'stroke="#777"/>'
            f'<text x="{x:.1f}" y="{y + 16:.1f}" text-anchor="middle">{t:g} s</text>'
        )
        t += step
    return "".join(parts)


def _nice(x: float) -> float:
    for m in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400):
        if x <= m:
            return float(m)
    return 86400.0 * max(1, round(x / 86400))


def timelines(rows: list[tuple[str, list[tuple[float, str]]]], end: float) -> str:
    """The tier timelines, one lane per run (`id="timeline-<name>"` each)."""
    h = LANE * len(rows) + 30
    out = [
        f'<svg class="timelines" viewBox="0 0 {WIDTH} {h}" role="img" aria-label="tier timelines">'
    ]
    for i, (name, tiers) in enumerate(rows):
        y = 4 + i * LANE
        out.append(f'<g id="timeline-{_e(name)}" class="timeline">')
        out.append(f'<text x="4" y="{y + 15}">{_e(name)}</text>')
        for j, (t, tier) in enumerate(tiers):
            t1 = tiers[j + 1][0] if j + 1 < len(tiers) else end
            t0, t1 = max(0.0, t), min(end, t1)
            if t1 <= t0:
                continue
            x0, x1 = _x(t0, end), _x(t1, end)
            out.append(
                f'<rect x="{x0:.2f}" y="{y}" width="{max(0.5, x1 - x0):.2f}" height="{LANE - 6}" '
                f'fill="{COLORS[tier]}" data-tier="{tier}"><title>{_e(name)}: {tier} '
                f"{t0:.1f}–{t1:.1f} s</title></rect>"
            )
        out.append("</g>")
    out.append(_axis(end, 4 + len(rows) * LANE))
    out.append("</svg>")
    return "".join(out)


def _lines(
    series: list[tuple[str, str, list[tuple[float, float]]]],
    end: float,
    title: str,
    unit: str,
    ident: str,
) -> str:
    """A line plot of several (label, color, points) on the shared time axis."""
    h = 190
    top, bottom = 28, h - 30
    ymax = max((v for _, _, pts in series for _, v in pts), default=1.0) or 1.0
    ymax *= 1.1
    out = [
        f'<svg id="{ident}" class="plot" viewBox="0 0 {WIDTH} {h}" role="img" '
        f'aria-label="{_e(title)}">',
        f'<text x="4" y="14">{_e(title)}</text>',
    ]
    for frac in (0.0, 0.5, 1.0):
        y = bottom - (bottom - top) * frac
        out.append(
            f'<line x1="{LABEL}" y1="{y:.1f}" x2="{WIDTH - 10}" y2="{y:.1f}" '
            'stroke="#e0e0e0"/>'
            f'<text x="{LABEL - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{ymax * frac:.3g}{unit}</text>"
        )
    for label, color, pts in series:
        if not pts:
            continue
        coords = " ".join(
            f"{_x(t, end):.1f},{bottom - (bottom - top) * v / ymax:.1f}" for t, v in pts
        )
        out.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.6" '
            f'points="{coords}"><title>{_e(label)}</title></polyline>'
        )
    out.append(_axis(end, bottom))
    out.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{c}"></i>{_e(lab)}</span>' for lab, c, _ in series
    )
    return "".join(out) + f'<div class="legend">{legend}</div>'


def _series(run: Run, key: str) -> list[tuple[float, float]]:
    s = run.series
    return list(zip(s.get("t", []), s.get(key, []), strict=False))


def _ttft_bins(run: Run, end: float, q: float) -> list[tuple[float, float]]:
    width = max(BIN_S_MIN, end / 80)
    bins: dict[int, list[float]] = {}
    for t, v in zip(run.ttft_t, run.ttfts, strict=True):
        bins.setdefault(int(t // width), []).append(v)
    out = []
    for b in sorted(bins):
        p = percentile(bins[b], q)
        if p is not None:
            out.append(((b + 0.5) * width, p))
    return out


def _table(report: dict[str, Any]) -> str:
    cols = [("baseline", report["baseline"]), ("candidate", report["candidate"])]
    if report.get("recorded") is not None:
        cols.insert(0, ("recorded", report["recorded"]))
    worse, better = set(report.get("worse_on", ())), set(report.get("better_on", ()))
    rows: list[tuple[str, str, Any]] = [
        *((f"seconds in {t}", "", lambda d, t=t: d["tier_seconds"][t]) for t in TIERS),
        ("tier transitions", "", lambda d: d["transitions"]),
        ("client errors", "client_errors", lambda d: d["client_errors"]),
        ("maintenance answers", "maintenance_answers", lambda d: d["maintenance_answers"]),
        (
            "shed (critical / normal / sheddable)",
            "shed",
            lambda d: " / ".join(
                str(d["shed"].get(p, 0)) for p in ("critical", "normal", "sheddable")
            ),
        ),
        ("failovers (answered by the fallback)", "", lambda d: d["failovers"]),
        ("rescues", "", lambda d: d["rescues"]),
        ("TTFT p50 (s)", "", lambda d: d["ttft_p50_s"]),
        ("TTFT p95 (s)", "ttft_p95", lambda d: d["ttft_p95_s"]),
    ]
    head = "".join(f"<th>{_e(n)}</th>" for n, _ in cols)
    body = []
    for label, key, get in rows:
        cells = []
        for name, d in cols:
            cls = ""
            if name == "candidate" and key in worse:
                cls = ' class="worse"'
            elif name == "candidate" and key in better:
                cls = ' class="better"'
            v = get(d)
            cells.append(f"<td{cls}>{_e('-' if v is None else v)}</td>")
        body.append(f"<tr><td>{_e(label)}</td>{''.join(cells)}</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(body)}</table>"


def render(out: Outcome) -> str:
    rep = out.report
    tr = rep["trace"]
    end = max(out.trace.end, 1.0)
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>brownout replay — {_e(tr['source'])}</title><style>{CSS}</style></head><body>",
        "<h1>brownout replay</h1>",
        f'<p class="meta">{_e(tr["source"])} · {tr["duration_s"]:.0f} s · '
        f"{tr['requests']} requests"
        + (f" · recorded under policy {_e(tr['policy_hash'])}" if tr.get("policy_hash") else "")
        + "</p>",
    ]
    fid = rep.get("fidelity")
    if fid is not None:
        cls = "ok" if fid["trustworthy"] else "bad"
        words = (
            "the replay reproduces the recording: trustworthy for this trace"
            if fid["trustworthy"]
            else "NOT trustworthy for this trace"
        )
        reasons = "".join(f"<li>{_e(r)}</li>" for r in fid["reasons"])
        parts.append(
            f'<div id="fidelity" class="verdict {cls}"><b>Fidelity: tier agreement '
            f"{fid['tier_agreement']:.1%}</b> — {words}"
            + (f"<ul>{reasons}</ul>" if reasons else "")
            + "</div>"
        )
    if rep.get("failed"):
        parts.append(
            f'<div class="verdict bad">The candidate is worse on '
            f"{_e(', '.join(rep['failed']))} (--fail-on).</div>"
        )
    elif rep.get("worse_on"):
        parts.append(
            f'<div class="verdict warn">The candidate is worse on '
            f"{_e(', '.join(rep['worse_on']))}.</div>"
        )
    parts.append(_table(rep))
    rows: list[tuple[str, list[tuple[float, str]]]] = []
    if not out.trace.synthetic:
        rows.append(("recorded", recorded_tiers(out.trace)))
    rows += [("baseline", out.baseline.tiers), ("candidate", out.candidate.tiers)]
    legend = "".join(f'<span><i style="background:{COLORS[t]}"></i>{t}</span>' for t in TIERS)
    parts += ["<h2>Tiers</h2>", timelines(rows, end), f'<div class="legend">{legend}</div>']
    b, c = out.baseline, out.candidate
    parts += [
        "<h2>Load</h2>",
        _lines(
            [
                ("baseline: in flight on the primary", "#1565c0", _series(b, "inflight_primary")),
                ("candidate: in flight on the primary", "#ef6c00", _series(c, "inflight_primary")),
                ("baseline: admission limit", "#90caf9", _series(b, "limit")),
                ("candidate: admission limit", "#ffcc80", _series(c, "limit")),
                ("baseline: vLLM waiting", "#5e35b1", _series(b, "waiting")),
                ("candidate: vLLM waiting", "#d81b60", _series(c, "waiting")),
            ],
            end,
            "requests",
            "",
            "plot-load",
        ),
        "<h2>Latency</h2>",
        _lines(
            [
                ("baseline TTFT p50", "#90caf9", _ttft_bins(b, end, 0.5)),
                ("baseline TTFT p95", "#1565c0", _ttft_bins(b, end, 0.95)),
                ("candidate TTFT p50", "#ffcc80", _ttft_bins(c, end, 0.5)),
                ("candidate TTFT p95", "#ef6c00", _ttft_bins(c, end, 0.95)),
            ],
            end,
            "time to first token (streams)",
            " s",
            "plot-latency",
        ),
    ]
    notes = rep.get("notes") or []
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    model = rep.get("model") or {}
    if model:
        parts.append(
            "<h2>Backend model</h2><table><tr><th>backend</th><th>capacity</th>"
            "<th>answers fitted</th><th>TTFT at 1 (s)</th><th>queue slope (s)</th>"
            "<th>condition changes</th></tr>"
        )
        for name, m in model.items():
            parts.append(
                f"<tr><td>{_e(name)}</td><td>{m['capacity']}</td>"
                f"<td>{m['answers_fitted']}</td><td>{m['ttft_s_at_1']}</td>"
                f"<td>{m['queue_slope_s']}</td><td>{m['segments']}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "".join(parts)
