"""Prometheus metrics (every one defined in `metrics`), the non-blocking
log writer (`logs`) and OpenTelemetry traces (`tracing`: imported only when
the policy names a collector, the SDK being an optional extra)."""
