"""Throttle signals: vLLM gauges, the TTFT baseline rule, hysteresis, AIMD."""

from __future__ import annotations

from proxy.control.pressure import PressureMonitor, next_limit, parse_vllm_metrics
from proxy.policy import ThrottlePolicy

METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 4.0
vllm:num_requests_running{engine="0",model_name="tiny"} 8.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:admission_rejections_total{engine="0",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 5.0
"""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_parse_sums_engines_and_ignores_lookalikes() -> None:
    g = parse_vllm_metrics(METRICS)
    assert g.waiting == 7.0  # not the by-reason series
    assert g.running == 8.0
    assert g.kv_cache == 0.5
    assert g.rejections == 2.0


def test_parse_accepts_old_kv_cache_name() -> None:
    g = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.97\n')
    assert g.kv_cache == 0.97


def test_waiting_pressure_with_hysteresis() -> None:
    pol = ThrottlePolicy(waiting_high=8, clear_ratio=0.5)
    mon = PressureMonitor(pol, Clock())
    mon.update_engine(parse_vllm_metrics("vllm:num_requests_waiting 9\n"))
    assert mon.evaluate().pressure
    mon.update_engine(parse_vllm_metrics("vllm:num_requests_waiting 5\n"))
    assert mon.evaluate().pressure  # between the marks: still on
    mon.update_engine(parse_vllm_metrics("vllm:num_requests_waiting 3\n"))
    v = mon.evaluate()
    assert not v.pressure
    assert v.reason == "pressure cleared"


def test_queue_full_rejections_are_pressure() -> None:
    mon = PressureMonitor(ThrottlePolicy(), Clock())
    mon.update_engine(parse_vllm_metrics("vllm:admission_rejections_total 2\n"))
    assert not mon.evaluate().pressure
    mon.update_engine(parse_vllm_metrics("vllm:admission_rejections_total 5\n"))
    assert mon.evaluate().pressure


def test_ttft_against_rolling_baseline() -> None:
    clock = Clock()
    pol = ThrottlePolicy(ttft_window_s=60, baseline_window_s=3600, ttft_factor=1.8, min_samples=20)
    mon = PressureMonitor(pol, clock)
    for _ in range(600):  # an hour of 0.1 s TTFTs
        clock.t += 5
        mon.record_ttft(0.1)
    assert not mon.evaluate().pressure
    for _ in range(30):  # the last minute at 0.15 s: under 1.8 × baseline
        clock.t += 2
        mon.record_ttft(0.15)
    assert not mon.evaluate().pressure
    for _ in range(30):  # then at 0.3 s: over it
        clock.t += 2
        mon.record_ttft(0.3)
    v = mon.evaluate()
    assert v.pressure
    assert "ttft" in v.reason


def test_fixed_mode() -> None:
    pol = ThrottlePolicy(max_inflight=32, mode="fixed", throttled_limit=8)
    assert next_limit(pol, 32, throttled=True, pressure=True) == 8
    assert next_limit(pol, 8, throttled=False, pressure=False) == 9  # climbs back


def test_adaptive_limit_converges_after_a_step_change() -> None:
    """An engine that serves `capacity` sequences well: more is pressure.
    After a step change in capacity the AIMD limit settles around it."""
    pol = ThrottlePolicy(max_inflight=64, mode="adaptive", decrease_factor=0.75, increase_step=1)
    limit = 64
    for capacity in (40, 10, 25):
        trace = []
        for _ in range(120):
            pressure = limit > capacity
            limit = next_limit(pol, limit, throttled=True, pressure=pressure)
            trace.append(limit)
        tail = trace[-40:]
        assert max(tail) <= capacity + 1
        assert min(tail) >= int(capacity * 0.75) - 1


def test_queue_wait_counts_only_at_the_configured_limit() -> None:
    """The throttle's own queue must not hold it in place: with the limit cut,
    waits are not pressure, and old waits leave the short window."""
    clock = Clock()
    pol = ThrottlePolicy(max_inflight=16, queue_wait_high_s=2.0, queue_wait_window_s=10.0)
    mon = PressureMonitor(pol, clock)
    mon.record_queue_wait(3.0, limit=16)
    assert mon.evaluate().pressure
    assert "queue_wait" in mon.reason
    for _ in range(20):
        clock.t += 1.0
        mon.record_queue_wait(5.0, limit=4)  # the throttle cut the limit to 4
    assert "queue_wait" not in mon.ratios()
    v = mon.evaluate()
    assert not v.pressure
    assert v.reason == "pressure cleared"
