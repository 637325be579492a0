"""The Transformers OpenAI-compatible fallback server (`brownout fallback-server`).

Modules, one concern each:

- `protocol`   — request validation into frozen dataclasses, response shaping
- `textstream` — incremental detokenization and stop-string matching (pure)
- `engine`     — model loading and the blocking `generate()` call
- `workers`    — worker threads bridged to asyncio; cancellation
- `admission`  — bounded concurrency plus a bounded wait queue
- `metrics`    — Prometheus metrics on a per-app registry
- `handlers`   — aiohttp handlers and the error middleware
- `server`     — app factory and `main`
"""
