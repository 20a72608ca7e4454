#!/usr/bin/env bash
# Run the test suite (installs what it needs into .venv first).
#   bash scripts/test.sh            the whole suite on .venv's megatron-core (0.19.2), then the
#                                   smoke runs on the older releases (scripts/test_versions.sh)
#   bash scripts/test.sh ARGS...    pytest ARGS on .venv only (e.g. -k reshard -x, or
#                                   tests/unit/test_docs.py -x: that file alone)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
if [[ $# -gt 0 ]]; then
    exec "$PY" -m pytest "$@"  # no path given: pyproject's testpaths (tests/)
fi
suite=0
"$PY" -m pytest tests || suite=$?
smoke=0
bash "$ROOT/scripts/test_versions.sh" || smoke=$?
if [[ $suite -ne 0 || $smoke -ne 0 ]]; then
    echo "error: main suite exit code $suite, older-release smoke runs exit code $smoke" >&2
    exit 1
fi
