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

    def run(fn, *args, world_size: int, timeout: float = DEFAULT_TIMEOUT_S, **kwargs):
        pool = _worker_pools.get(world_size)
        if pool is None or not pool.alive:
            pool = _worker_pools[world_size] = WorkerPool(world_size)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            if pool.threads > MAX_POOL_THREADS:
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
