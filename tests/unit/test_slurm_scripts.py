"""The job scripts' own decisions (launch/slurm), run by bash with stand-ins for srun, scontrol and
scancel: what srun is given, what the script does with its exit code, its log and the signals the
batch shell gets. No Slurm and no training (a fraction of a second each); the scripts on a real
slurmctld + slurmd with the launcher and Megatron-LM: tests/functional/test_slurm.py.

The srun stand-in records its arguments and runs $SRUN_DOES (bash), whose output is the start's
log as srun's would be; scontrol answers ``show hostnames`` and records ``requeue`` (exit code
$REQUEUE_EXIT); scancel records its arguments and touches ``scancel.done``.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "launch" / "slurm"
LAUNCHER_JOB = SLURM / "pretrain.sbatch"
MEGATRON_LM_JOB = SLURM / "pretrain_megatron_lm.sbatch"

STUBS = {
    "srun": """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_DIR/srun.args"
eval "$SRUN_DOES"
""",
    "scontrol": """#!/bin/bash
case "$1" in
    show) echo node0 ;;
    requeue) echo "requeue $2" >> "$STUB_DIR/calls"; exit "${REQUEUE_EXIT:-0}" ;;
esac
""",
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$STUB_DIR/calls"
touch "$STUB_DIR/scancel.done"
sleep "${SCANCEL_TAKES_S:-0}"
""",
}


