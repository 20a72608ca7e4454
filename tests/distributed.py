"""Run test functions on N real gloo ranks, in worker processes started once per session.

Importing megatron costs seconds per process, so each world size gets one pool of spawned workers
that join a gloo process group once and then run test functions on request. A test function is a
module-level function (it is sent by module and name) that runs on every rank and may return a
picklable value; ``run`` returns the values of all ranks in rank order.

A failing rank's traceback becomes the test's failure. If a rank fails while others wait in a
collective, or any rank runs past the timeout, the pool is killed (and restarted for the next
test): a hang fails the test, never the whole run. A pool whose task failed on any rank is
replaced as well, and so is one whose task asks for it (``replace_pool_after``): a rank that
raised between posting point-to-point ops and waiting for them leaves them on the default group,
where they hang the next exchange between the same ranks.
"""

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
import warnings

# Seconds the other ranks get to finish after one rank has failed.
_GRACE_AFTER_FAILURE_S = 15.0


class DistributedTestFailure(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


class WorkerPool:
    """``world_size`` spawned processes in one gloo process group."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.log_dir = tempfile.mkdtemp(prefix=f"mcore_ext_ranks{world_size}_")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.processes = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, self.tasks[rank], self.results, self.log_dir),
                # Not daemonic: dist-checkpoint saving starts a process of its own. Orphans are
                # prevented by close() at exit and by workers watching their parent.
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        atexit.register(self.close)
        # The most threads a worker has had after a task: groups something still references keep
        # theirs (and poll while idle), so a pool that accumulates them is replaced (conftest).
        self.threads = 0

    def run(self, fn, *args, timeout: float, **kwargs) -> list:
        for task_queue in self.tasks:
            task_queue.put((fn.__module__, fn.__qualname__, args, kwargs))
        outcomes = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value, threads = self.results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                self.threads = max(self.threads, threads)
                if not ok:
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in outcomes]
            if dead or time.monotonic() > deadline:
                self.close()
                failures = _format_failures(outcomes)
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                reason = (
                    f"rank(s) {dead} died (exit codes {[self.processes[r].exitcode for r in dead]})"
                    if dead
                    else f"rank(s) {missing} did not finish within {timeout:.0f}s"
                )
                raise DistributedTestFailure(
                    f"{fn.__qualname__} on {self.world_size} ranks: {reason}; worker logs in "
                    f"{self.log_dir}\n{failures}"
                )
        if any(not ok for ok, _ in outcomes.values()):
            self.close()  # its groups may be mid-collective: the next test gets new workers
            raise DistributedTestFailure(
                f"{fn.__qualname__} failed on {self.world_size} ranks:\n{_format_failures(outcomes)}"
            )
        return [outcomes[rank][1] for rank in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def close(self):
        for task_queue in self.tasks:
            try:
                task_queue.put(None)
            except (ValueError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _format_failures(outcomes) -> str:
    return "\n".join(
        f"--- rank {rank} ---\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok
    )


def _worker_main(rank, world_size, port, tasks, results, log_dir):
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    warnings.simplefilter("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        # torch's flight recorder keeps the last ~2000 collectives (about 1 KB each, until full)
        # for hang dumps the pool's timeout makes unneeded; it would read as growing memory.
        TORCH_FR_BUFFER_SIZE="0",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state

    import mcore_ext

    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test session died: do not linger
                break
            continue
        if task is None:
            break
        module_name, qualname, args, kwargs = task
        try:
            fn = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            outcome = (True, fn(*args, **kwargs))
        except BaseException:
            outcome = (False, traceback.format_exc())
        try:
            _reset_process_wide_trackers()
            if parallel_state.model_parallel_is_initialized():
                mcore_ext.destroy_parallel()
            _destroy_groups_left_behind(dist)
        except BaseException:
            if outcome[0]:
                outcome = (False, traceback.format_exc())
        threads = len(os.listdir("/proc/self/task"))
        print(f"{qualname}: {threads} threads after", flush=True)
        results.put((rank, *outcome, threads))
    # Skip interpreter teardown (peers may already be gone), but first stop our own children:
    # dist-checkpoint saving leaves a multiprocessing Manager running.
    for child in mp.active_children():
        child.terminate()
    os._exit(0)


def _reset_process_wide_trackers() -> None:
    """megatron keeps the MTP and MoE losses a training forward records in process-wide trackers
    (as the launcher resets them for a second run in one process): the next task in this worker
    would read this one's values with its own."""
    from mcore_ext import _mcore_compat

    _mcore_compat.reset_mtp_losses()
    _mcore_compat.take_moe_aux_losses()  # zeroes them


def _destroy_groups_left_behind(dist) -> None:
    """Destroy the process groups a test made and left (all but the pool's own default group).

    Each gloo group keeps its own TCP loop thread, which wakes up even while idle: a worker that
    accumulated ~80 of them used a fifth of a core doing nothing, taken from every test after it.
    """
    import gc

    gc.collect()  # a group only unreferenced by a finished test is torn down with it
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
