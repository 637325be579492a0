"""Test harness: real processes (vLLM CPU server, tiny model) and their fixtures."""
