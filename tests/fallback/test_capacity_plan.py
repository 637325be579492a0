"""Capacity planning from the device (pure) and the seeded sampler's keys."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from proxy.fallback.engines import capacity, cbsampler

GIB = 1024**3


def _bench_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=5632,
    )


def test_kv_bytes_per_token_is_layers_kv_heads_head_dim_k_and_v_dtype() -> None:
    assert capacity.kv_bytes_per_token(_bench_config(), torch.bfloat16) == 16 * 4 * 128 * 2 * 2


def test_auto_picks_batched_on_cuda_and_threads_on_cpu() -> None:
    assert capacity.pick_engine("auto", "cuda") == "batched"
    assert capacity.pick_engine("auto", "cpu") == "threads"
    assert capacity.pick_engine("threads", "cuda") == "threads"
    assert capacity.pick_engine("batched", "cpu") == "batched"


def test_a_big_gpu_gets_the_bounded_maximum() -> None:
    plan = capacity.plan(
        engine="batched",
        device="cuda",
        free_bytes=130 * GIB,
        kv_bytes_per_token=32 * 1024,
        max_model_len=2048,
        override=None,
    )
    assert plan.max_running == capacity.MAX_RUNNING[("batched", "cuda")]
    assert plan.kv_tokens == plan.max_running * 2048  # no more cache than they can fill


def test_a_small_budget_bounds_the_capacity_by_memory() -> None:
    # 1 GiB free, half of it for KV, 32 KiB a token: 16,384 tokens = 8 requests of 2,048.
    plan = capacity.plan(
        engine="batched",
        device="cuda",
        free_bytes=GIB,
        kv_bytes_per_token=32 * 1024,
        max_model_len=2048,
        override=None,
    )
    assert plan.max_running == 8
    assert plan.kv_tokens == 16384


def test_no_room_for_one_request_still_serves_one() -> None:
    plan = capacity.plan(
        engine="threads",
        device="cpu",
        free_bytes=1024,
        kv_bytes_per_token=4096,
        max_model_len=2048,
        override=None,
    )
    assert plan.max_running == 1
    assert plan.kv_tokens == 2048


def test_max_concurrency_overrides_the_plan() -> None:
    plan = capacity.plan(
        engine="threads",
        device="cpu",
        free_bytes=64 * GIB,
        kv_bytes_per_token=1024,
        max_model_len=2048,
        override=3,
    )
    assert (plan.max_running, plan.source) == (3, "--max-concurrency")


@pytest.mark.parametrize("seed", [0, 5, 2**63 + 7, 2**64 - 1])
def test_seeded_sampler_keys_are_31_bit_and_differ_per_token(seed: int) -> None:
    keys = [cbsampler.row_key(seed, i) for i in range(64)]
    assert all(0 <= k < 2**31 for k in keys)
    assert len(set(keys)) == 64
    assert keys == [cbsampler.row_key(seed, i) for i in range(64)]


def test_seeded_sampler_picks_one_token_per_seeded_row_and_leaves_others() -> None:
    sampler = cbsampler.SeededGumbelSampler()
    scores = torch.randn(3, 50)
    keys = torch.tensor([cbsampler.row_key(1, 0), -1, cbsampler.row_key(2, 0)], dtype=torch.int32)
    out = sampler(scores.clone(), keys)
    assert torch.isfinite(out[0]).sum() == 1
    assert torch.equal(out[1], scores[1])
    assert torch.isfinite(out[2]).sum() == 1
    assert torch.equal(sampler(scores.clone(), keys), out)  # same keys, same choice


def test_seeded_sampler_follows_the_distribution() -> None:
    # Two tokens at logits log(3) and 0: the first should win about 3 times in 4.
    sampler = cbsampler.SeededGumbelSampler()
    scores = torch.tensor([[float(torch.log(torch.tensor(3.0))), 0.0]]).repeat(4000, 1)
    keys = torch.tensor([cbsampler.row_key(9, i) for i in range(4000)], dtype=torch.int32)
    picks = torch.argmax(sampler(scores, keys), dim=-1)
    share = float((picks == 0).float().mean())
    assert 0.72 < share < 0.78
