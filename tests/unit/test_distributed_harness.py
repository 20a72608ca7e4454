"""The multi-process harness itself: failures and hangs must surface as test failures."""

import pytest

from tests.distributed import DistributedTestFailure


def _rank_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()  # rank 0 waits in a collective that rank 1 never joins


def _sleep(seconds):
    import time

    time.sleep(seconds)


def test_ranks_run_a_real_collective(run_distributed):
    assert run_distributed(_rank_sum, world_size=4) == [(r, 10.0) for r in range(4)]


def test_failing_rank_traceback_is_reported(run_distributed):
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1.*boom on rank one"):
        run_distributed(_fail_on_rank_one, world_size=2, timeout=60)
    assert run_distributed(_rank_sum, world_size=2) == [(0, 3.0), (1, 3.0)]  # pool recovers


def test_hang_fails_with_timeout(run_distributed):
    with pytest.raises(DistributedTestFailure, match="did not finish within 3s"):
        run_distributed(_sleep, 120, world_size=2, timeout=3)
    assert run_distributed(_rank_sum, world_size=2) == [(0, 3.0), (1, 3.0)]


_KEPT_GROUPS = []


def _keep_groups_alive(count):
    """Groups that a test leaves referenced (destroyed or not, their gloo threads live on)."""
    import os

    import torch.distributed as dist

    _KEPT_GROUPS.extend(dist.new_group([0, 1]) for _ in range(count))
    return os.getpid()


def _pid():
    import os

    return os.getpid()


def test_a_pool_whose_workers_accumulate_threads_is_replaced(run_distributed):
    from tests.conftest import MAX_POOL_THREADS

    before = run_distributed(_pid, world_size=2)
    assert run_distributed(_keep_groups_alive, 2, world_size=2) == before  # a few: kept
    run_distributed(_keep_groups_alive, MAX_POOL_THREADS // 3, world_size=2)
    after = run_distributed(_pid, world_size=2)
    assert set(after).isdisjoint(before), (before, after)
    assert run_distributed(_rank_sum, world_size=2) == [(0, 3.0), (1, 3.0)]
