"""The backends: one pooled `ClientSession` per upstream, its URLs, health
probe, model discovery (`max_model_len`, capabilities) and breaker."""
