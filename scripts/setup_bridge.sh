#!/usr/bin/env bash
# Build the test-only environment for tests/bridge/: Megatron-Bridge 0.6.2 in .venv-bridge, next
# to (not inside) the project's .venv. Nothing is installed into .venv.
#
#   bash scripts/setup_bridge.sh
#   PYTHONPATH=$PWD .venv-bridge/bin/python -m pytest tests/bridge -m bridge
#
# .venv-bridge holds only megatron-bridge (installed --no-deps: its declared dependencies pin
# transformers <= 5.12.1 and pull CUDA-only packages such as flashinfer, fast-hadamard-transform,
# nvidia-resiliency-ext), the pure-Python packages `import megatron.bridge` needs beyond .venv
# (omegaconf and its antlr4 runtime, einops), and transformers 5.23.0: .venv may hold 5.24, which
# removed transformers.modeling_attn_mask_utils, imported by Bridge 0.6.2's model registry (its
# own pin, 5.12.1, cannot read Step-3.5's config). Everything else (torch, megatron-core 0.19.2,
# tokenizers, safetensors, pytest) comes from .venv through a .pth file appended after the
# venv's own site-packages. Bridge imports Transformer Engine from one module,
# megatron.bridge.peft.lora_layers; the tests stub that module when TE is absent
# (tests/bridge/bridge_env.py). Rebuilt when .venv or this script's pins change.
#
# MCORE_EXT_BRIDGE_BASE_VENV  use this existing project venv as is instead of creating / updating
#                             .venv through scripts/setup_env.sh
# MCORE_EXT_BRIDGE_VENV       where to build (default: .venv-bridge)
set -euo pipefail
if [[ -n "${MCORE_EXT_BRIDGE_BASE_VENV:-}" ]]; then
    ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    VENV="$MCORE_EXT_BRIDGE_BASE_VENV"
    PY="$VENV/bin/python"
    [[ -x "$PY" ]] || { echo "error: no $PY (MCORE_EXT_BRIDGE_BASE_VENV)" >&2; exit 1; }
else
    source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"  # .venv, $ROOT, $PY
fi
cd "$ROOT"

BRIDGE_VENV="${MCORE_EXT_BRIDGE_VENV:-$ROOT/.venv-bridge}"
PINS=(megatron-bridge==0.6.2 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 einops==0.8.2
      transformers==5.23.0)

main_site="$("$PY" -c 'import os, torch
print(os.path.realpath(os.path.dirname(os.path.dirname(torch.__file__))))')"
stamp="$(cat "$VENV/.mcore_ext_stamp" 2>/dev/null || echo unstamped) ${PINS[*]}"
say() { echo "[setup_bridge] $*" >&2; }

if [[ "$(cat "$BRIDGE_VENV/.mcore_ext_stamp" 2>/dev/null)" != "$stamp" ]]; then
    say "building $BRIDGE_VENV"
    rm -rf "$BRIDGE_VENV"
    "$PY" -m venv "$BRIDGE_VENV"
    # --no-deps, before the .pth exists: pip neither resolves Bridge's pins nor sees .venv.
    "$BRIDGE_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "${PINS[@]}"
    site="$("$BRIDGE_VENV/bin/python" -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # Appended after the venv's own site-packages: megatron/bridge (here) and megatron/core
    # (.venv) share the `megatron` namespace package.
    echo "$main_site" > "$site/_mcore_ext_main_venv.pth"
    echo "$stamp" > "$BRIDGE_VENV/.mcore_ext_stamp"
fi

# Checks that Bridge and megatron-core import from where they should (Bridge's import without TE
# needs the test stub, so only the files are located here).
"$BRIDGE_VENV/bin/python" - "$BRIDGE_VENV" <<'PY'
import importlib.metadata as md, importlib.util, os, sys
venv = os.path.realpath(sys.argv[1])
bridge = importlib.util.find_spec("megatron.bridge")
if bridge is None or not os.path.realpath(bridge.origin).startswith(venv + os.sep):
    sys.exit(f"error: megatron.bridge not found in {venv}")
print(f"[setup_bridge] megatron-bridge {md.version('megatron-bridge')}, megatron-core "
      f"{md.version('megatron-core')}, transformers {md.version('transformers')}, torch "
      f"{md.version('torch')}", file=sys.stderr)
PY
say "ready: $BRIDGE_VENV/bin/python"
