"""Every Prometheus metric of the proxy, in one place, on a per-app registry.

Label children that are known at start-up (one per backend) are bound once,
so the request path never pays for `.labels()` lookups it can avoid. What is
counted or observed on every request (`brownout_requests_total` and the
request, TTFT and overhead histograms) uses `LiteCounter`/`LiteHistogram`:
prometheus-client's exposition, byte for byte, without its per-update lock
and checks (four histogram observations and a counter increment cost ~50,000
instructions per request; see bench/results/profile.md).
"""

from __future__ import annotations

import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
)
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from proxy import __version__
from proxy.telemetry.logs import lines_dropped

# TTFT and durations of LLM calls span milliseconds (a cached prefix) to
# minutes (a long generation), so the buckets do too.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Time spent inside the proxy itself: sub-millisecond is the goal.
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

# Time between tokens and per output token: vLLM's own buckets from 10 ms up,
# and below them what a proxy sees when several events arrive in one read.
_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
# Distinct `model` label values per backend on the token counters; more are
# counted as "other" (the label comes from requests, bounded by what the
# backends answer, and bounded again here).
MAX_MODEL_LABELS = 32

TIER_VALUES = {"normal": 0, "throttle": 1, "failover": 2, "maintenance": 3}


class Buckets:
    """One histogram child without prometheus-client's per-observation lock
    and bookkeeping: a list of bucket counts and a sum, updated on the event
    loop (one bisect and two additions), read by `HistogramFamily` at scrape
    time. For what is observed per stream region (inter-token latency)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add(self, total: float, n: int) -> None:
        """`n` observations of `total / n` each (n ≥ 1)."""
        self.counts[bisect_left(self.bounds, total / n)] += n
        self.sum += total


class HistogramFamily(Collector):
    """A histogram of `Buckets` children by one label, exposed like
    prometheus-client's own (`_bucket{le}`, `_sum`, `_count`)."""

    def __init__(self, name: str, doc: str, label: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.label, self.bounds = name, doc, label, bounds
        self.children: dict[str, Buckets] = {}

    def child(self, value: str) -> Buckets:
        c = self.children.get(value)
        if c is None:
            c = self.children[value] = Buckets(self.bounds)
        return c

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.doc, labels=[self.label])

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        les = [*(_le(b) for b in self.bounds), "+Inf"]
        for value, c in sorted(self.children.items()):
            counts, total = list(c.counts), c.sum
            cumulative, acc = [], 0
            for le, n in zip(les, counts, strict=True):
                acc += n
                cumulative.append((le, float(acc)))
            fam.add_metric([value], cumulative, total)
        yield fam


class CounterFamily(Collector):
    """Counters by a fixed label set without prometheus-client's per-increment
    lock and checks: a one-element list per child, added to on the event
    loop, read at scrape time (`<name>_total`). For what is counted per
    request with several labels (tokens)."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.children: dict[tuple[str, ...], list[float]] = {}

    def child(self, values: tuple[str, ...]) -> list[float]:
        c = self.children.get(values)
        if c is None:
            c = self.children[values] = [0.0]
        return c

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, labels=list(self.labels))

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        for values, c in sorted(self.children.items()):
            fam.add_metric(list(values), c[0])
        yield fam


class CounterChild:
    """One `LiteCounter` child: a float added to on the event loop."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


# How prometheus-client writes a bucket bound (`le`); untyped there.
_go_float: Callable[[float], str] = floatToGoString


def _use_created() -> bool:
    """prometheus-client's switch for the `_created` series (its env
    variable PROMETHEUS_DISABLE_CREATED_SERIES, `disable_created_metrics()`)."""
    return bool(_prometheus_metrics._use_created)


class LiteCounter(Collector):
    """A labelled prometheus-client `Counter` as `/metrics` shows it (`_total`,
    `_created`, children in the order they were first used), updated without
    its lock: for counters incremented on the event loop only."""

    def __init__(
        self, name: str, doc: str, labelnames: tuple[str, ...], registry: CollectorRegistry
    ) -> None:
        self._name, self._doc, self._labelnames = name, doc, labelnames
        self._children: dict[tuple[str, ...], tuple[CounterChild, float]] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        key = tuple(map(str, values))
        got = self._children.get(key)
        if got is None:
            if len(key) != len(self._labelnames):
                raise ValueError("Incorrect label count")
            got = self._children[key] = (CounterChild(), time.time())
        return got[0]

    def describe(self) -> Iterator[Metric]:
        yield Metric(self._name, self._doc, "counter")

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self._name, self._doc, "counter")
        created = _use_created()
        for key, (child, at) in list(self._children.items()):
            labels = dict(zip(self._labelnames, key, strict=True))
            metric.add_sample(self._name + "_total", labels, child.value)
            if created:
                metric.add_sample(self._name + "_created", labels, at)
        yield metric


