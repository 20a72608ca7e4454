#!/usr/bin/env bash
# Build the test-only environment for tests/upstream/: upstream Megatron-LM's dev branch (which has
# the native `head_wise_attn_gate`) in its own virtual environment, from a git export. Nothing of
# it is installed into .venv, and none of its code enters this repository.
#
#   MEGATRON_LM_GIT=/path/to/Megatron-LM.git bash scripts/setup_upstream_dev.sh
#
# MEGATRON_LM_GIT      a clone or bare mirror of https://github.com/NVIDIA/Megatron-LM (required)
# MEGATRON_LM_REF      commit, tag or branch to export (default: dev)
# UPSTREAM_DEV_DIR     where to build (default: .upstream-dev): src/ (the export), venv/, COMMIT
#                      (the exported commit; the tests report it)
# UPSTREAM_DEV_PYTHON  the Python to build the venv from (default: a Python >= 3.12 on PATH/pyenv)
# TORCH_SITE_PACKAGES  optional: a site-packages of the same Python version that already holds
#                      torch (e.g. .venv's); it is appended to the venv's path instead of
#                      downloading torch again. Upstream's megatron still comes first.
#
# Upstream needs no C++ build at run time (its one extension, the dataset helpers, is optional),
# so it is installed with `pip install --no-build-isolation --no-deps -e` after its build
# requirements; its run-time imports are torch, numpy and packaging (psutil for checkpoints).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${UPSTREAM_DEV_DIR:-$ROOT/.upstream-dev}"
REF="${MEGATRON_LM_REF:-dev}"
TORCH_VERSION="${UPSTREAM_DEV_TORCH:-2.13.0}"
: "${MEGATRON_LM_GIT:?set MEGATRON_LM_GIT to a clone or bare mirror of NVIDIA/Megatron-LM}"

say() { echo "[setup_upstream_dev] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

git_() { git --git-dir="$MEGATRON_LM_GIT" "$@"; }
if ! git_ rev-parse --git-dir >/dev/null 2>&1; then
    # A clone with a work tree: its git directory is .git.
    [[ -d "$MEGATRON_LM_GIT/.git" ]] || die "$MEGATRON_LM_GIT is not a git repository"
    MEGATRON_LM_GIT="$MEGATRON_LM_GIT/.git"
fi
# A bare mirror has the branch itself; an ordinary clone may only have origin/<branch>.
COMMIT="$(git_ rev-parse --verify --quiet "$REF^{commit}" \
          || git_ rev-parse --verify --quiet "origin/$REF^{commit}")" \
    || die "$REF is not a commit in $MEGATRON_LM_GIT (branches: git --git-dir=... branch -a)"
git_ show "$COMMIT:megatron/core/transformer/transformer_config.py" \
    | grep "head_wise_attn_gate" >/dev/null \
    || die "Megatron-LM $COMMIT has no head_wise_attn_gate in its TransformerConfig"

source "$ROOT/scripts/find_python.sh"
if [[ -n "${UPSTREAM_DEV_PYTHON:-}" ]]; then
    supports_312 "$UPSTREAM_DEV_PYTHON" || die "UPSTREAM_DEV_PYTHON=$UPSTREAM_DEV_PYTHON is not a Python >= 3.12"
    find_python() { echo "$UPSTREAM_DEV_PYTHON"; }
fi

if [[ "$(cat "$DEST/COMMIT" 2>/dev/null)" == "$COMMIT" && -x "$DEST/venv/bin/python" ]]; then
    say "up to date: Megatron-LM $COMMIT in $DEST"
    exit 0
fi

say "exporting Megatron-LM $REF = $COMMIT to $DEST/src"
rm -rf "$DEST/src" "$DEST/path" "$DEST/COMMIT"
mkdir -p "$DEST/src"
git_ archive "$COMMIT" | tar -x -C "$DEST/src"

if [[ ! -x "$DEST/venv/bin/python" ]]; then
    BASE_PY="$(find_python)" || die "upstream megatron-core needs Python >= 3.12; none found \
on PATH or under pyenv (set UPSTREAM_DEV_PYTHON)"
    say "creating $DEST/venv with $BASE_PY ($("$BASE_PY" --version))"
    "$BASE_PY" -m venv "$DEST/venv"
fi
PY="$DEST/venv/bin/python"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pip_() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# Upstream's build requirements (pyproject [build-system]) and what the tests and its
# dist-checkpointing import at run time.
pip_ pybind11 "setuptools<80" "packaging>=24.2" wheel numpy PyYAML psutil pytest pytest-timeout

if [[ -n "${TORCH_SITE_PACKAGES:-}" ]]; then
    [[ -d "$TORCH_SITE_PACKAGES/torch" ]] \
        || die "no torch under TORCH_SITE_PACKAGES=$TORCH_SITE_PACKAGES"
    # A path line in a .pth is appended to sys.path after the venv's own site-packages; the .pth
    # files *inside* it (e.g. an editable mcore_ext) are not processed. Its megatron-core, if any,
    # is shadowed by the upstream export below, which is put first.
    echo "$TORCH_SITE_PACKAGES" > "$SITE/zz_torch_site_packages.pth"
    say "using torch from $TORCH_SITE_PACKAGES"
else
    rm -f "$SITE/zz_torch_site_packages.pth"
    pip_ "torch==$TORCH_VERSION"
fi

say "installing upstream megatron-core (editable, no build isolation, no deps)"
# NO_VCS_VERSION: upstream appends `git rev-parse HEAD` of its directory to its version, which
# for an export inside this repository would be *our* commit.
export NO_VCS_VERSION=1
pip_ --no-build-isolation --no-deps -e "$DEST/src"
# setuptools' editable finder comes after sys.path, where TORCH_SITE_PACKAGES may hold a released
# megatron-core: put the export's `megatron` (and nothing else of its tree) first on the path.
mkdir -p "$DEST/path"
ln -sfn ../src/megatron "$DEST/path/megatron"
echo "$DEST/path" > "$SITE/00_megatron_lm_export.pth"

"$PY" - "$DEST/src" <<'EOF'
import os, sys
import megatron.core
from megatron.core.transformer.transformer_config import TransformerConfig

src = os.path.realpath(sys.argv[1])
where = os.path.realpath(megatron.core.__file__)
if not where.startswith(src + os.sep):
    sys.exit(f"error: megatron.core imports from {where}, not from the export {src}")
if "head_wise_attn_gate" not in TransformerConfig.__dataclass_fields__:
    sys.exit("error: the exported TransformerConfig has no head_wise_attn_gate")
import torch
print(f"[setup_upstream_dev] megatron.core {megatron.core.__version__} from {where}; "
      f"torch {torch.__version__}", file=sys.stderr)
EOF
echo "$COMMIT" > "$DEST/COMMIT"
say "ready: $PY (Megatron-LM $COMMIT)"
