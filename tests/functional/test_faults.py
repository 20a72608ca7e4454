"""Faults end to end: torchrun, 2 gloo ranks, the tiny gated config (4 min on 2 shared cores).

Every run is a real torchrun started in a session of its own, with a marker in its environment
that torchrun passes to its workers and they pass to any helper process: after torchrun returns,
no process may carry the marker or belong to the session. (torchrun starts each worker in a new
session, so the session alone would not find them.)

Kills are real SIGKILLs, sent by the rank to itself at a named point (``MCORE_EXT_KILL_AT``,
``mcore_ext/training/faults.py``): in the first data build, in a training step between backward
and the optimizer step, in an evaluation, and in a checkpoint save after the rank wrote its files.
Which rank dies at which point, and at which iteration, is drawn from ``MCORE_EXT_FAULT_SEED``
(default 12), so that both ranks die across the tests and a failure reproduces with the seed.

Stop signals (``checkpoint.exit_on_signal``) come from the test or from a rank at a named point
(``MCORE_EXT_SIGNAL_AT``), to ``python -m mcore_ext.torchrun`` (which passes them on) or to one
rank, at every moment from the agent's start to after the last step.

All runs span ``train_iters=400`` (so the data order and schedule are the same whatever the
interruption) and stop at 16 by ``exit_interval``, checkpointing and evaluating every 4 steps;
every resumed run must reproduce the uninterrupted run's losses exactly.
"""

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.functional.test_pretrain import LAUNCHER, ROOT, TINY, TRACKER, _free_port


SEED = int(os.environ.get("MCORE_EXT_FAULT_SEED", "12"))
COMMON = [
    "--config", TINY, "training.train_iters=400", "training.exit_interval=16",
    "checkpoint.save_interval=4", "training.eval_interval=4", "training.eval_iters=1",
    "logging.log_interval=1",
]
MARKER = "MCORE_EXT_TEST_RUN"
TIMEOUT_S = 300


def _draw_kills(seed):
    """{point: (rank, iteration)}: each rank dies at two of the four points."""
    rng = random.Random(seed)
    ranks = [0, 0, 1, 1]
    rng.shuffle(ranks)
    iterations = {
        "data": "*",  # before the first step
        "step": rng.randint(5, 15),  # mid-step: the checkpoint before it is the latest
        "eval": rng.choice([8, 12]),  # evaluation runs before the save of the same iteration
        "save": rng.choice([8, 12]),
    }
    return {point: (rank, iterations[point]) for point, rank in zip(iterations, ranks)}


KILLS = _draw_kills(SEED)


