#!/usr/bin/env bash
# Megatron-LM's own training loop (megatron.training.pretrain) with mcore_ext's gated model: a tiny
# GPT on 2 CPU ranks, TP 2, head-wise attention gate on, trained on the Python standard library's
# source (byte-level, the data of scripts/pretrain.sh); docs/megatron-lm.md.
#   bash scripts/pretrain_megatron_lm.sh                      # new run dir under runs/
#   bash scripts/pretrain_megatron_lm.sh --train-iters 200    # extra args: Megatron-LM's flags
#   RUN_DIR=runs/my_run bash scripts/pretrain_megatron_lm.sh  # reuse a run dir: resumes it
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"

RUN_DIR="${RUN_DIR:-$ROOT/runs/megatron_lm_tiny-$(date +%Y%m%d-%H%M%S)}"
DATA="$ROOT/runs/data/stdlib_byte"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank
if [[ ! -f "$DATA.idx" ]]; then  # the launcher's stdlib dataset: 256 bytes + end-of-document 256
    "$PY" -c "import sys; from mcore_ext.data.preprocess import preprocess, stdlib_sources; \
preprocess(stdlib_sources(), sys.argv[1])" "$DATA"
fi
mkdir -p "$RUN_DIR"
args=(
    # model: 2 layers x 128, 4 heads in 2 query groups, RoPE, SwiGLU, the gate (with a QKV bias
    # for its init bias), mcore_ext's SDPA backend (CPU and GPU)
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention
    --num-query-groups 2 --seq-length 128 --max-position-embeddings 128
    --position-embedding-type rope --no-rope-fusion --swiglu --disable-bias-linear --add-qkv-bias
    --hidden-dropout 0 --attention-dropout 0 --head-wise-attn-gate --mcore-ext-backend sdpa
    --transformer-impl local --no-gradient-accumulation-fusion
    # training: TP 2 on the 2 ranks, 2 micro-batches of 8 per step
    --tensor-model-parallel-size 2 --micro-batch-size 8 --global-batch-size 16
    --train-iters 100 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234
    # data: megatron's GPT dataset over the .bin/.idx; NullTokenizer: ids < 257, end-of-doc 256
    --data-path "$DATA" --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 257
    # evaluation (megatron needs --eval-interval), logging, checkpoints (resumed when present)
    --eval-interval 50 --eval-iters 2 --log-interval 10
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 50
    --ckpt-format torch_dist
    "$@"
)
echo "[pretrain_megatron_lm.sh] run dir: $RUN_DIR" >&2
# mcore_ext.torchrun: torchrun whose exit code is 2 (one error line) for a mistake in the flags.
"$PY" -m mcore_ext.torchrun --standalone --nproc_per_node=2 \
    -m mcore_ext.megatron_lm.pretrain_gpt "${args[@]}" 2>&1 | tee "$RUN_DIR/train.log"
exit "${PIPESTATUS[0]}"