@pytest.fixture
def job(tmp_path):
    """run(script, *args, does=BASH, restart=0, **env) -> (exit code, Slurm output, calls)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)

    def run(script, *args, does="exit 0", restart=0, **env):
        (tmp_path / "calls").unlink(missing_ok=True)
        (tmp_path / "scancel.done").unlink(missing_ok=True)
        done = subprocess.run(
            ["bash", str(script), *map(str, args)], capture_output=True, text=True, timeout=60,
            cwd=tmp_path,
            env={"PATH": f"{stubs}:{os.environ['PATH']}", "HOME": str(tmp_path),
                 "STUB_DIR": str(tmp_path), "SRUN_DOES": does, "MCORE_EXT_ROOT": str(ROOT),
                 "MCORE_EXT_PYTHON": "/bin/true", "MCORE_EXT_SLURM_LOGS": str(tmp_path / "logs"),
                 "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path),
                 "SLURM_JOB_NODELIST": "node0", "SLURM_NTASKS": "1",
                 "SLURM_RESTART_COUNT": str(restart), **env})
        calls = tmp_path / "calls"
        return (done.returncode, done.stdout + done.stderr,
                calls.read_text().splitlines() if calls.exists() else [])

    run.srun_args = lambda: (tmp_path / "srun.args").read_text().splitlines()
    return run


def _track(folder, iteration):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))


# Megatron-LM's lines, as its log has them.
def _megatron_log(iteration, train_iters, saved):
    return (f"echo ' [2026-01-01] iteration {iteration:8d}/{train_iters:8d} | lm loss: 1.0E+00 |';"
            f" echo 'successfully saved checkpoint from iteration {saved:7d} to X';"
            " echo '[2026-01-01] exiting program after receiving SIGTERM.'")


def test_megatron_lm_job_resumes_from_save_once_it_holds_a_checkpoint(job, tmp_path):
    """--load A --save B: the first start loads A (with its --finetune); once B holds a
    checkpoint every start resumes from B, A's flags dropped (before: every requeued start went
    back to A, its --finetune resetting the iteration)."""
    a, b = tmp_path / "a", tmp_path / "b"
    _track(a, 100)
    flags = ["--num-layers", "2", "--load", a, "--finetune", "--no-load-optim", "--save", b,
             "--train-iters", "10"]
    code, out, calls = job(MEGATRON_LM_JOB, *flags)
    assert code == 0, out
    first = job.srun_args()
    assert first[first.index("--load") + 1] == str(a) and "--finetune" in first, first

    _track(b, 4)
    code, out, calls = job(MEGATRON_LM_JOB, *flags, restart=1)
    assert code == 0, out
    again = job.srun_args()
    assert [again[i + 1] for i, arg in enumerate(again) if arg == "--load"] == [str(b)], again
    assert "--finetune" not in again and "--no-load-optim" not in again, again
    assert "--num-layers" in again and "--exit-signal-handler" in again
    assert f"resuming from {b} (iteration 4)" in out


def test_megatron_lm_signal_in_the_last_iteration_is_the_jobs_end(job, tmp_path):
    """Megatron-LM saved the last iteration on the signal and said "exiting program after
    receiving SIGTERM.": the job is complete, not requeued (before: requeued once, to a start
    with nothing to train)."""
    b = tmp_path / "b"
    code, out, calls = job(
        MEGATRON_LM_JOB, "--save", b, "--train-iters", "10",
        does=f"{_megatron_log(10, 10, 10)}; mkdir -p {b}; echo 10 > {b}/latest_checkpointed_iteration.txt")
    assert code == 0 and calls == [], (out, calls)
    assert "iteration 10 of 10 saved: the run is complete" in out and "finished" in out


def test_megatron_lm_stops_that_move_no_checkpoint_on_fail_the_job(job, tmp_path):
    """Each start saves on the signal, but --save's latest iteration stays where it was (as when
    every start went back to --load's): after more than 2 such starts in a row the job fails
    (before: a save line was progress, so the job requeued for ever)."""
    b = tmp_path / "b"
    _track(b, 5)
    codes = []
    for restart in range(3):
        code, out, calls = job(MEGATRON_LM_JOB, "--save", b, "--train-iters", "10",
                               does=_megatron_log(5, 10, 5), restart=restart)
        codes.append((code, calls))
    assert codes == [(0, ["requeue 42"]), (0, ["requeue 42"]), (1, [])], (codes, out)
    assert "stopped without a new checkpoint 3 times in a row" in out


def test_a_refused_requeue_ends_the_job_unfinished(job):
    """The launcher saved and exited 16, scontrol refuses the requeue (a job submitted with
    --no-requeue): exit 16, not 0 (before: 0, so the unfinished job read COMPLETED)."""
    code, out, calls = job(LAUNCHER_JOB, "--config", "x.yaml",
                           does="echo '[checkpoint] saved iteration 3 to X'; exit 16",
                           REQUEUE_EXIT="1")
    assert calls == ["requeue 42"]
    assert code == 16 and "scontrol requeue 42 was refused" in out, out


@pytest.mark.parametrize("signal_name", ["TERM", "USR1"])
def test_a_signal_as_srun_exits_keeps_its_exit_code_and_becomes_term(job, signal_name):
    """The batch shell gets a signal while srun ends with 16: the trap's scancel passes SIGTERM on
    (the launcher's and Megatron-LM's saving signal, for USR1 too), and the job requeues on srun's
    16 (before: wait's 128 + signal became the exit code, FAILED; USR1 was passed on as USR1)."""
    does = (f"kill -{signal_name} $PPID; while [ ! -e $STUB_DIR/scancel.done ]; do sleep 0.01; "
            "done; echo '[checkpoint] saved iteration 3 to X'; exit 16")
    code, out, calls = job(LAUNCHER_JOB, "--config", "x.yaml", does=does, SCANCEL_TAKES_S="1")
    assert calls == ["scancel --signal=TERM 42", "requeue 42"], (calls, out)
    assert code == 0 and "saved, not finished (exit code 16): requeued" in out, out
    assert f"{signal_name} received: TERM passed on" in out


def test_megatron_lm_job_passes_on_its_exit_signal(job, tmp_path):
    """--exit-signal 10 (SIGUSR1): the batch shell's SIGTERM is passed on as 10, the signal
    Megatron-LM's handler saves on."""
    does = ("kill -TERM $PPID; while [ ! -e $STUB_DIR/scancel.done ]; do sleep 0.01; done; exit 1")
    code, out, calls = job(MEGATRON_LM_JOB, "--save", tmp_path / "b", "--exit-signal", "10",
                           does=does)
    assert calls == ["scancel --signal=10 42"] and code == 1, (calls, out)


def test_job_scripts_expand_arrays_portably():
    """"${a[@]}" of an empty array under set -u aborts on bash < 4.4 (RHEL 7: 'unbound
    variable'): every array expansion is ${a[@]+"${a[@]}"}."""
    for path in SLURM.iterdir():
        text = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        for match in re.finditer(r'"\$\{(\w+)\[@\]\}"', text):
            guard = "${" + match.group(1) + "[@]+"
            assert text[:match.start()].endswith(guard), (
                f"{path.name}: {match.group(0)} at {text[:match.start()].count(chr(10)) + 1}")
