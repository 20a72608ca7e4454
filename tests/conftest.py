import glob
import json
import os
import resource
import time

import pytest
import torch

from tests.distributed import WorkerPool

DEFAULT_TIMEOUT_S = 300
# A worker starts with ~6 threads; each gloo group still alive adds 3 (idle, one still polls).
# Past this many the pool is replaced: a few seconds to start one against CPU for the rest of the run.
MAX_POOL_THREADS = 40


@pytest.fixture(scope="session")
def _worker_pools():
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def run_distributed_shared(_worker_pools):
    """``run_distributed`` for module- and session-scoped fixtures (e.g. a checkpoint that several
    tests read)."""

    def run(fn, *args, world_size: int, timeout: float = DEFAULT_TIMEOUT_S,
            replace_pool_after: bool = False, **kwargs):
        """``replace_pool_after``: ``fn`` may leave point-to-point ops unwaited on the default
        group (it provokes an error inside megatron's isend / irecv exchange): the workers are
        replaced after it, or the next exchange on that group hangs (tests/distributed.py)."""
        pool = _worker_pools.get(world_size)
        if pool is None or not pool.alive:
            pool = _worker_pools[world_size] = WorkerPool(world_size)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            if replace_pool_after or pool.threads > MAX_POOL_THREADS:
                pool.close()

    return run


@pytest.fixture
def run_distributed(run_distributed_shared):
    """``run_distributed(fn, *args, world_size=N, timeout=..., **kwargs)`` -> per-rank results.

    ``fn`` must be a module-level function; it runs on N gloo ranks (workers reused across tests).
    """
    return run_distributed_shared


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs CUDA, none is available here")
    for item in items:
        # The marker itself: item.keywords also holds the names of parent folders (a checkout
        # in a folder named gpu would skip every test).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ------------------------------------------------------------------------- CPU time per test
#
# MCORE_EXT_TEST_CPU_LOG=FILE: one JSON line per test with its wall time and the CPU time it used
# in this process, in the processes it started and waited for (torchrun, subprocesses) and in
# the gloo worker pools. CPU time, unlike wall time, hardly depends on what else the machine runs,
# so a loaded machine still tells which tests cost CI its minutes.


def _pool_cpu_s() -> float:
    """CPU seconds of this process's live children (the worker pools are never waited for)."""
    ticks, me = 0, str(os.getpid())
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_s() -> float:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + _pool_cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get("MCORE_EXT_TEST_CPU_LOG")
    if not log:
        yield
        return
    wall, cpu = time.monotonic(), _cpu_s()
    yield
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
              "cpu_s": round(_cpu_s() - cpu, 2)}
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
