"""Default capacity from the device: the KV budget and how many requests it holds.

The KV cache of one token costs layers × kv_heads × head_dim × 2 (K and V) ×
dtype bytes. A share of the device's free memory (after the model is
loaded) is the KV budget; capacity is the budget over the tokens one request
may need (`max_model_len`), bounded per engine and device. `--max-concurrency`
overrides the capacity; the KV budget then still caps the batched engine's
cache.

`plan` decides (pure); `free_memory` and `kv_bytes_per_token` read the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

EngineChoice = Literal["auto", "batched", "threads"]

# Share of free memory the KV cache may take: the rest is for activations,
# the library's static buffers and (on CPU) everyone else on the machine.
KV_SHARE = {"cuda": 0.5, "cpu": 0.1}
# Upper bounds of the default capacity: threads contend for the interpreter and
# for the device's cores past a few dozen; the batched engine's batch is bounded
# by what a step can carry at interactive latency (and on CPU by its slowness).
MAX_RUNNING = {("batched", "cuda"): 256, ("batched", "cpu"): 16, ("threads", "cuda"): 16}
MAX_RUNNING_DEFAULT = 16
# Tokens per forward pass of the batched engine (prefill chunks); the
# attention mask of a step is this × the cache's tokens, so keep it modest.
MAX_BATCH_TOKENS = {"cuda": 2048, "cpu": 256}


@dataclass(frozen=True)
class Plan:
    engine: Literal["batched", "threads"]
    device: str
    max_running: int
    kv_tokens: int  # the KV budget, in tokens
    kv_bytes_per_token: int
    max_batch_tokens: int
    source: str  # where max_running came from, for the start-up log

    def as_log(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "device": self.device,
            "max_running": self.max_running,
            "kv_tokens": self.kv_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "source": self.source,
        }


def pick_engine(choice: EngineChoice, device: str) -> Literal["batched", "threads"]:
    """`auto`: continuous batching on a GPU, a thread per slot on CPU (measured faster there)."""
    if choice != "auto":
        return choice
    return "batched" if device == "cuda" else "threads"


def plan(
    *,
    engine: Literal["batched", "threads"],
    device: str,
    free_bytes: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    override: int | None,
) -> Plan:
    """The capacity and KV budget for this engine on this device."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    budget_tokens = int(free_bytes * KV_SHARE[kind]) // max(kv_bytes_per_token, 1)
    bound = MAX_RUNNING.get((engine, kind), MAX_RUNNING_DEFAULT)
    if override is not None:
        max_running, source = override, "--max-concurrency"
    else:
        fits = budget_tokens // max(max_model_len, 1)
        max_running = max(1, min(bound, fits))
        source = f"{budget_tokens} KV tokens / {max_model_len} per request, at most {bound}"
    # No more cache than the running requests can fill; at least one full request.
    kv_tokens = max(min(budget_tokens, max_running * max_model_len), max_model_len)
    return Plan(
        engine=engine,
        device=kind,
        max_running=max_running,
        kv_tokens=kv_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        max_batch_tokens=MAX_BATCH_TOKENS[kind],
        source=source,
    )


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """KV cache bytes of one token for a Transformers model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers * kv_heads * head_dim * 2 * dtype.itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now (CUDA: the driver's count; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3  # no /proc (not Linux): assume a small machine
