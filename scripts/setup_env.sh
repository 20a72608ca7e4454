#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install mcore_ext into it.
# Sourced by scripts/pretrain.sh and scripts/test.sh; sets $PY to the venv's python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MCORE_EXT_VENV:-$ROOT/.venv}"
TORCH_VERSION="${MCORE_EXT_TORCH:-2.13.0}"
# The torchvision release built for that torch (each pins one torch): transformers' image processors
# run on it (chat data with images, mcore_ext/data/chat_images.py). Installed with torch, so pip
# never trades the torch above for the one a newer torchvision wants.
TORCHVISION_VERSION="${MCORE_EXT_TORCHVISION:-0.28.0}"
# The megatron-core release the full suite runs on (scripts/test_versions.sh smoke-tests the others).
MEGATRON_VERSION="${MCORE_EXT_MEGATRON:-0.19.2}"

source "$ROOT/scripts/find_python.sh"

stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/find_python.sh" | sha256sum | cut -c1-16)"
stamp="$stamp-$TORCH_VERSION-$TORCHVISION_VERSION-$MEGATRON_VERSION"
if [[ ! -x "$VENV/bin/python" ]] || [[ "$(cat "$VENV/.mcore_ext_stamp" 2>/dev/null)" != "$stamp" ]]; then
    if ! BASE_PY="$(find_python)"; then
        echo "error: mcore_ext needs Python >= 3.12 (megatron-core >= 0.17 requires it), and none" \
             "was found on PATH or under pyenv. Install one, or put it on PATH." >&2
        exit 1
    fi
    echo "[setup] creating $VENV with $BASE_PY ($("$BASE_PY" --version))" >&2
    "$BASE_PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" \
        "torchvision==$TORCHVISION_VERSION" "megatron-core==$MEGATRON_VERSION"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
    echo "$stamp" > "$VENV/.mcore_ext_stamp"
fi
PY="$VENV/bin/python"
