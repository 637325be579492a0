"""Chat sessions: the memory and Redis stores, the pending-save queue,
token-aware trimming and the session context of a request."""
