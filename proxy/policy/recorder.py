"""`recorder:` — the flight recorder: what the control code saw and did, on disk.

Every request's envelope (never its text unless `content`), the backends'
health probes and breaker transitions, vLLM's pressure samples, tier
transitions, admission limit changes and reloads, as compressed JSON lines in
rotating segments under `dir` (`proxy.telemetry.recorder`). `brownout replay`
runs a recording through the control code under another policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.knobs import knob


@dataclass(frozen=True, slots=True)
class RecorderPolicy:
    enabled: bool = knob(
        False,
        "Record what the control code saw and did (request envelopes, probes, breakers, "
        "pressure, tiers, limits, reloads) for `brownout replay`; writing never blocks "
        "serving (a bounded queue drained off the event loop; drops are counted).",
    )
    dir: str = knob(
        "recordings",
        "Directory of the recording's segments (`rec-<start>-<n>.jsonl.gz`), relative to "
        "the working directory unless absolute.",
    )
    max_mb: float = knob(
        512.0,
        "Disk the recording may use; the oldest segments are deleted beyond it.",
        gt=0,
        le=1_000_000,
        unit="MiB",
    )
    keep_hours: float = knob(
        48.0,
        "Segments older than this are deleted.",
        gt=0,
        le=24 * 366,
        unit="h",
    )
    content: bool = knob(
        False,
        "Also record prompts and answers (the request's messages or prompt, the answer's "
        "text); off: only sizes and token counts.",
    )
