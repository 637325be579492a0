"""The generation engines (threads, batched) and what they share: model, admission, text."""
