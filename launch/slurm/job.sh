# The part of the Slurm job scripts (pretrain.sbatch, pretrain_megatron_lm.sbatch) that does not
# depend on the training program; sourced by them, never run on its own.
#   job_start                   checkout, Python, nodes, processes per node, rendezvous, logs,
#                               the signal traps
#   job_train PROGRAM ARGS...   one launch/torchrun.py agent (python -m mcore_ext.torchrun) per
#                               node through srun (c10d rendezvous on the first node), output in
#                               $LOG; sets $status, srun's exit code
#   job_end STOPPED PROGRESS    the job's end: finished (exit 0), requeued, or failed
#   in_log PATTERN              yes / no: whether this start's log has a matching line
# docs/training.md#on-a-slurm-cluster says what each signal and exit code means. The job script
# sets ROOT (the checkout) before sourcing this, and may set STOP_SIGNAL (default TERM), the
# signal its training saves on.

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
    # the batch shell only (B:) and it passes the signal to the job steps, never to srun. Each
    # signal a scheduler is asked to send (--signal=B:TERM, USR1 or USR2) becomes STOP_SIGNAL,
    # the one the training saves on.
    STOP_SIGNAL="${STOP_SIGNAL:-TERM}"
    FORWARDED=0  # how many signals this shell has passed on
    trap 'job_forward TERM' TERM
    trap 'job_forward USR1' USR1
    trap 'job_forward USR2' USR2
}

job_forward() {
    FORWARDED=$((FORWARDED + 1))
    say "$1 received: $STOP_SIGNAL passed on to the training processes (they save at the next" \
        "step boundary)"
    scancel --signal="$STOP_SIGNAL" "$SLURM_JOB_ID"
}

job_train() {
    say "$NNODES node(s) x $NPROC_PER_NODE process(es), rendezvous $HEAD:$MASTER_PORT, log $LOG"
    # is_host: the first task serves the rendezvous store (tasks sharing a host would all claim it).
    # launch/torchrun.py: python -m mcore_ext.torchrun, holding the stop signals while it imports.
    srun --label bash -c 'exec "$0" "$1" --nnodes="$2" --nproc-per-node="$3" \
            --rdzv-backend=c10d --rdzv-endpoint="$4" --rdzv-id="$5" \
            --rdzv-conf=is_host=$((SLURM_PROCID == 0)) --max-restarts=0 "${@:6}"' \
        "$PY" "$ROOT/launch/torchrun.py" "$NNODES" "$NPROC_PER_NODE" "$HEAD:$MASTER_PORT" \
        "$SLURM_JOB_ID-$RESTART" "$@" > "$LOG" 2>&1 &
    local srun_pid=$! seen code
    status=""
    # A trapped signal ends `wait` early with 128 + its number: wait again, for srun's own exit
    # code. If srun had exited just before the signal, that wait already returned its code and
    # srun is no longer a child of this shell (127): keep it.
    while true; do
        seen=$FORWARDED
        wait "$srun_pid" 2>/dev/null
        code=$?
        if (( code == 127 )) && [[ -n "$status" ]]; then
            break
        fi
        status=$code
        (( FORWARDED == seen )) && break
    done
}

# job_end STOPPED PROGRESS (each yes or no): stopped early (a signal, a time limit): requeue, the
# next start resumes. A stop without progress (no new checkpoint) is a restart without progress;
# after more than MCORE_EXT_SLURM_MAX_STALLED (2) in a row the job fails instead. Not stopped: the
# training's exit code is the job's (0 COMPLETED, else FAILED, not requeued).
job_end() {
    local stopped="$1" progress="$2" stalled_file="$LOGS/stalled_restarts" stalled
    if [[ "$stopped" != yes ]]; then
        if (( status == 0 )); then
            say "finished"
            exit 0
        fi
        say "error: training exited with code $status (log $LOG): not requeued"
        exit "$status"
    fi
    if [[ "$progress" == yes ]]; then
        echo 0 > "$stalled_file"
    else
        echo $(( $(cat "$stalled_file" 2>/dev/null || echo 0) + 1 )) > "$stalled_file"
    fi
    stalled="$(cat "$stalled_file")"
    if (( stalled > ${MCORE_EXT_SLURM_MAX_STALLED:-2} )); then
        say "error: stopped without a new checkpoint $stalled times in a row (signalled before" \
            "the first step, or no checkpoint save folder set): not requeued"
        exit 1
    fi
    if [[ "$progress" == yes ]]; then
        say "saved, not finished (exit code $status): requeued, the next start resumes"
    else
        say "stopped without a new checkpoint (exit code $status; $stalled in a row): requeued," \
            "the next start begins where this one did"
    fi
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        # Not COMPLETED: the run is not finished. 16 as the launcher's "saved, not finished".
        say "error: scontrol requeue $SLURM_JOB_ID was refused (above): the job ends unfinished" \
            "(exit code 16); submit it again to resume"
        exit 16
    fi
    exit 0
}

# in_log PATTERN: yes when this start's log has a line matching the extended regex, else no.
in_log() { if grep -Eq "$1" "$LOG"; then echo yes; else echo no; fi; }

# tracked_iteration DIR: the iteration DIR's latest_checkpointed_iteration.txt names (the tracker
# the launcher and Megatron-LM write), empty when there is none.
tracked_iteration() {
    local text
    text="$(cat "$1/latest_checkpointed_iteration.txt" 2>/dev/null)" || return 0
    [[ "$text" =~ ^[[:space:]]*([0-9]+)[[:space:]]*$ ]] && echo "$((10#${BASH_REMATCH[1]}))"
    return 0
}
