"""Typed per-request keys (aiohttp `RequestKey`) that the middlewares set."""

from __future__ import annotations

from aiohttp import web

# The request's id (the client's sane X-Request-Id, or a fresh one); bound into
# structlog's context for every log line of the request, and sent back.
REQUEST_ID: web.RequestKey[str] = web.RequestKey("brownout_request_id", str)
# Loop time when the request's handling began.
STARTED_AT: web.RequestKey[float] = web.RequestKey("brownout_started_at", float)
# Set when the client went away while its body was being read: the request
# never reached the pipeline, so the middleware writes its one line.
BODY_ABANDONED: web.RequestKey[bool] = web.RequestKey("brownout_body_abandoned", bool)
