#!/usr/bin/env bash
# Smoke-test mcore_ext on older megatron-core releases (the full suite runs on .venv's release).
#
#   bash scripts/test_versions.sh [VERSION ...]   # default: $MCORE_EXT_SMOKE_VERSIONS
#
# Runs the tests marked `smoke` (gated-layer numerics at TP 2 incl. fewer groups than ranks, a
# TP 2 -> 1 checkpoint reshard, 10 launcher steps with a resume, the compatibility checks) once per
# release. Each release gets .venv-mcore-<version>, which holds only that megatron-core (pure
# Python, a 2 MB wheel) and takes everything else (torch, numpy, pytest, ...) from .venv through a
# .pth file: about 10 s to build instead of a second 1.5 GB torch download. It is rebuilt when .venv
# changes. Exits non-zero if any release's environment cannot be built or its run fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"  # .venv, $ROOT, $PY
cd "$ROOT"

# CI (scripts/test.sh) runs the oldest and the newest older release; 0.17.1, between them and
# sharing their shims, is run on request (bash scripts/test_versions.sh 0.17.1): CI's time.
DEFAULT_VERSIONS="${MCORE_EXT_SMOKE_VERSIONS:-0.16.1 0.18.2}"
if [[ $# -gt 0 ]]; then versions=("$@"); else read -r -a versions <<< "$DEFAULT_VERSIONS"; fi

# Where .venv's packages live (found through torch, wherever .venv's site-packages is).
main_site="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
main_stamp="$(cat "$VENV/.mcore_ext_stamp")"

build_env() {  # build_env VERSION VENV_DIR
    local version="$1" venv="$2"
    rm -rf "$venv"
    "$PY" -m venv "$venv" &&
    # --no-deps: its dependencies (torch, numpy, packaging) come from .venv. Installed before the
    # .pth exists, so pip does not see .venv's megatron-core.
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        "megatron-core==$version" &&
    local site &&
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" &&
    # Appended to sys.path after the venv's own site-packages: its megatron-core wins.
    echo "$main_site" > "$site/_mcore_ext_main_venv.pth" &&
    echo "$main_stamp $version" > "$venv/.mcore_ext_stamp"
}

# Does VENV_DIR's python import megatron-core VERSION from VENV_DIR? (stderr: megatron's import noise)
CHECK_ENV='
import importlib.metadata, os, sys
import megatron.core
version, venv = sys.argv[1], os.path.realpath(sys.argv[2])
found = importlib.metadata.version("megatron-core")
where = os.path.realpath(megatron.core.__file__)
if found != version or not where.startswith(venv + os.sep):
    sys.exit(print(f"megatron-core {found} from {where}") or 1)
'
check_env() {  # check_env VERSION VENV_DIR
    local found
    found="$("$2/bin/python" -W ignore -c "$CHECK_ENV" "$1" "$2" 2>/dev/null)" && return 0
    echo "error: $2 does not import megatron-core $1 from itself (found: ${found:-none});" \
         "delete it and re-run" >&2
    return 1
}

mapfile -t smoke_files < <(grep -rl --include='test_*.py' 'pytest.mark.smoke' tests | sort)
failed=()
for version in "${versions[@]}"; do
    venv="$ROOT/.venv-mcore-$version"
    if [[ "$(cat "$venv/.mcore_ext_stamp" 2>/dev/null)" != "$main_stamp $version" ]]; then
        echo "[versions] building $venv" >&2
        if ! build_env "$version" "$venv"; then
            rm -rf "$venv"
            echo "error: cannot build the environment for megatron-core $version in $venv" \
                 "(see pip's output above); its smoke run did not happen" >&2
            failed+=("$version (environment)")
            continue
        fi
    fi
    if ! check_env "$version" "$venv"; then
        failed+=("$version (environment)")
        continue
    fi
    echo "[versions] megatron-core $version: pytest -m smoke" >&2
    start=$SECONDS
    rc=0
    # Only the files holding smoke tests: collecting the others imports what they import
    # (transformers, peft, ...) for nothing, once per release.
    "$venv/bin/python" -m pytest "${smoke_files[@]}" -m smoke -p no:cacheprovider || rc=$?
    echo "[versions] megatron-core $version: exit code $rc in $((SECONDS - start)) s" >&2
    if [[ $rc -eq 5 ]]; then
        echo "error: no tests are marked smoke (pytest exit code 5)" >&2
    fi
    [[ $rc -eq 0 ]] || failed+=("$version (pytest exit code $rc)")
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "error: smoke runs failed for megatron-core ${failed[*]}" >&2
    exit 1
fi
echo "[versions] smoke runs passed on megatron-core ${versions[*]}" >&2
