#!/usr/bin/env bash
# The README's main job: a tiny gated GPT (TP=2, head-wise attention gate) on 2 CPU ranks, trained
# on the Python standard library's source; about 30-40 s on 2 cores.
#   bash scripts/pretrain.sh                             # new run dir under runs/
#   bash scripts/pretrain.sh training.train_iters=200    # extra args: section.key=value overrides
#   RUN_DIR=runs/my_run bash scripts/pretrain.sh         # reuse a run dir: resumes its checkpoint
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        sed -n '2,6s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
        echo
        exec "$PY" "$ROOT/launch/pretrain.py" --help
    fi
done

RUN_DIR="${RUN_DIR:-$ROOT/runs/tiny_cpu-$(date +%Y%m%d-%H%M%S)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank (torchrun's default, unannounced)
args=(
    --config "$ROOT/configs/tiny_cpu.yaml"
    checkpoint.save="$RUN_DIR/checkpoints"
    checkpoint.load="$RUN_DIR/checkpoints"
    logging.metrics_file="$RUN_DIR/metrics.jsonl"
    "$@"
)
# Validate first, so that a config error is one line rather than one line plus torchrun's report,
# and a refused run leaves no run directory behind.
status=0
"$PY" "$ROOT/launch/pretrain.py" --check --world-size 2 "${args[@]}" > /dev/null || status=$?
if [[ $status -ne 0 ]]; then
    exit "$status"
fi

mkdir -p "$RUN_DIR"
echo "[pretrain.sh] run dir: $RUN_DIR" >&2
"$(dirname "$PY")/torchrun" --standalone --nproc_per_node=2 "$ROOT/launch/pretrain.py" "${args[@]}" \
    2>&1 | tee "$RUN_DIR/train.log"