def _latest_before(point, iteration):
    """The latest complete checkpoint when a rank dies at ``point`` of ``iteration``."""
    if point == "data":
        return None
    if point == "step":
        return 4 * ((iteration - 1) // 4)
    return iteration - 4  # eval and save at a multiple of 4: that iteration's save is not done


class Run:
    """One torchrun of the launcher, started in a new session, output in <tmp>/<name>.out/.err."""

    def __init__(self, tmp, name, *overrides, torchrun_args=(), env=None, data=None,
                 preexec_fn=None, script=LAUNCHER, agent=("-m", "torch.distributed.run")):
        self.tmp, self.name = Path(tmp), name
        self.marker = f"{name}-{uuid.uuid4().hex}"
        self.metrics = self.tmp / f"{name}.jsonl"
        command = [
            sys.executable, *agent, "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *torchrun_args,
            script, *COMMON, f"data.prefix={data}", f"logging.metrics_file={self.metrics}",
            *overrides,
        ]
        self.out, self.err = self.tmp / f"{name}.out", self.tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", MARKER: self.marker, **(env or {})},
                preexec_fn=preexec_fn,
            )

    def wait(self):
        try:
            self.proc.wait(TIMEOUT_S)
        finally:
            if self.proc.poll() is None:
                self.kill_all()
        self.stdout, self.stderr = self.out.read_text(), self.err.read_text()
        return self.proc.returncode

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process of this run (marker or session)."""
        found = {}
        tag = f"{MARKER}={self.marker}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                ours = os.getsid(pid) == self.proc.pid
                if not ours:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        ours = tag in f.read().split(b"\0")
                if ours and _state(pid) != "Z":
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        found[pid] = f.read().replace(b"\0", b" ").decode()[:200]
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return found

    def leftovers(self, grace_s=10.0) -> dict[int, str]:
        """Processes of the run still alive ``grace_s`` after it ended (then killed)."""
        deadline = time.monotonic() + grace_s
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            self.kill_all()
        return left

    def kill_all(self):
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def rank_pid(self, rank) -> int:
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and _parent(pid) == self.proc.pid:
                return pid
        raise AssertionError(f"rank {rank} of {self.name} is not running")

    def check(self, returncode=0):
        assert self.wait() == returncode, (
            f"{self.name}: exit {self.proc.returncode}\n"
            f"{self.stdout[-3000:]}\n{self.stderr[-5000:]}"
        )
        assert self.leftovers() == {}, f"{self.name} left processes behind"
        return self


def _state(pid) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _parent(pid) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def attempts(metrics) -> list[dict[int, float]]:
    """Train losses per attempt: a new attempt starts where the iteration goes back."""
    runs = []
    lines = Path(metrics).read_text().splitlines() if Path(metrics).exists() else []
    for line in lines:
        record = json.loads(line)
        if record["kind"] != "train":
            continue
        if not runs or record["iteration"] <= max(runs[-1]):
            runs.append({})
        runs[-1][record["iteration"]] = record["loss"]
    return runs


def tracker(root) -> str | None:
    path = Path(root) / TRACKER
    return path.read_text() if path.exists() else None


def assert_exact(losses, reference):
    assert losses, "no training steps"
    assert {it: reference[it] for it in losses} == losses


def wait_for(condition, run, what, timeout_s=TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.proc.poll() is None, (
            f"{run.name} ended before {what}: {run.err.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def faults_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(faults_tmp):
    """The uninterrupted run: losses of steps 1..16 (it also builds the shared dataset)."""
    data = faults_tmp / "data" / "stdlib_byte"
    ckpt = faults_tmp / "reference"
    run = Run(faults_tmp, "reference", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
              data=data).check()
    (losses,) = attempts(run.metrics)
    assert sorted(losses) == list(range(1, 17))
    return {"losses": losses, "data": data, "ckpt": ckpt}


@pytest.mark.parametrize("point", [pytest.param("data", marks=pytest.mark.slow), "save"])
def test_sigkill_then_relaunch_resumes_exactly(faults_tmp, reference, point):
    """Kill, then the same command again: nothing left behind, the resume is exact."""
    rank, iteration = KILLS[point]
    tmp = faults_tmp / f"kill_{point}"
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    # The first data build needs data that does not exist yet; the other points share it.
    data = tmp / "data" / "stdlib_byte" if point == "data" else reference["data"]
    args = (f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}")
    killed = Run(tmp, "killed", *args, data=data,
                 env={"MCORE_EXT_KILL_AT": f"{point},{iteration},{rank}"})
    killed.check(returncode=1)
    assert f"rank {rank}: SIGKILL at {point}" in killed.stderr
    latest = _latest_before(point, iteration)
    expected = None if latest is None else str(latest)
    assert tracker(ckpt) == expected, (KILLS, killed.stdout[-2000:])

    again = Run(tmp, "again", *args, data=data).check()
    losses = attempts(killed.metrics) + attempts(again.metrics)
    if latest is None:
        assert "resumed from" not in again.stdout
    else:
        assert f"resumed from {ckpt / f'iter_{latest:07d}'} (iteration {latest})" in again.stdout
    assert sorted(losses[-1]) == list(range((latest or 0) + 1, 17))
    for attempt in losses:
        assert_exact(attempt, reference["losses"])
    assert tracker(ckpt) == "16"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["step", "eval"])
def test_max_restarts_resumes_by_itself(faults_tmp, reference, point):
    """``torchrun --max-restarts=1`` and one kill: one command finishes the run with the
    uninterrupted losses; checkpoint.load is unset, the restart resumes from checkpoint.save."""
    rank, iteration = KILLS[point]
    tmp = faults_tmp / f"restart_{point}"
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    run = Run(tmp, "run", f"checkpoint.save={ckpt}", "checkpoint.load=null",
              torchrun_args=["--max-restarts=1"], data=reference["data"],
              env={"MCORE_EXT_KILL_AT": f"{point},{iteration},{rank}"}).check()
    assert f"rank {rank}: SIGKILL at {point} {iteration}" in run.stderr
    latest = _latest_before(point, iteration)
    assert f"resumed from {ckpt / f'iter_{latest:07d}'} (iteration {latest})" in run.stdout
    first, second = attempts(run.metrics)
    # A step killed before its optimizer step is not logged; an evaluation follows its step.
    assert max(first) == (iteration - 1 if point == "step" else iteration)
    assert sorted(second) == list(range(latest + 1, 17))
    assert_exact(first, reference["losses"])
    assert_exact(second, reference["losses"])
    assert tracker(ckpt) == "16"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank", "torchrun", "torchrun_and_ranks"])
def test_sigterm_with_exit_on_signal_saves_and_exits_16(faults_tmp, reference, target):
    """Preemption: SIGTERM to one rank, to torchrun (which forwards it to every rank), or to
    torchrun and every rank at once (SLURM: each rank then gets two SIGTERMs milliseconds apart,
    which must not count as an operator's second signal). The ranks skip the evaluation due at
    that step (evaluating every step here), save, exit 16 ("saved, not finished"), and the
    checkpoint resumes exactly."""
    rank = random.Random(SEED).choice([0, 1])
    tmp = faults_tmp / f"sigterm_{target}"
    tmp.mkdir()
    ckpt, resumed = tmp / "ckpt", tmp / "resumed"
    run = Run(tmp, "preempted", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
              "checkpoint.exit_on_signal=true", "training.exit_interval=null",
              "checkpoint.save_interval=null", "training.eval_interval=1",
              data=reference["data"])
    wait_for(lambda: run.metrics.exists() and len(run.metrics.read_text().splitlines()) >= 4,
             run, "step 2")
    pids = {
        "rank": [run.rank_pid(rank)],
        "torchrun": [run.proc.pid],
        "torchrun_and_ranks": [run.proc.pid, run.rank_pid(0), run.rank_pid(1)],
    }[target]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    returncode = run.wait()
    # Plain torchrun reports the ranks' 16 as a failure, or ends with its own SignalException,
    # exit 1 either way (python -m mcore_ext.torchrun: 16, tests/functional/test_slurm.py).
    assert returncode == 1, run.stderr[-3000:]
    if target == "rank":
        assert "exitcode: 16" in run.stderr, run.stderr[-3000:]
    assert run.leftovers() == {}, f"{run.name} left processes behind"
    (first,) = attempts(run.metrics)
    stop = max(first)
    assert 2 <= stop < 16, stop
    assert f"[train] stopping at iteration {stop} (SIGTERM received)" in run.stdout, (
        run.stdout[-2000:], run.stderr[-3000:])
    assert f"[valid] iteration {stop - 1} |" in run.stdout  # evaluating every step ...
    assert f"[valid] iteration {stop} |" not in run.stdout  # ... but not when stopping
    assert tracker(ckpt) == str(stop) and sorted(os.listdir(ckpt)) == [f"iter_{stop:07d}", TRACKER]
    assert_exact(first, reference["losses"])

    again = Run(tmp, "resumed", f"checkpoint.load={ckpt}", f"checkpoint.save={resumed}",
                data=reference["data"]).check()
    (second,) = attempts(again.metrics)
    assert sorted(second) == list(range(stop + 1, 17))
    assert_exact(second, reference["losses"])


MODULE_AGENT = ("-m", "mcore_ext.torchrun")
SCRIPT_AGENT = (str(ROOT / "launch" / "torchrun.py"),)  # the job scripts' agent (launch/slurm)

# A stop signal from the agent's start to after the last step (checkpoint.exit_on_signal): where
# it comes (the agent, "at": MCORE_EXT_SIGNAL_AT, or "when": the test), the exit code, and how
# far the run got: "before" the first step (nothing to save), or the iteration it stopped at.
STOPS = {
    # SIGTERM to the job scripts' agent as soon as it holds the signals: before its workers exist.
    "agent_start": dict(agent=SCRIPT_AGENT, when="agent holds", code=16, stop="before"),
    # The case: SIGTERM to python -m mcore_ext.torchrun 1 s after its workers started
    # (importing torch and megatron: they hold the signals until main takes them over).
    "imports": dict(when="workers + 1 s", code=16, stop="before"),
    "config": dict(at="config,*,0", code=16, stop="before"),  # validation (chat tokenization)
    # Rank 1 alone, before the process group exists: every rank stops all the same.
    "rendezvous": dict(at="rendezvous,*,1,SIGTERM,self", code=16, stop="before"),
    "data": dict(at="data,*,0", code=16, stop="before"),  # during the stdlib dataset's build
    # A resumed run (iteration 8), rank 1 alone while loading: 8 stays the latest.
    "load": dict(at="load,*,1,SIGUSR2,self", code=16, stop="before"),
    # SIGUSR1 (Slurm's --signal=B:USR1@120) during the first save (iteration 1): saves the next.
    "first_save": dict(at="save,1,1,SIGUSR1", code=16, stop="after 1"),
    # In the last step (training.exit_interval=16) and during the last save: finished, exit 0.
    "last_step": dict(at="step,16,0", code=0, stop=16),
    "last_save": dict(at="save,16,1", code=0, stop=16),
}


def _blocks_sigterm(pid) -> bool:
    with open(f"/proc/{pid}/status") as f:
        blocked = next(line for line in f if line.startswith("SigBlk:")).split()[1]
    return bool(int(blocked, 16) & (1 << (signal.SIGTERM - 1)))


def _workers(run) -> list[int]:
    return [pid for pid, command in run.processes().items()
            if f"-u {LAUNCHER}" in command and _parent(pid) == run.proc.pid]


# The default run holds the earliest point (the agent's start: its hold, the signal passed on to
# workers as they start, theirs until main) and a save with SIGUSR1 (forwarded, one rank's
# request, the next step saved); the other points are the same handler at later moments (slow).
@pytest.mark.parametrize("point", [p if p in ("agent_start", "first_save") else
                                   pytest.param(p, marks=pytest.mark.slow) for p in STOPS])
def test_a_stop_signal_from_the_agents_start_to_the_last_step_ends_in_16_or_0(
        faults_tmp, reference, point):
    """checkpoint.exit_on_signal, one stop signal at a point from the agent's start to after the
    last step: exit 16 (saved, or stopped before the first step with nothing to save: the
    checkpoint the start loaded, or none, is still the latest) or, the last step done, 0; no
    process left, the losses of the steps taken the uninterrupted run's. Before: a signal before
    the launcher's handler (installed after the process group) ended the workers (-15) and
    torchrun exited 1; SIGUSR1 ended every process (138)."""
    spec = STOPS[point]
    tmp = faults_tmp / f"stop_{point}"
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    data = tmp / "data" / "stdlib_byte" if point == "data" else reference["data"]
    overrides = [f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
                 "checkpoint.exit_on_signal=true"]
    if point == "first_save":
        overrides.append("checkpoint.save_interval=1")
    if point == "load":
        shutil.copytree(reference["ckpt"] / "iter_0000008", ckpt / "iter_0000008")
        (ckpt / TRACKER).write_text("8")
    env = {"MCORE_EXT_SIGNAL_AT": spec["at"]} if "at" in spec else None
    run = Run(tmp, "run", *overrides, data=data, env=env, agent=spec.get("agent", MODULE_AGENT))
    if spec.get("when") == "agent holds":
        wait_for(lambda: _blocks_sigterm(run.proc.pid), run, "the agent to hold SIGTERM")
        os.kill(run.proc.pid, signal.SIGTERM)
    elif spec.get("when") == "workers + 1 s":
        wait_for(lambda: len(_workers(run)) == 2, run, "the workers")
        time.sleep(1)
        os.kill(run.proc.pid, signal.SIGTERM)
    run.check(returncode=spec["code"])
    trained = attempts(run.metrics)
    name = {"load": "SIGUSR2", "first_save": "SIGUSR1"}.get(point, "SIGTERM")
    if spec["stop"] == "before":
        assert (f"[train] stopping before the first step ({name} received): nothing was "
                "trained" in run.stdout), (run.stdout[-2000:], run.stderr[-3000:])
        assert trained == []
        if point == "load":
            assert tracker(ckpt) == "8" and "iter_0000008" in os.listdir(ckpt)
        else:
            assert not ckpt.exists()  # nothing made: the next start is this one again
        if point == "data":
            assert (tmp / "data" / "stdlib_byte.idx").is_file()  # built: the next start reads it
        return
    (losses,) = trained
    if spec["stop"] == "after 1":  # the signal came in the save of 1: a later boundary stops
        match = re.search(rf"\[train\] stopping at iteration (\d+) \({name} received\)",
                          run.stdout)
        assert match, (run.stdout[-2000:], run.stderr[-3000:])
        stop = int(match.group(1))
        assert 2 <= stop < 16
    else:
        stop = spec["stop"]
    assert sorted(losses) == list(range(1, stop + 1)) and tracker(ckpt) == str(stop)
    assert_exact(losses, reference["losses"])


@pytest.mark.slow
def test_finetune_relaunch_resumes_the_runs_own_checkpoint(faults_tmp, reference):
    """checkpoint.load + finetune only start an empty run: killed mid-step 7 (its checkpoint at 4
    complete) and relaunched with the same command, the run resumes from checkpoint.save's step
    4 (weights, optimizer, schedule, data position) instead of the pretrained weights at 0."""
    rank = KILLS["step"][0]
    tmp = faults_tmp / "finetune"
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    args = (f"checkpoint.load={reference['ckpt']}", "checkpoint.finetune=true",
            f"checkpoint.save={ckpt}", "training.exit_interval=8")
    killed = Run(tmp, "killed", *args, data=reference["data"],
                 env={"MCORE_EXT_KILL_AT": f"step,7,{rank}"}).check(returncode=1)
    pretrained = reference["ckpt"] / "iter_0000016"
    assert f"finetune: loaded the model weights of {pretrained}; iteration 0" in killed.stdout
    assert tracker(ckpt) == "4"

    again = Run(tmp, "again", *args, data=reference["data"]).check()
    assert "finetune: loaded" not in again.stdout, again.stdout[-3000:]
    assert f"resumed from {ckpt / 'iter_0000004'} (iteration 4)" in again.stdout
    (first,), (second,) = attempts(killed.metrics), attempts(again.metrics)
    assert sorted(first) == list(range(1, 7)) and sorted(second) == list(range(5, 9))
    assert {it: second[it] for it in (5, 6)} == {it: first[it] for it in (5, 6)}
    assert tracker(ckpt) == "8"


RESAVE = str(Path(__file__).with_name("resave_tracked.py"))


def _tracked_at_4(tmp, reference):
    """A save directory in ``tmp`` tracking a copy of the reference run's iteration 4: (tmp, the
    save directory, its digest, the overrides that resume it and run to 8)."""
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    shutil.copytree(reference["ckpt"] / "iter_0000004", ckpt / "iter_0000004")
    (ckpt / TRACKER).write_text("4")
    args = (f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", "training.exit_interval=8")
    return tmp, ckpt, _tree_digest(ckpt / "iter_0000004"), args


def test_kill_inside_the_writer_while_resaving_the_tracked_iteration(faults_tmp, reference):
    """The tracked iteration (4) saved again with other weights, and rank 1 killed inside
    megatron's writer (``resave_tracked.py``): the tracked checkpoint keeps every byte, the
    killed save's partial directory is never loaded and is removed by the relaunch, which
    resumes from step 4 with the uninterrupted run's losses."""
    tmp, ckpt, before, args = _tracked_at_4(faults_tmp / "resave", reference)
    killed = Run(tmp, "killed", *args, data=reference["data"], script=RESAVE).check(returncode=1)
    assert "[resave] rank 1: writing with RLIMIT_FSIZE 0" in killed.stderr
    assert "Signal 25 (SIGXFSZ)" in killed.stderr, killed.stderr[-3000:]
    assert tracker(ckpt) == "4"
    assert _tree_digest(ckpt / "iter_0000004") == before, sorted(os.listdir(ckpt))
    partial = set(os.listdir(ckpt)) - {"iter_0000004", TRACKER}
    assert len(partial) == 1, partial  # the killed save's directory

    again = Run(tmp, "again", *args, data=reference["data"]).check()
    assert f"resumed from {ckpt / 'iter_0000004'} (iteration 4)" in again.stdout
    (losses,) = attempts(again.metrics)
    assert sorted(losses) == list(range(5, 9))
    assert_exact(losses, reference["losses"])
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000008", TRACKER]


