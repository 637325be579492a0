"""The tiny model loads in transformers and renders ChatML as vLLM expects."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer

from proxy.tinymodel import (
    MARKER_FILE,
    TINY_MODEL_VERSION,
    is_tiny_model,
    write_tiny_model,
)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! How are you?"},
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_loads_in_transformers_and_vocab_matches(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    config = model.config
    assert config.model_type == "llama"
    assert config.vocab_size == len(tokenizer)
    assert 1000 <= len(tokenizer) <= 2000
    # vLLM's CPU attention kernel needs head_dim >= 32.
    assert config.hidden_size // config.num_attention_heads == 64
    assert config.num_key_value_heads == 1
    assert config.max_position_embeddings == 2048
    assert str(model.dtype) == "torch.float32"
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_special_tokens(tokenizer: Any) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    for token in ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
    # Byte-level: any text round-trips, including what random weights emit.
    text = "héllo wörld 😀 \ufffd\ttab"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_chatml(tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello! How are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert closed.endswith("How are you?<|im_end|>\n")


def test_continue_final_message_leaves_assistant_open(tokenizer: Any) -> None:
    partial = [*MESSAGES, {"role": "assistant", "content": "I am fine, thank"}]
    rendered = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nI am fine, thank")
    assert rendered.count("<|im_end|>") == 2


def test_model_generates(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    inputs = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", seed=3)
    b = write_tiny_model(tmp_path / "b", seed=3)
    c = write_tiny_model(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(a / name) == _sha256(b / name), name
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")
    assert _sha256(a / "tokenizer.json") == _sha256(c / "tokenizer.json")
    marker = json.loads((a / MARKER_FILE).read_text())
    assert marker["version"] == TINY_MODEL_VERSION
    assert marker["seed"] == 3


def test_atomic_install_rules(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()  # an empty directory is replaced
    write_tiny_model(dest, seed=1)
    assert is_tiny_model(dest, seed=1)
    first = _sha256(dest / "model.safetensors")

    write_tiny_model(dest, seed=1)  # same seed: kept as is
    assert _sha256(dest / "model.safetensors") == first

    write_tiny_model(dest, seed=2)  # another tiny model: replaced
    assert is_tiny_model(dest, seed=2)
    assert _sha256(dest / "model.safetensors") != first

    other = tmp_path / "not-a-model"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_tiny_model(other)
    assert (other / "precious.txt").read_text() == "keep me"
    # No temporary directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "not-a-model"]


def test_chat_template_renders_tools_hermes_style(tokenizer: Any) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in system
    assert "<tool_call></tool_call>" in system
    assert rest == (
        "<|im_start|>user\nHello! How are you?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
