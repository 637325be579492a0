#!/usr/bin/env python3
"""Put the fallback server's model into a directory, once.

Installed in the fallback image as /usr/local/bin/brownout-fetch-model and
run before `brownout fallback-server` (the `fallback-model` compose service,
the init container in k8s/fallback.yaml): the server itself only loads local
directories and never downloads.

    brownout-fetch-model DEST [--model ID] [--revision REV]

- DEST already holds a model (config.json): nothing to do.
- ID `tiny`: the random-weight test model (`brownout make-tiny-model`),
  offline — the pipeline works end to end, the answers are nonsense.
- any other ID: a Hugging Face repo id, downloaded with huggingface_hub
  (weights as safetensors, tokenizer, chat template; HF_TOKEN is honoured).

The download goes to a temporary directory next to DEST and is renamed into
place when complete, so an interrupted run never leaves half a model behind.
Defaults come from FALLBACK_MODEL and FALLBACK_MODEL_REVISION.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Enough to load a causal LM and its tokenizer; skips .bin/.pt/.gguf duplicates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def has_model(dest: Path) -> bool:
    return (dest / "config.json").is_file()


def download(repo_id: str, revision: str | None, dest: Path) -> None:
    from huggingface_hub import snapshot_download

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        snapshot_download(
            repo_id=repo_id, revision=revision, local_dir=tmp, allow_patterns=ALLOW_PATTERNS
        )
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
        if not has_model(tmp):
            raise RuntimeError(f"{repo_id}: no config.json in the download")
        if dest.exists():
            dest.rmdir()  # only an empty directory may be replaced (e.g. a mount point)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brownout-fetch-model", description=__doc__)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--model", default=os.environ.get("FALLBACK_MODEL", ""))
    parser.add_argument("--revision", default=os.environ.get("FALLBACK_MODEL_REVISION") or None)
    args = parser.parse_args(argv)
    dest: Path = args.dest
    if has_model(dest):
        print(f"{dest}: model present, nothing to do")
        return 0
    if not args.model:
        print(f"{dest}: no model there and none named (--model or FALLBACK_MODEL)", file=sys.stderr)
        return 2
    if args.model == "tiny":
        from proxy.tinymodel import write_tiny_model

        write_tiny_model(dest)
    else:
        download(args.model, args.revision, dest)
    print(f"{dest}: {args.model} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
