"""A drill's flight recording replayed under the policy it was recorded with
(issue 22): the proxy of the chaos stack records (`recorder:` in the drill
policy); after a drill its window is cut out of the recording, saved next
to the logs (`recording-drill-N.jsonl`), and `brownout replay` runs it
through the control code on a virtual clock. The fidelity — the share of
the drill's time the replay spends in the recorded tier, and shed,
maintenance and error counts and TTFT percentiles against the recording —
is the drill's `replay` figure; below the goal it is a problem of the drill.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from proxy.replay.main import run_replay
from proxy.replay.trace import Trace, policy_from_knobs
from proxy.telemetry.recording import window, write_lines

FLUSH_WAIT_S = 1.5  # the recorder writes once a second


def replay_drill(recording_dir: Path, out_dir: Path, number: int, since: float, until: float
                 ) -> dict[str, Any]:  # fmt: skip
    """The fidelity of the drill's recording (blocking: run it in a thread)."""
    time.sleep(FLUSH_WAIT_S)
    path = out_dir / f"recording-drill-{number}.jsonl"
    n = write_lines(path, window(recording_dir, since, until))
    if not n:
        return {"error": f"no records in {recording_dir} for the drill's window", "file": str(path)}
    trace = Trace.load(path)
    knobs = trace.recorded_policy
    if knobs is None:
        return {"error": "the recording holds no policy record", "file": str(path)}
    t0 = time.process_time()
    out = run_replay(policy_from_knobs(knobs), trace_path=str(path))
    fid = out.report["fidelity"] or {}
    return {
        "file": str(path),
        "records": n,
        "requests": len(trace.requests),
        "tier_agreement": fid.get("tier_agreement"),
        "trustworthy": fid.get("trustworthy"),
        "reasons": fid.get("reasons", []),
        "counts": fid.get("counts", {}),
        "recorded": out.report["recorded"],
        "replayed": out.report["baseline"],
        "cpu_s": round(time.process_time() - t0, 3),
    }


def replay_problems(replay: dict[str, Any] | None) -> list[str]:
    if replay is None:
        return []
    if "error" in replay:
        return [f"replay: {replay['error']}"]
    if not replay.get("trustworthy"):
        return ["replay of the drill's recording below the fidelity goal: "
                + "; ".join(replay.get("reasons") or ["(no reason given)"])]  # fmt: skip
    return []
