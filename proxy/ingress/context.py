"""Typed per-request keys (aiohttp `RequestKey`) that the middlewares set."""

from __future__ import annotations

from aiohttp import web

# The request's id (the client's sane X-Request-Id, or a fresh one); bound into
# structlog's context for every log line of the request, and sent back.
REQUEST_ID: web.RequestKey[str] = web.RequestKey("brownout_request_id", str)
# Loop time when the request's handling began.
STARTED_AT: web.RequestKey[float] = web.RequestKey("brownout_started_at", float)
