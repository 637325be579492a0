"""Typed application keys (aiohttp `AppKey`), kept apart to avoid import cycles."""

from __future__ import annotations

from aiohttp import web

from proxy.runtime import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