class LiteHistogram(Collector):
    """A prometheus-client `Histogram` (labelled or not) as `/metrics` shows
    it (`_bucket{le}`, `_count`, `_sum`, `_created`, children in the order
    they were first used), its children `Buckets`: one bisect and two
    additions per observation, no lock, for the event loop only."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: tuple[str, ...] = (),
        *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name, self._doc, self._labelnames = name, doc, labelnames
        self._bounds = tuple(float(b) for b in buckets)
        self._les = (*(_go_float(b) for b in self._bounds), "+Inf")
        self._children: dict[tuple[str, ...], tuple[Buckets, float]] = {}
        self._root = self.labels() if not labelnames else None
        registry.register(self)

    def labels(self, *values: str) -> Buckets:
        key = tuple(map(str, values))
        got = self._children.get(key)
        if got is None:
            if len(key) != len(self._labelnames):
                raise ValueError("Incorrect label count")
            got = self._children[key] = (Buckets(self._bounds), time.time())
        return got[0]

    def observe(self, amount: float) -> None:
        """An observation of a histogram without labels."""
        if self._root is None:
            raise ValueError("histogram metric is missing label values")
        self._root.observe(amount)

    def describe(self) -> Iterator[Metric]:
        yield Metric(self._name, self._doc, "histogram")

    def collect(self) -> Iterator[Metric]:
        name = self._name
        metric = Metric(name, self._doc, "histogram")
        created = _use_created()
        for key, (child, at) in list(self._children.items()):
            labels = dict(zip(self._labelnames, key, strict=True))
            acc = 0.0
            for le, n in zip(self._les, list(child.counts), strict=True):
                acc += n
                metric.add_sample(name + "_bucket", {**labels, "le": le}, acc)
            metric.add_sample(name + "_count", labels, acc)
            if not self._bounds or self._bounds[0] >= 0:
                metric.add_sample(name + "_sum", labels, child.sum)
            if created:
                metric.add_sample(name + "_created", labels, at)
        yield metric


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass(frozen=True, slots=True)
class BackendMetrics:
    """Children bound to one backend label."""

    ttft: Buckets
    duration: Buckets
    upstream_errors: Counter
    inter_token: Buckets
    per_output_token: Buckets


@dataclass
class Metrics:
    registry: CollectorRegistry = field(
        default_factory=lambda: CollectorRegistry(auto_describe=True)
    )

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = LiteCounter(
            "brownout_requests",
            "Proxied requests by backend, endpoint and HTTP status.",
            ("backend", "endpoint", "status"),
            registry=r,
        )
        self.ttft = LiteHistogram(
            "brownout_ttft_seconds",
            "Time from request arrival to the first answer byte sent to the client.",
            ("backend",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_ttft = LiteHistogram(
            "brownout_upstream_ttft_seconds",
            "Time from the upstream call to its first event: what the engine itself took "
            "(admission queue wait excluded).",
            ("backend",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = LiteHistogram(
            "brownout_request_duration_seconds",
            "Whole request duration as the client saw it.",
            ("backend",),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = LiteHistogram(
            "brownout_proxy_overhead_seconds",
            "Time spent inside the proxy per request: before the upstream call plus "
            "from the upstream's first byte to the client's first byte.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "brownout_inflight_requests",
            "Requests being served right now.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "brownout_upstream_errors",
            "Failures each backend showed, by kind, before attribution (who they were charged to: "
            "brownout_failures_total).",
            ["backend", "kind"],
            registry=r,
        )
        self.stream_errors = Counter(
            "brownout_stream_errors",
            "Streams ended with an in-band error event after the 200 was sent.",
            ["backend", "reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "brownout_client_disconnects",
            "Clients that went away before the answer ended.",
            ["backend"],
            registry=r,
        )
        self.bad_requests = Counter(
            "brownout_bad_requests",
            "Requests rejected by validation, by reason.",
            ["reason"],
            registry=r,
        )
        self.header_timeouts = Counter(
            "brownout_header_timeouts",
            "Connections closed because a request's headers did not arrive within "
            "server.header_timeout_s.",
            registry=r,
        )
        self.backend_up = Gauge(
            "brownout_backend_up",
            "1 when the backend's health probe passes.",
            ["backend"],
            registry=r,
        )
        self.tier = Gauge(
            "brownout_tier",
            "Current degradation tier (0 normal, 1 throttle, 2 failover, 3 maintenance).",
            registry=r,
        )

        self.transitions = Counter(
            "brownout_tier_transitions",
            "Ladder transitions by edge and reason.",
            ["from", "to", "reason"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "brownout_breaker_state",
            "Circuit breaker state (0 closed, 1 half-open, 2 open).",
            ["backend"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "brownout_breaker_transitions",
            "Circuit breaker state changes.",
            ["backend", "from", "to"],
            registry=r,
        )
        self.model_breaker_state = Gauge(
            "brownout_model_breaker_state",
            "Per-model circuit breaker of a multi-model backend (kind openai): "
            "0 closed, 1 half-open, 2 open.",
            ["backend", "model"],
            registry=r,
        )
        self.model_breaker_transitions = Counter(
            "brownout_model_breaker_transitions",
            "Per-model circuit breaker state changes.",
            ["backend", "model", "from", "to"],
            registry=r,
        )
        self.recovery_probes = Counter(
            "brownout_recovery_probes",
            "Recovery probes of open breakers by outcome (ok, failed, misconfigured: "
            "the backend answered 400/404/405/422 to the probe request).",
            ["backend", "outcome"],
            registry=r,
        )
        self.rollout_state = Gauge(
            "brownout_rollout_state",
            "The gray release's state: 0 idle, 1 mirror, 2 step, 3 paused, 4 complete, "
            "5 rolled_back, 6 aborted.",
            registry=r,
        )
        self.rollout_share = Gauge(
            "brownout_rollout_share",
            "Share of eligible traffic on backends.candidate now.",
            registry=r,
        )
        self.rollout_gate_value = Gauge(
            "brownout_rollout_gate_value",
            "The rollout gates' last figures: arm `ratio` is the gate's value, "
            "`primary`/`candidate` each arm's figure.",
            ["gate", "arm"],
            registry=r,
        )
        self.rollout_rollbacks = Counter(
            "brownout_rollout_rollbacks",
            "Rollouts rolled back, by the gate that failed.",
            ["gate"],
            registry=r,
        )
        self.failures = Counter(
            "brownout_failures",
            "Failed attempts by backend, attribution (backend: the engine is broken, and only "
            "these feed breakers and the ladder; request: the request's own problem; load: a "
            "busy backend) and fault.",
            ["backend", "attribution", "fault"],
            registry=r,
        )
        self.corroborations = Counter(
            "brownout_corroborations",
            "Recovery probes sent before a breaker would open on suspect failures, by result "
            "(absolved: the probe succeeded, the failures were the requests'; confirmed: it "
            "failed and the breaker opened; unknown: the probe is misconfigured).",
            ["backend", "result"],
            registry=r,
        )
        self.retries = Counter(
            "brownout_retries",
            "Attempts after a failure before the first byte: the same backend again "
            "(from = to, within its retry budget) or the next one, by reason.",
            ["from", "to", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "brownout_retry_budget_exhausted",
            "Transient failures not retried on the same backend because its retry "
            "budget was spent (they failed over instead).",
            ["backend"],
            registry=r,
        )
        self.rescues = Counter(
            "brownout_stream_rescues",
            "Streams that died mid-answer, by outcome: rescued on the fallback, failed, "
            "misaligned (the continuation restarted with other words); beside them "
            "prefill_rejected, restart_stripped, overlap_stripped (what the seam needed).",
            ["outcome"],
            registry=r,
        )
        self.maintenance_answers = Counter(
            "brownout_maintenance_answers",
            "Answers given in maintenance, by kind (faq, notice).",
            ["kind"],
            registry=r,
        )

        self.admission_limit = Gauge(
            "brownout_admission_limit",
            "Current concurrency limit in front of the primary.",
            registry=r,
        )
        self.admission_inflight = Gauge(
            "brownout_admission_inflight",
            "Requests holding an admission slot.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "brownout_queue_depth",
            "Requests waiting for an admission slot.",
            registry=r,
        )
        self.queue_wait = Histogram(
            "brownout_queue_wait_seconds",
            "Time admitted requests waited for a slot.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.shed = Counter(
            "brownout_shed",
            "Requests refused with 429, by priority and reason.",
            ["priority", "reason"],
            registry=r,
        )
        self.pressure = Gauge(
            "brownout_pressure",
            "1 while the throttle signals report pressure.",
            registry=r,
        )
        self.upstream_waiting = Gauge(
            "brownout_upstream_num_requests_waiting",
            "vLLM requests waiting (scraped, summed over engines).",
            registry=r,
        )
        self.upstream_running = Gauge(
            "brownout_upstream_num_requests_running",
            "vLLM requests running (scraped, summed over engines).",
            registry=r,
        )
        self.upstream_kv_cache = Gauge(
            "brownout_upstream_kv_cache_usage_perc",
            "vLLM KV-cache usage, 0–1 (scraped).",
            registry=r,
        )

        self.session_ops = LiteCounter(  # two per session request, on the loop
            "brownout_session_ops",
            "Session store operations by result (ok, unavailable, queued, late, rejected, "
            "limit: a new session past sessions.max_sessions_per_client).",
            ("op", "result"),
            r,
        )
        self.session_saves_waiting = Gauge(
            "brownout_session_saves_waiting",
            "Finished turns waiting for the session store to come back.",
            registry=r,
        )
        self.session_turns_dropped = Counter(
            "brownout_session_turns_dropped",
            "Waiting turns dropped because the queue was full during a long outage.",
            registry=r,
        )
        self.session_store_up = Gauge(
            "brownout_session_store_up",
            "1 while the session store answers and takes writes.",
            registry=r,
        )
        self.session_store_errors = Counter(
            "brownout_session_store_errors",
            "Failed or refused session store operations by op (load, append, refresh: a "
            "load's best-effort TTL refresh, delete, ping) and reason (timeout, connection, "
            "oom, readonly, busy, misconf, loading, noreplicas, masterdown, script, limit, error).",
            ["op", "reason"],
            registry=r,
        )
        self.trimmed = Counter(
            "brownout_trimmed_requests",
            "Requests whose messages were trimmed to the window.",
            ["backend"],
            registry=r,
        )
        self.trimmed_turns = Counter(
            "brownout_trimmed_turns",
            "Turns dropped from prompts to fit the window.",
            ["backend"],
            registry=r,
        )
        self.token_estimates = Counter(
            "brownout_token_count_estimates",
            "Trims that had to estimate token counts (no tokenizer, /tokenize failed).",
            ["backend"],
            registry=r,
        )

        self.shared_configured = Gauge(
            "brownout_shared_state_configured",
            "1 when the policy shares ladder state across replicas (ladder.shared.redis).",
            registry=r,
        )
        self.shared_up = Gauge(
            "brownout_shared_state_up",
            "1 while the replicas' shared state (Redis) answers; 0 = local state only.",
            registry=r,
        )

        self.guard_trips = Counter(
            "brownout_guard_trips",
            "Answers stopped by the output guard, by rule and backend.",
            ["rule", "backend"],
            registry=r,
        )

        self.guard_notes = Counter(
            "brownout_guard_notes",
            "Guard findings that did not stop the answer (rules in log mode, dropped events).",
            ["rule", "backend"],
            registry=r,
        )

        self.reloads = Counter(
            "brownout_policy_reloads",
            "Policy reloads applied.",
            registry=r,
        )
        self.reload_failures = Counter(
            "brownout_policy_reload_failures",
            "Policy reloads rejected (the running policy stayed).",
            registry=r,
        )
        self.trace_spans = Counter(
            "brownout_trace_spans",
            "Trace spans by what became of them: exported, failed (the collector refused "
            "them or could not be reached), dropped (the export queue was full, or the "
            "collector was backed off after a failure: not recorded).",
            ["result"],
            registry=r,
        )
        # -- tokens (from the answers' `usage`) and decode speed -----------------
        self.prompt_tokens = CounterFamily(
            "brownout_prompt_tokens",
            "Prompt tokens of answered requests, as the backend's `usage` counted them, by "
            "backend, model and tier (a rescued stream's continuation counts the partial "
            "answer it was given as prompt, on the fallback).",
            ("backend", "model", "tier"),
        )
        r.register(self.prompt_tokens)
        self.completion_tokens = CounterFamily(
            "brownout_completion_tokens",
            "Completion tokens of answered requests, as the backend's `usage` counted them, by "
            "backend, model and tier.",
            ("backend", "model", "tier"),
        )
        r.register(self.completion_tokens)
        self.inter_token = HistogramFamily(
            "brownout_inter_token_seconds",
            "Time between a stream's content events as they reached the proxy, by backend "
            "(events that arrived in one read share the gap).",
            "backend",
            _TOKEN_BUCKETS,
        )
        r.register(self.inter_token)
        self.per_output_token = HistogramFamily(
            "brownout_time_per_output_token_seconds",
            "Per stream: time from its first to its last event over its completion tokens "
            "after the first (usage), by backend.",
            "backend",
            _TOKEN_BUCKETS,
        )
        r.register(self.per_output_token)
        self.build_info = Info(
            "brownout_build",
            "Brownout's version, the Python running it and the hash of the policy in force.",
            registry=r,
        )
        self.build_info.info(build_labels(""))
        self.engine_queue = _EngineQueue()
        r.register(self.engine_queue)

        self.loop_errors = Counter(
            "brownout_loop_errors",
            "Unexpected exceptions in background work (the loop went on after a backoff).",
            ["loop"],
            registry=r,
        )
        r.register(_LogDrops())
        self._recorder_source: Callable[[], Any] = lambda: None
        r.register(_RecorderStats(lambda: self._recorder_source()))
        # CPU, memory, open files, start time of this process (`process_*`).
        ProcessCollector(registry=r)
        self._token_children: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
        self._models: dict[str, set[str]] = {}

    def watch_recorder(self, source: Callable[[], Any]) -> None:
        """Where the flight recorder's counters are read at scrape time."""
        self._recorder_source = source

    def for_backend(self, name: str) -> BackendMetrics:
        return BackendMetrics(
            ttft=self.ttft.labels(name),
            duration=self.duration.labels(name),
            upstream_errors=self.upstream_errors.labels(name, "connect"),
            inter_token=self.inter_token.child(name),
            per_output_token=self.per_output_token.child(name),
        )

    def count_tokens(
        self, backend: str, model: str, tier: str, prompt: int, completion: int
    ) -> None:
        key = (backend, model, tier)
        pair = self._token_children.get(key)
        if pair is None:
            seen = self._models.setdefault(backend, set())
            if model not in seen:
                if len(seen) >= MAX_MODEL_LABELS or len(model) > 128:
                    model = "other"
                else:
                    seen.add(model)
            pair = (
                self.prompt_tokens.child((backend, model, tier)),
                self.completion_tokens.child((backend, model, tier)),
            )
            self._token_children[key] = pair
        pair[0][0] += prompt
        pair[1][0] += completion

    def set_policy_hash(self, digest: str) -> None:
        self.build_info.info(build_labels(digest))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def build_labels(policy_hash: str) -> dict[str, str]:
    return {
        "version": __version__,
        "python": platform.python_version(),
        "policy_hash": policy_hash,
    }


