#!/usr/bin/env bash
# Run the test suite (installs what it needs into .venv first). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec "$PY" -m pytest tests "$@"
