#!/usr/bin/env bash
# Run the test suite (installs what it needs into .venv first).
#   bash scripts/test.sh            the whole suite on .venv's megatron-core (0.19.2; Slurm's
#                                   daemons installed first where root can: setup_slurm.sh), then the
#                                   smoke runs on the older releases (scripts/test_versions.sh),
#                                   then the Megatron-Bridge suite in .venv-bridge
#                                   (scripts/setup_bridge.sh; pytest -m bridge)
#   bash scripts/test.sh ARGS...    pytest ARGS on .venv only (e.g. -k reshard -x, or a test
#                                   file: only it; without a path pytest runs tests/)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
if [[ $# -gt 0 ]]; then
    exec "$PY" -m pytest "$@"  # no path given: pyproject's testpaths (tests/)
fi
bash "$ROOT/scripts/setup_slurm.sh"  # Debian's slurm-wlm + munge for tests/functional/test_slurm.py
suite=0
"$PY" -m pytest tests || suite=$?
smoke=0
bash "$ROOT/scripts/test_versions.sh" || smoke=$?
bridge=0
{ bash "$ROOT/scripts/setup_bridge.sh" &&
  PYTHONPATH="$ROOT" "${MCORE_EXT_BRIDGE_VENV:-$ROOT/.venv-bridge}/bin/python" -m pytest \
      tests/bridge -m bridge; } || bridge=$?
if [[ $suite -ne 0 || $smoke -ne 0 || $bridge -ne 0 ]]; then
    echo "error: main suite exit code $suite, older-release smoke runs exit code $smoke," \
         "Megatron-Bridge suite exit code $bridge" >&2
    exit 1
fi
