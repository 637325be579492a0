"""Write the tiny model's weights: a 2-layer Llama with random float32 weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["build_model"]


def build_model(work: Path, tokenizer: Any, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id = tokenizer.convert_tokens_to_ids("<s>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("</s>")
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # head_dim = 128 / 2 = 64; vLLM's CPU attention refuses head_dim < 32.
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    config.dtype = torch.float32
    # fork_rng: seed locally without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(work), safe_serialization=True)
