"""The Transformers OpenAI-compatible fallback server (`brownout fallback-server`).

Modules, one concern each:

- `protocol`   — the request dataclasses (what parsing produces)
- `reading`    — typed reads from request JSON with OpenAI-style errors
- `parsing`    — request validation into those dataclasses (400 naming the field)
- `fields`     — every request field: honoured / ignored / rejected; capabilities
- `tools`      — tools/tool_choice in, Hermes <tool_call> blocks out as tool_calls
- `structured` — xgrammar: response_format json_* and forced tool calls
- `support`    — chat template with tools, logit_bias, token table (per server)
- `shapes`     — response rendering (choices with index, logprobs, tool calls)
- `generate`   — the chat/completions flow; `choices` — n choices in one slot
- `httpio`     — JSON in, SSE out, shared HTTP errors
- `textstream` — incremental detokenization and stop-string matching (pure)
- `engine`     — model loading and the blocking `generate()` call
- `workers`    — worker threads bridged to asyncio; cancellation
- `admission`  — bounded concurrency plus a bounded wait queue
- `metrics`    — Prometheus metrics on a per-app registry
- `handlers`   — small endpoints and the error middleware
- `server`     — app factory and `main`
"""
