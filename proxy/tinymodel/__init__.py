"""Write a tiny random-weight Llama chat model, fully offline.

Used by ``brownout make-tiny-model``, the quickstart and the tests: a real
vLLM server and the Transformers fallback both load it, so the whole stack
runs on a laptop CPU without downloading anything.

What gets written (≈ 3 MB):

- a byte-level BPE tokenizer trained with ``tokenizers`` on the English text
  embedded below, saved as a ``PreTrainedTokenizerFast`` with a ChatML chat
  template (``<|im_start|>role\\ncontent<|im_end|>\\n``; eos = ``<|im_end|>``)
  that also renders tools and tool calls the Hermes way (``<tool_call>``);
- a 2-layer Llama (hidden 128, head_dim 64 — vLLM's CPU attention kernel
  needs head_dim ≥ 32) with random float32 weights in safetensors;
- ``generation_config.json`` whose eos is ``<|im_end|>``, so generation stops
  at the end of an assistant turn;
- a marker file naming the format version and seed.

The output is deterministic for a given seed, and the directory appears
atomically (built in a temporary sibling, then renamed), so concurrent
callers never see half a model.

The parts: ``corpus`` (the tokenizer's training text), ``template`` (the chat
template), ``tokenizer`` (training and saving the tokenizer), ``weights`` (the
Llama and its generation config); this module writes and recognises the
whole.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.tinymodel.tokenizer import build_tokenizer
from proxy.tinymodel.weights import build_model

__all__ = [
    "MARKER_FILE",
    "TINY_MODEL_VERSION",
    "is_tiny_model",
    "write_tiny_model",
]

log = logging.getLogger(__name__)

#: Bump when the output changes (tokenizer corpus, architecture, files):
#: caches key on it (e.g. ``~/.cache/brownout/tiny-model-v2``).
#: v2: the chat template renders tools, tool calls and tool results (Hermes style).
TINY_MODEL_VERSION = 2

MARKER_FILE = "brownout-tiny-model.json"


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_tiny_model(path: str | Path, seed: int | None = None) -> bool:
    """True if ``path`` holds a complete tiny model of the current version.

    The marker is written last, before the atomic rename, so its presence
    means the directory is complete.
    """
    marker = _read_marker(Path(path))
    if marker is None or marker.get("version") != TINY_MODEL_VERSION:
        return False
    return seed is None or marker.get("seed") == seed


def _install(tmp: Path, dest: Path, seed: int) -> None:
    """Move the finished ``tmp`` to ``dest`` without exposing a partial model."""
    try:
        # rename(2) also atomically replaces an *empty* directory.
        tmp.rename(dest)
        return
    except OSError:
        if not dest.exists():
            raise
    if is_tiny_model(dest, seed):
        # Same version and seed means identical content: a concurrent caller
        # won the race (or it was already there). Keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if _read_marker(dest) is None:
        # Never delete a directory we did not write.
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(
            f"{dest} exists and is not a brownout tiny model; refusing to replace it"
        )
    # An older tiny model (other seed or version): swap it out, then delete it.
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    dest.rename(trash / "model")
    tmp.rename(dest)
    shutil.rmtree(trash, ignore_errors=True)


def write_tiny_model(dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to ``dir`` and return its absolute path.

    Never touches the network. Deterministic for a given ``seed``. If ``dir``
    already holds a tiny model of this version and seed it is kept as is; an
    older tiny model is replaced; any other non-empty directory is an error.
    """
    dest = Path(dir).expanduser().resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tokenizer = build_tokenizer(tmp)
        log.info("tiny model: tokenizer trained, vocab %d", len(tokenizer))
        build_model(tmp, tokenizer, seed)
        log.info("tiny model: weights written (seed %d)", seed)
        marker = {"version": TINY_MODEL_VERSION, "seed": seed, "vocab_size": len(tokenizer)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        # mkdtemp (and safetensors' own temp file) create owner-only modes;
        # make the model readable like any other directory.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        _install(tmp, dest, seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("tiny model: %s ready in %.1f s", dest, time.monotonic() - started)
    return dest
