"""The fallback server's HTTP API: app, handlers, request parsing, answers, errors."""
