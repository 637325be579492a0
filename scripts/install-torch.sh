#!/usr/bin/env bash
# Install torch's CPU build into the venv of PYTHON (`make run`, `make test`).
#
# A bare `torch` requirement on Linux x86-64 pulls the multi-GB CUDA build
# from PyPI. In order: a torch wheel of this version already on the
# machine's disk (pip's find-links: these workplace machines have one) is
# used as is; else PyTorch's CPU index (TORCH_INDEX overrides it); and only
# if that cannot be reached, PyPI's default build.
set -euo pipefail
py=${1:?usage: install-torch.sh PYTHON}
version=${TORCH_VERSION:-2.13.0}
pip=("$py" -m pip install -q)

if "$py" -m pip install -q --dry-run --no-index --no-deps "torch==$version" >/dev/null 2>&1; then
    exec "${pip[@]}" "torch==$version"
fi
index=${TORCH_INDEX:-}
if [ -z "$index" ] && [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    index=https://download.pytorch.org/whl/cpu
fi
if [ -n "$index" ]; then
    echo "   torch $version from $index (the CPU build)"
    if "${pip[@]}" "torch==$version" --index-url "$index" --extra-index-url https://pypi.org/simple; then
        exit 0
    fi
    echo "   $index cannot be reached: torch $version from the default index" >&2
fi
exec "${pip[@]}" "torch==$version"
