"""The Transformers OpenAI-compatible fallback server (`brownout fallback-server`).

Three sub-packages, one layer each, and the request types they share:

- `protocol`   — the request dataclasses (what parsing produces, what engines read)
- `api/`       — the HTTP API: `server` (app factory, `main`), `handlers` (small
  endpoints, error middleware), `generate` (the chat/completions flow),
  `choices` (n choices in one slot), `httpio` (JSON in, SSE out), `reading`
  and `parsing` (request validation, 400 naming the field), `fields`
  (honoured / ignored / rejected fields), `shapes` (answers), `errors`,
  `state` (settings, app keys), `metrics`
- `engines/`   — generation: `interface` (what the API submits), `engine`
  (model loading, blocking `generate()`), `workers` (threads engine),
  `batched` (continuous batching) and `cbsampler` (its seeded sampling),
  `capacity` (sizing), `admission` (slots and queue), `tokentext` and
  `textstream` (detokenization, stop strings)
- `features/`  — what the API adds to generation: `structured` (xgrammar),
  `grammarlane` (the bounded compile lane), `schemalimits`, `tools`
  (tool_choice in, `<tool_call>` blocks out), `support` (chat template,
  logit_bias, penalties, token table)
"""
