"""Prometheus metrics (every one defined in `metrics`) and the non-blocking
log writer (`logs`)."""