def test_a_resave_killed_between_its_two_renames_is_put_back_by_the_relaunch(faults_tmp,
                                                                            reference):
    """The tracked iteration (4) saved again and rank 0 killed between the two renames
    (``resave_tracked.py``, RESAVE_KILL=renames): only ``.replaced.iter_0000004`` holds it, with
    every byte. The relaunch puts it back and resumes from step 4 with the uninterrupted run's
    losses (before: exit 2, 'latest_checkpointed_iteration.txt names iteration 4 but
    .../iter_0000004 does not exist', decided before the repair ran)."""
    tmp, ckpt, before, args = _tracked_at_4(faults_tmp / "between_renames", reference)
    killed = Run(tmp, "killed", *args, data=reference["data"], script=RESAVE,
                 env={"RESAVE_KILL": "renames"}).check(returncode=1)
    assert "[resave] rank 0: SIGKILL between the two renames" in killed.stderr
    assert sorted(os.listdir(ckpt)) == [".replaced.iter_0000004", ".saving.iter_0000004", TRACKER]
    assert _tree_digest(ckpt / ".replaced.iter_0000004") == before
    assert tracker(ckpt) == "4"

    again = Run(tmp, "again", *args, data=reference["data"]).check()
    assert f"restored {ckpt / 'iter_0000004'} (a write was killed replacing it)" in again.stdout
    assert f"resumed from {ckpt / 'iter_0000004'} (iteration 4)" in again.stdout
    (losses,) = attempts(again.metrics)
    assert sorted(losses) == list(range(5, 9))
    assert_exact(losses, reference["losses"])
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000008", TRACKER]


