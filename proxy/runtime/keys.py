"""Typed application keys (aiohttp `AppKey`), kept apart to avoid import cycles."""

from __future__ import annotations

from aiohttp import web

from proxy.runtime.state import ProxyState

# The running proxy; `STATE.current` is the Runtime of the live policy.
STATE: web.AppKey[ProxyState] = web.AppKey("state", ProxyState)
