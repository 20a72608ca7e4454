"""The multi-process harness itself: failures and hangs must surface as test failures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import DistributedTestFailure

ROOT = Path(__file__).resolve().parents[2]


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


def test_failing_rank_traceback_is_reported(run_distributed, monkeypatch):
    # Rank 0 waits in its barrier until the pool is killed: after the grace given to the other
    # ranks once one failed (15 s by default; nothing is left to finish here).
    monkeypatch.setattr("tests.distributed._GRACE_AFTER_FAILURE_S", 1.0)
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1.*boom on rank one"):
        run_distributed(_fail_on_rank_one, world_size=2, timeout=60)
    assert run_distributed(_rank_sum, world_size=2) == [(0, 3.0), (1, 3.0)]  # pool recovers


def _fail_on_rank_one_alone():
    import os

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    return os.getpid()  # rank 0 finishes: nothing hangs, the pool is alive


def test_a_pool_that_ran_a_failing_task_is_replaced(run_distributed):
    # A task that failed may have left its groups mid-collective: the next test gets new workers.
    before = run_distributed(_pid, world_size=2)
    with pytest.raises(DistributedTestFailure, match="boom on rank one"):
        run_distributed(_fail_on_rank_one_alone, world_size=2, timeout=60)
    after = run_distributed(_pid, world_size=2)
    assert set(after).isdisjoint(before), (before, after)


def _leave_point_to_point_ops():
    """What megatron's roll_tensor does when it raises between posting its isend / irecv and
    waiting for them: the ops are dropped, unwaited, on the default group."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.irecv(torch.empty(4), src=1)
    else:
        dist.isend(torch.ones(4), dst=0)


def _exchange():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    got = torch.empty(3)
    ops = [dist.irecv(got, src=1 - rank), dist.isend(torch.full((3,), float(rank)), dst=1 - rank)]
    for op in ops:
        op.wait()
    return got.tolist()


def test_a_task_that_leaves_point_to_point_ops_gets_its_pool_replaced(run_distributed):
    # Unwaited isend / irecv on the pool's default group hang the next point-to-point exchange
    # on it (both ranks wait in gloo's send forever: test_mtp's CP 2 test after test_sft_packed_
    # loss's MTP shift). A task that may leave them asks for new workers after it.
    run_distributed(_leave_point_to_point_ops, world_size=2, replace_pool_after=True)
    assert run_distributed(_exchange, world_size=2, timeout=60) == [[1.0] * 3, [0.0] * 3]


def _track_mtp_losses():
    """A task that trains an MTP model leaves its losses in megatron's process-wide tracker."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.update(values=torch.ones(2), loss_values=torch.ones(2))


def _tracked_mtp_losses():
    from mcore_ext import _mcore_compat

    return _mcore_compat.take_mtp_losses(2)


def test_the_next_task_finds_megatrons_mtp_loss_tracker_empty(run_distributed):
    # test_hybrid_mtp_packed compared its MTP losses 29 nats apart after test_mtp's tests had run
    # in the same workers: the first of its models read test_mtp's losses with its own.
    run_distributed(_track_mtp_losses, world_size=2)
    assert run_distributed(_tracked_mtp_losses, world_size=2) == [None, None]


# The harness's own timeout (21 s: the hung pool is replaced); pytest-timeout (900 s) still bounds
# every test in the default run
@pytest.mark.slow
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


_COST_TESTS = """
import subprocess, sys, time

def test_burns_cpu_in_a_child():
    subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(30_000_000): x += i"], check=True)

def test_sleeps():
    time.sleep(1.0)
"""


@pytest.mark.slow  # the suite's own cost log (docs/testing.md), not mcore_ext: out of CI's time
def test_cpu_log_records_what_each_test_costs(tmp_path):
    """MCORE_EXT_TEST_CPU_LOG (docs/testing.md): a child's CPU seconds count for the test that
    waited for it; a test that sleeps has wall time and next to no CPU time."""
    (tmp_path / "test_cost.py").write_text(_COST_TESTS)
    log = tmp_path / "cost.jsonl"
    result = subprocess.run(  # the project's conftest as a plugin, over tests outside tests/
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "test_cost.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MCORE_EXT_TEST_CPU_LOG": str(log), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = {r["test"].split("::")[-1]: r for r in map(json.loads, log.read_text().splitlines())}
    burn, sleep = records["test_burns_cpu_in_a_child"], records["test_sleeps"]
    assert burn["cpu_s"] > 0.5 and burn["cpu_s"] <= burn["wall_s"] * 2 + 0.5, burn
    assert sleep["wall_s"] >= 1.0 and sleep["cpu_s"] < 0.3, sleep
