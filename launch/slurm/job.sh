# The part of the Slurm job scripts (pretrain.sbatch, pretrain_megatron_lm.sbatch) that does not
# depend on the training program; sourced by them, never run on its own.
#   job_start                   checkout, Python, nodes, processes per node, rendezvous, logs
#   job_train PROGRAM ARGS...   one `python -m mcore_ext.torchrun` agent per node through srun
#                               (c10d rendezvous on the first node), output in $LOG; sets $status
#   job_end STOPPED SAVED       the job's end: finished (exit 0), saved and requeued, or failed
#   in_log PATTERN              yes / no: whether this start's log has a matching line
# docs/training.md#on-a-slurm-cluster says what each signal and exit code means. The job script
# sets ROOT (the checkout) before sourcing this.

say() { echo "[slurm] $(date +%H:%M:%S) job ${SLURM_JOB_ID} restart ${RESTART}: $*"; }

job_start() {
    RESTART="${SLURM_RESTART_COUNT:-0}"
    PY="${MCORE_EXT_PYTHON:-$ROOT/.venv/bin/python}"
    [[ -x "$PY" ]] || PY="$(command -v python3)"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mcore_ext
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

    NNODES="${SLURM_NTASKS:-${SLURM_JOB_NUM_NODES:-1}}"  # one agent per task, one task per node
    local gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}"
    gpus="${gpus##*:}"  # --gpus-per-node=h100:8 -> 8
    NPROC_PER_NODE="${NPROC_PER_NODE:-${gpus:-1}}"
    HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
    LOGS="${MCORE_EXT_SLURM_LOGS:-$SLURM_SUBMIT_DIR/logs/slurm}/$SLURM_JOB_ID"
    LOG="$LOGS/restart$RESTART.log"
    mkdir -p "$LOGS"

    # srun ends its job step at once (SIGKILL) when it gets SIGTERM itself, so Slurm signals
    # the batch shell only (B:) and it passes the signal to the job steps, never to srun.
    trap 'job_forward TERM' TERM
    trap 'job_forward USR1' USR1
}

job_forward() {
    say "$1 received: passed on to the training processes (they save at the next step boundary)"
    scancel --signal="$1" "$SLURM_JOB_ID"
}

job_train() {
    say "$NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $HEAD:$MASTER_PORT, log $LOG"
    # is_host: the first task serves the rendezvous store (tasks sharing a host would all claim it).
    srun --label bash -c 'exec "$0" -m mcore_ext.torchrun --nnodes="$1" --nproc-per-node="$2" \
            --rdzv-backend=c10d --rdzv-endpoint="$3" --rdzv-id="$4" \
            --rdzv-conf=is_host=$((SLURM_PROCID == 0)) --max-restarts=0 "${@:5}"' \
        "$PY" "$NNODES" "$NPROC_PER_NODE" "$HEAD:$MASTER_PORT" "$SLURM_JOB_ID-$RESTART" \
        "$@" > "$LOG" 2>&1 &
    local srun_pid=$!
    while true; do
        wait "$srun_pid"
        status=$?
        kill -0 "$srun_pid" 2>/dev/null || break  # else wait was cut short by a trapped signal
    done
}

# job_end STOPPED SAVED (each yes or no): stopped early (a signal, a time limit) after saving:
# requeue, the next start resumes. Stopped without saving: a restart without progress; after more
# than MCORE_EXT_SLURM_MAX_STALLED (2) in a row the job fails instead. Not stopped: the training's
# exit code is the job's (0 COMPLETED, else FAILED, not requeued).
job_end() {
    local stopped="$1" saved="$2" stalled_file="$LOGS/stalled_restarts" stalled
    if [[ "$stopped" != yes ]]; then
        if (( status == 0 )); then
            say "finished"
            exit 0
        fi
        say "error: training exited with code $status (log $LOG): not requeued"
        exit "$status"
    fi
    if [[ "$saved" == yes ]]; then
        echo 0 > "$stalled_file"
    else
        echo $(( $(cat "$stalled_file" 2>/dev/null || echo 0) + 1 )) > "$stalled_file"
    fi
    stalled="$(cat "$stalled_file")"
    if (( stalled > ${MCORE_EXT_SLURM_MAX_STALLED:-2} )); then
        say "error: stopped without saving a checkpoint $stalled times in a row" \
            "(is a checkpoint save folder set?): not requeued"
        exit 1
    fi
    say "saved, not finished (exit code $status): requeued, the next start resumes"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}

# in_log PATTERN: yes when this start's log has a line matching the extended regex, else no.
in_log() { if grep -Eq "$1" "$LOG"; then echo yes; else echo no; fi; }
