"""launch/slurm/pretrain.sbatch on a real Slurm (munged, slurmctld and one slurmd started from a
folder of the test's: tests/functional/slurm_cluster.py), 2 ranks as two "nodes" (two tasks, each
its own torchrun agent, c10d rendezvous), the tiny config on mock data.

Skipped, with the reason, where Slurm is not installed or this is not root (scripts/test.sh
installs Debian's slurm-wlm and munge when it can).
"""

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.functional.inprocess import ROOT, TINY_MOCK, launch, losses
from tests.functional.slurm_cluster import Cluster, why_not_available
from tests.functional.test_faults import assert_exact, attempts

SBATCH = str(ROOT / "launch" / "slurm" / "pretrain.sbatch")
ITERS = 12
TIMEOUT_S = 600  # a job's whole life on a loaded 2-core machine (a start there takes ~1 min)

# Opt-in (-m slurm, after scripts/setup_slurm.sh): not yet seen passing end to end (the preemption
# run passed every check but the loss comparison, since fixed; the crash test has not run), and a
# job start takes minutes on a loaded 2-core machine. docs/known-gaps.md.
pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(why_not_available() is not None,
                                 reason=str(why_not_available()))]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(slurm, tmp, *overrides, env=None) -> str:
    """The job script with 2 tasks on the node (one torchrun agent of 1 rank each)."""
    tmp.mkdir(parents=True, exist_ok=True)
    args = [*TINY_MOCK, f"training.train_iters={ITERS}", "checkpoint.save_interval=null",
            f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.load=null",
            f"logging.metrics_file={tmp / 'metrics.jsonl'}", *overrides]
    done = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", "--ntasks-per-node=2",
         f"--output={tmp / 'slurm-%j.out'}", SBATCH, *args],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**slurm.env, "MASTER_PORT": str(_free_port()), "MCORE_EXT_SLURM_LOGS": str(tmp / "logs"),
             "MCORE_EXT_PYTHON": os.environ.get("MCORE_EXT_PYTHON", _python()), **(env or {})})
    return done.stdout.strip().split(";")[0]


def _python():
    import sys

    return sys.executable


def _job(slurm, job) -> dict[str, str]:
    text = slurm.scontrol("show", "job", "-o", job)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(slurm, job, states, condition=None):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        info = _job(slurm, job)
        if info.get("JobState") in states and (condition is None or condition(info)):
            return info
        time.sleep(1)
    subprocess.run(["scancel", job], env=slurm.env)
    raise AssertionError(f"job {job} not {states} after {TIMEOUT_S}s: {info}")


def _reference(tmp):
    return launch(*TINY_MOCK, f"training.train_iters={ITERS}", "checkpoint.save=null",
                  "checkpoint.load=null", f"logging.metrics_file={tmp}/reference.jsonl")


def test_preempted_job_saves_requeues_itself_resumes_and_completes(slurm, tmp_path,
                                                                   run_distributed):
    """SIGTERM to the batch shell mid-run (what #SBATCH --signal=B:TERM@120 delivers before the
    time limit): the ranks save at the next step, exit 16, the job requeues itself, its second
    start resumes from that step, the losses are an uninterrupted run's, the job COMPLETED."""
    tmp = tmp_path / "preempted"
    job = _submit(slurm, tmp)
    metrics = tmp / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and _job(slurm, job)["JobState"] in (
            "PENDING", "RUNNING"), (_job(slurm, job), (tmp / f"slurm-{job}.out").read_text())
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm.env, check=True)

    info = _wait(slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    out = (tmp / f"slurm-{job}.out").read_text()
    first = (tmp / "logs" / job / "restart0.log").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out, first[-3000:])
    stop = int(re.search(r"\[train\] stopping at iteration (\d+) \(SIGTERM received\)",
                         first).group(1))
    assert 2 <= stop < ITERS
    assert f"[checkpoint] saved iteration {stop} " in first
    assert "saved, not finished (exit code 16): requeued" in out and "restart 1: finished" in out
    second = (tmp / "logs" / job / "restart1.log").read_text()
    assert f"resumed from {tmp / 'ckpt' / f'iter_{stop:07d}'} (iteration {stop})" in second

    reference = run_distributed(_reference, str(tmp), world_size=2)
    assert reference[0]["code"] == 0, reference[0]
    expected = losses(tmp / "reference.jsonl")
    # The second start goes on from stop + 1: one attempt in the metrics file, no step twice.
    (logged,) = attempts(metrics)
    assert sorted(logged) == list(range(1, ITERS + 1))
    assert len(losses(metrics)) == len(metrics.read_text().splitlines()) == ITERS
    assert_exact({it: loss for it, loss in logged.items() if it <= stop}, expected)
    assert_exact({it: loss for it, loss in logged.items() if it > stop}, expected)


def test_crashing_job_reads_failed_and_is_not_requeued(slurm, tmp_path):
    """Rank 1 SIGKILLed in step 2: torchrun exits 1, the job script passes it on, the job is
    FAILED, never requeued."""
    tmp = tmp_path / "crash"
    job = _submit(slurm, tmp, env={"MCORE_EXT_KILL_AT": "step,2,1"})
    info = _wait(slurm, job, ("COMPLETED", "FAILED", "CANCELLED"))
    out = (tmp / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, out)
    assert info["ExitCode"] == "1:0", info
    assert "training exited with code 1" in out and "not requeued" in out, out
    assert "SIGKILL at step 2" in (tmp / "logs" / job / "restart0.log").read_text()
