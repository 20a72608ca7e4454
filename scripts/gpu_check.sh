#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; docs/gpu.md):
#   bash scripts/gpu_check.sh prepare          here: wheels -> .gpu_wheels/, print the device calls
#   bash scripts/gpu_check.sh stage N          on the GPU machine (the device call's command)
#   bash scripts/gpu_check.sh collect DIR...   here: merge the stages into benchmarks/results/
#   bash scripts/gpu_check.sh dry-run          here: every stage (GPU steps skipped without CUDA)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# The GPU machine (the device tool sets $OUT there; GPU_CHECK_DEVICE=1 forces it): no network,
# torch in the image's python3, the wheels carried in .gpu_wheels/.
if [[ "${1:-}" == stage && ( -n "${OUT:-}" || "${GPU_CHECK_DEVICE:-0}" == 1 ) ]]; then
    [[ -d "$ROOT/.gpu_wheels" ]] || { echo "error: no .gpu_wheels/: run 'bash scripts/gpu_check.sh prepare' here and carry it" >&2; exit 2; }
    BASE_PY="${GPU_CHECK_BASE_PY:-python3}"
    VENV="${GPU_CHECK_VENV:-/tmp/mcore_ext_gpu_venv}"
    if [[ ! -x "$VENV/bin/python" ]]; then
        "$BASE_PY" -m venv --system-site-packages "$VENV"
        # python3 there is itself a venv (/opt/torch/.venv): a venv made from it sees the base
        # interpreter's site-packages, not its torch, so add the image's after the venv's own.
        image_sites="$("$BASE_PY" -c 'import site; print(repr(site.getsitepackages()))')"
        echo "import site; [site.addsitedir(p) for p in $image_sites]" \
            > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_image.pth"
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
            "$ROOT"/.gpu_wheels/*.whl
    fi
    PY="$VENV/bin/python"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    source "$ROOT/scripts/setup_env.sh"
fi
exec "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
