"""Train the tiny model's byte-level BPE tokenizer and save it for transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.tinymodel.corpus import training_lines
from proxy.tinymodel.template import CHAT_TEMPLATE

__all__ = ["SPECIAL_TOKENS", "VOCAB_SIZE", "build_tokenizer"]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

VOCAB_SIZE = 1536


def build_tokenizer(work: Path) -> Any:
    """Train the byte-level BPE and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet so any input (emoji, U+FFFD, …) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_lines(), trainer=trainer)

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(work))
    # transformers 5 records its internal class name ("TokenizersBackend");
    # the public name loads in every transformers version, including vLLM's.
    config_path = work / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return fast
