"""Sans-IO OpenAI wire knowledge: bytes and dicts in, bytes and values out (no sockets)."""