class _EngineQueue(Collector):
    """vLLM's own queue time (`vllm:request_queue_time_seconds`, its sum and
    count over engines) as the last scrape of the primary read it: its mean
    over a window is rate(_sum) / rate(_count). Read at scrape time from
    `source` (bound to the live generation's pressure monitor)."""

    def __init__(self) -> None:
        self.source: Callable[[], tuple[float, float] | None] = lambda: None

    def describe(self) -> Iterator[Metric]:
        yield SummaryMetricFamily("brownout_upstream_request_queue_time_seconds", "", labels=[])

    def collect(self) -> Iterator[Metric]:
        fam = SummaryMetricFamily(
            "brownout_upstream_request_queue_time_seconds",
            "vLLM's request queue time (scraped from the primary, summed over engines): "
            "the engine's own wait before a request starts, not Brownout's admission queue.",
            labels=[],
        )
        got = self.source()
        if got is not None:
            count, total = got
            fam.add_metric([], count_value=int(count), sum_value=total)
        yield fam


class _LogDrops(Collector):
    """The process's log writer counts what it dropped; read at scrape time."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "brownout_log_lines_dropped",
            "Log lines dropped because stderr's reader did not keep up.",
            value=lines_dropped(),
        )


class _RecorderStats(Collector):
    """The flight recorder's counters (kept by its writer), read at scrape time."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        rec = self._source()
        dropped = CounterMetricFamily(
            "brownout_recorder_dropped",
            "Flight-recorder records not written: queue_full (the writer fell behind, e.g. "
            "a stalled disk), write_error (a full disk, an I/O error). Serving is never held.",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], rec.dropped if rec is not None else 0)
        dropped.add_metric(["write_error"], rec.lost if rec is not None else 0)
        yield dropped
        yield GaugeMetricFamily(
            "brownout_recorder_bytes",
            "Bytes of the flight recording on disk (all segments).",
            value=rec.bytes_on_disk if rec is not None else 0,
        )
