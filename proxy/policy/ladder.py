"""`ladder:` — throttle, failover, maintenance, recovery, breakers, shared state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.policy.knobs import knob
from proxy.policy.priority import Priority


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    max_inflight: int = knob(
        64, "Requests in flight at once; normally vLLM's --max-num-seqs.", ge=1, le=100_000
    )
    queue_size: int = knob(64, "Requests that may wait for a slot; beyond it, 429.", ge=0)
    queue_timeout_s: float = knob(
        10.0,
        "Longest wait for a slot; a request expected to wait longer is refused at once.",
        gt=0,
    )
    fair_share: bool = knob(
        True,
        "While requests wait for a slot, serve first the client holding the fewest "
        "(max-min fairness; FIFO with one client), shed the heaviest client's newest "
        "waiter when the queue is full, and do not count a client's waits beyond its "
        "share as engine pressure.",
    )
    default_priority: Priority = knob(
        "normal", "Priority of requests without `X-Priority` (critical, normal, sheddable)."
    )
    key_priorities: tuple[str, ...] = knob(
        (),
        "`API_KEY=priority` entries giving a client key a priority; `X-Priority` may only "
        "lower it, unless the entry names a ceiling: `API_KEY=normal..critical`.",
        secret="pairs",
    )


@dataclass(frozen=True, slots=True)
class ThrottlePolicy(AdmissionPolicy):
    enabled: bool = knob(True, "Tier 1: hold concurrency when the engine saturates.")
    mode: Literal["fixed", "adaptive"] = knob(
        "adaptive", "How the throttle tier sets the limit: `fixed` or `adaptive` (AIMD)."
    )
    max_inflight_per_client: int = knob(
        0,
        "Admission slots one client (API key, else the address nginx saw, else the peer) "
        "may hold at once; over it a request is shed (429 `client_limit`); 0 = no cap.",
        ge=0,
    )
    throttled_limit: int = knob(
        8, "The limit in the throttle tier when `mode: fixed` (≤ max_inflight then).", ge=1
    )
    min_limit: int = knob(
        1, "The adaptive limit never goes below this (≤ max_inflight in adaptive mode).", ge=1
    )
    decrease_factor: float = knob(
        0.75, "Adaptive: limit × this per window under pressure.", gt=0, lt=1
    )
    increase_step: int = knob(1, "Adaptive: limit + this per window without pressure.", ge=1)
    scrape_interval_s: float = knob(
        1.0, "How often vLLM's /metrics is read (0 = never).", ge=0, le=3600
    )
    waiting_high: float = knob(
        8.0,
        "Pressure when vLLM has this many requests waiting (summed over engines).",
        gt=0,
        unit="requests",
    )
    kv_cache_high: float = knob(
        0.95,
        "Pressure when vLLM's KV-cache usage reaches this (a 0–1 ratio, not a percentage).",
        gt=0,
        le=1,
        unit="ratio",
    )
    ttft_factor: float = knob(
        1.8,
        "Pressure when the short-window TTFT P95 exceeds this × the baseline P95.",
        gt=1,
        unit="×",
    )
    ttft_window_s: float = knob(60.0, "Short window of the TTFT rule.", gt=0)
    baseline_window_s: float = knob(
        3600.0, "Baseline window of the TTFT rule (rolling P95; > ttft_window_s).", gt=0
    )
    min_samples: int = knob(20, "TTFT samples needed in each window before the rule counts.", ge=1)
    queue_wait_high_s: float = knob(
        2.0,
        "Pressure when the P95 admission queue wait reaches this (counted only while "
        "the limit is `max_inflight`: waits the throttle causes itself do not feed it).",
        gt=0,
    )
    queue_wait_window_s: float = knob(10.0, "Window of the queue-wait rule.", gt=0)
    clear_ratio: float = knob(
        0.5,
        "Pressure clears when every signal is below this × its high mark.",
        gt=0,
        lt=1,
        unit="ratio",
    )


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    enabled: bool = knob(True, "Tier 2: send traffic to the fallback when the primary fails.")
    on_connect_error: bool = knob(
        True, "Try the other backend when one cannot be reached or fails before any byte."
    )
    max_attempts: int = knob(
        2, "Backends tried per request before its first byte (never 4xx errors).", ge=1, le=10
    )
    rescue_streams: bool = knob(
        True,
        "Continue a stream that dies mid-answer on the fallback (partial assistant "
        "message + continue_final_message; a prompt-level continuation where the "
        "fallback rejects that) instead of ending it with an error event.",
    )
    retry_max: int = knob(
        1,
        "Retries of a transient failure before the first byte (one 5xx, a connection "
        "reset, a 429) on the same backend, per request, before failing over "
        "(0 = fail over at once). Never after a timeout or a missing first token.",
        ge=0,
        le=5,
    )
    retry_budget_ratio: float = knob(
        0.2,
        "Retry budget of each backend: same-backend retries per window may be at most "
        "this share of its requests, plus `retry_budget_min`.",
        ge=0,
        le=1,
        unit="ratio",
    )
    retry_budget_min: int = knob(
        3, "Retries per window each backend may always have, whatever its traffic.", ge=0
    )
    retry_budget_window_s: float = knob(
        10.0, "Window over which the retry budget counts requests and retries.", gt=0
    )
    retry_backoff_s: float = knob(
        0.05,
        "Backoff before a same-backend retry: this × 2^(retry − 1), jittered to 50–100 %.",
        ge=0,
    )
    retry_backoff_max_s: float = knob(1.0, "Longest backoff before a retry.", ge=0)
    retry_after_max_s: float = knob(
        2.0,
        "A 429/503 `Retry-After` up to this long (and within the request's first-byte "
        "deadline) is waited out and retried on the same backend; longer: fail over.",
        ge=0,
    )
    unsupported_fields: Literal["reject", "drop"] = knob(
        "reject",
        "A request field the chosen backend does not honour (its advertised "
        "capabilities): `reject` answers an error naming the fields; `drop` removes them "
        "and names them in `X-Brownout-Dropped`.",
    )
    ttft_limit_s: float = knob(
        0.0, "A time to first token above this counts as a backend failure (0 = off).", ge=0
    )
    probe_failures: int = knob(
        2,
        "Consecutive failed health probes that mark a backend down (HTTP 503 from vLLM "
        "and refused connections count at once).",
        ge=1,
    )
    recovery_probe: bool = knob(
        True,
        "While a breaker is open, test the backend with /health plus its probe request "
        "(`backends.<name>.probe`) before letting real traffic back; off = a real "
        "request is the half-open trial.",
    )


@dataclass(frozen=True, slots=True)
class MaintenancePolicy:
    enabled: bool = knob(True, "Tier 3: answer with the FAQ / maintenance notice.")
    notice: str = knob(
        "The assistant is under maintenance right now. Please try again in a few minutes.",
        "Text of the maintenance answer.",
    )
    retry_after_s: int = knob(30, "`Retry-After` on maintenance answers.", ge=0, le=86400)
    status_code: Literal[200, 503] = knob(200, "200 suits chat UIs; 503 suits API clients.")


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    window_s: float = knob(1.0, "How often the ladder evaluates its signals.", ge=0.01, le=60)
    min_dwell_s: float = knob(10.0, "Least time in a tier before stepping down from it.", ge=0)
    healthy_windows: int = knob(
        3, "Consecutive evaluations asking for a better tier before stepping down.", ge=1
    )
    ramp: tuple[float, ...] = knob(
        (0.05, 0.2, 0.5, 1.0),
        "Traffic shares for a recovered backend, step by step: rising, each in (0, 1], "
        "ending at 1.",
        gt=0,
        le=1,
        unit="share",
    )
    ramp_step_s: float = knob(
        10.0, "Time on each ramp step (without errors) before the next.", gt=0
    )
    ramp_max_failures: int = knob(
        1, "Failures of the recovered backend during the ramp that roll back.", ge=1
    )


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    fail_max: int = knob(5, "Consecutive failures that open the breaker.", ge=1)
    failure_rate: float = knob(
        0.3,
        "Failure share over the window that opens the breaker (0 disables).",
        ge=0,
        le=1,
        unit="ratio",
    )
    min_calls: int = knob(10, "Outcomes needed in the window before the rate counts.", ge=1)
    window_s: float = knob(30.0, "Length of the failure-rate window.", gt=0)
    reset_timeout_s: float = knob(10.0, "Open → half-open after this long.", gt=0)
    half_open_max_calls: int = knob(1, "Trial requests admitted while half-open.", ge=1)
    corroborate: bool = knob(
        True,
        "Before 5xx answers, timeouts, cut streams or invalid output open a closed breaker "
        "(or reopen a half-open one), send the backend's recovery probe: a probe that "
        "succeeds charges those failures to their requests and keeps the breaker from "
        "opening (at most one probe per "
        "`reset_timeout_s`); false = open on the count alone.",
    )
    min_clients: int = knob(
        2,
        "Within `reset_timeout_s` of a probe that succeeded, failures open the breaker only "
        "when they come from at least this many client identities (API key, else peer "
        "address).",
        ge=1,
    )


@dataclass(frozen=True, slots=True)
class SharedPolicy:
    redis: str = knob(
        "",
        "Redis URL shared by the replicas (`redis://host:port/db`); empty = no sharing.",
        secret="userinfo",
    )
    key_prefix: str = knob("brownout:fleet:", "Prefix of the shared keys.")
    interval_s: float = knob(0.5, "How often each replica reads the shared state.", gt=0)
    timeout_s: float = knob(0.5, "Redis operations slower than this count as Redis down.", gt=0)


@dataclass(frozen=True, slots=True)
class LadderPolicy:
    throttle: ThrottlePolicy = knob(ThrottlePolicy, "")
    failover: FailoverPolicy = knob(FailoverPolicy, "")
    maintenance: MaintenancePolicy = knob(MaintenancePolicy, "")
    recovery: RecoveryPolicy = knob(RecoveryPolicy, "")
    breaker: BreakerPolicy = knob(BreakerPolicy, "")
    shared: SharedPolicy = knob(SharedPolicy, "")
