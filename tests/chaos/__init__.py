"""Chaos drills: real vLLM, real fallback, real Redis, real nginx, steady load, real faults."""
