import pytest
import torch

from tests.distributed import WorkerPool

DEFAULT_TIMEOUT_S = 300


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
        return pool.run(fn, *args, timeout=timeout, **kwargs)

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
