"""`rollout:` — a gray release of `backends.candidate` against the primary.

Eligible traffic goes to the candidate by a sticky hash bucket, step by step
(`steps`, each held `step_s`); gates compare the two arms on a sliding
window and roll everything back to the primary at the first failing gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.knobs import knob


@dataclass(frozen=True, slots=True)
class GatesPolicy:
    ttft_ratio_max: float = knob(
        0.8,
        "Candidate TTFT p50 / primary TTFT p50 must be at most this (0.8 = 20 % faster); "
        "judged once both arms have `min_samples`: rolls back when the ratio's 95 % "
        "interval lies wholly above it, advances only when its estimate is at or below.",
        gt=0,
        unit="ratio",
    )
    p99_ratio_max: float = knob(
        1.0,
        "Candidate end-to-end p99 / primary p99 must be at most this (plus "
        "`p99_tolerance`); judged like `ttft_ratio_max`.",
        gt=0,
        unit="ratio",
    )
    p99_tolerance: float = knob(
        0.05,
        "Slack on `p99_ratio_max` (0.05: a candidate 5 % slower at p99 still passes; "
        "latency noise of two servers on one host).",
        ge=0,
        le=1,
        unit="ratio",
    )
    error_rate_max: float = knob(
        0.0,
        "Share of the candidate's requests that may fail by its own fault (5xx, "
        "timeouts, in-band errors, cut streams — failures attributed to the backend, "
        "never to the request or load); 0 = the first one rolls back.",
        ge=0,
        le=1,
        unit="ratio",
    )
    oom_max: int = knob(
        0,
        "Out-of-memory errors (error bodies, engine death, /health) the candidate may "
        "show; 0 = the first one rolls back.",
        ge=0,
    )
    min_samples: int = knob(
        30, "Requests per arm in the window before a ratio gate may judge.", ge=1
    )
    quality_drop_max: float = knob(
        0.02,
        "How much lower the candidate's eval-set score (share of checks passed) may be "
        "than the primary's.",
        ge=0,
        le=1,
        unit="ratio",
    )
    window_s: float = knob(300.0, "Sliding window the gates judge.", gt=0)
    advance_on: tuple[str, ...] = knob(
        ("ttft_ratio", "p99_ratio"),
        "Ratio gates that must pass before a step advances; one left out still rolls back "
        "when it is confidently failing (a p99 needs about 437 requests per arm in the "
        "window before it can pass: leave it out for low traffic).",
    )


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    steps: tuple[float, ...] = knob(
        (0.05, 0.2, 0.5, 1.0),
        "Share of eligible traffic on the candidate at each step: rising, each in "
        "(0, 1], the last 1.",
        gt=0,
        le=1,
        unit="ratio",
    )
    step_s: float = knob(900.0, "How long each step is held before the next.", gt=0)
    sticky: str = knob(
        "session",
        "What keeps a client in its arm: `session` (X-Session-Id), `api_key`, "
        "`header:NAME`, or `none` (per request). Hash buckets: a client on the candidate "
        "at 5 % stays on it at 20 %.",
    )
    priorities: tuple[str, ...] = knob(
        ("sheddable", "normal"),
        "Priorities that join the rollout from its first step; the others (critical) "
        "join only at the last step.",
    )
    gates: GatesPolicy = knob(GatesPolicy, "")
    eval: str | None = knob(
        None,
        "YAML file of test questions with checks, run against both arms before the "
        "first step and at each step (never shown to users); unset = no quality gate.",
    )
    eval_timeout_s: float = knob(60.0, "One eval question's time limit per arm.", gt=0)
    mirror: float = knob(
        0.0,
        "Share of live requests copied to the candidate in the `mirror` state (answers "
        "measured and discarded: a step 0 that no user sees); 0 = no mirror step.",
        ge=0,
        le=1,
        unit="ratio",
    )
    mirror_s: float = knob(900.0, "How long the mirror step is held.", gt=0)
    advance_window: str | None = knob(
        None,
        'Steps advance only inside this daily window, e.g. "22:00-06:00" (in '
        "`timezone`); rollback never waits for it. Unset = any time.",
    )
    timezone: str = knob("UTC", "IANA time zone of `advance_window`.")
    snapshot_dir: str = knob(
        "rollouts",
        "Directory of the rollback bundles (`<rollout-id>/`) and of the rollout's saved "
        "state (survives a restart).",
    )
    auto_start: bool = knob(
        False, "Start the rollout when the policy is loaded (else `brownout rollout start`)."
    )