def test_sigkill_of_torchrun_takes_its_ranks_along(faults_tmp, reference):
    tmp = faults_tmp / "torchrun_killed"
    tmp.mkdir()
    run = Run(tmp, "run", f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.load=null",
              "training.exit_interval=null", data=reference["data"])
    wait_for(lambda: tracker(tmp / "ckpt") is not None, run, "the first checkpoint")
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait()
    # Without a parent-death signal the ranks would train on for 400 steps.
    assert run.leftovers(grace_s=15) == {}


def _without_dac_override():
    """preexec_fn: drop root's permission-bypass capabilities, so a 0o555 directory is read-only
    for the child as it is for any other user (a no-op when not root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: gone after exec


def _tree_digest(root) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(root).rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_read_only_save_directory_is_one_clear_error_on_every_rank(faults_tmp, reference):
    tmp = faults_tmp / "read_only"
    tmp.mkdir()
    ckpt = tmp / "ckpt"
    shutil.copytree(reference["ckpt"] / "iter_0000008", ckpt / "iter_0000008")
    (ckpt / TRACKER).write_text("8")
    before = _tree_digest(ckpt)
    for path in [ckpt, *ckpt.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        run = Run(tmp, "run", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
                  data=reference["data"], preexec_fn=_without_dac_override).check(returncode=1)
    finally:
        for path in [ckpt, *ckpt.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    for rank in (0, 1):
        message = (f"error: [rank {rank}] checkpoint.save={str(ckpt)!r} is not writable on rank 0 "
                   "(PermissionError: [Errno 13] Permission denied")
        assert message in run.stderr, run.stderr[-3000:]
    assert 'launch/pretrain.py", line' not in run.stderr  # no traceback from the ranks
    assert not run.metrics.exists()  # refused before training
    assert _tree_digest(ckpt) == before and tracker(ckpt) == "8"
