"""OpenAI wire knowledge, once, without I/O (sans-IO).

Everything Brownout knows about the OpenAI HTTP API's shapes lives here, as
plain functions and constants over `bytes`, `str` and `dict` — no aiohttp, no
sockets, no clock — so the proxy, the fallback server and the tests share one
definition:

- `errors`   the error object `{"error": {"message", "type", "param", "code"}}`
             and the wrapping of a backend's non-OpenAI error body
- `auth`     `Authorization: Bearer <key>` parsing and constant-time key checks
- `messages` the last user message's text (session turns, FAQ matching)
- `headers`  the response headers of an SSE stream (nginx-unbuffered)

- `chunks`   chunk markers (finish, error, [DONE]) found on bytes
- `partial`  the partial answer of a stream, continuation bodies, choice 0
"""
