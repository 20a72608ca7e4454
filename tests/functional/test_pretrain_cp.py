"""The launcher with context parallelism: CP 2 trains like CP 1, and its checkpoints reshard.

fp32 runs of the tiny gated config at seq 64 (2 micro-batches of 4 per step at DP 1):

    cp1       CP 1 x DP 2, 10 steps
    cp2       CP 2, 10 steps, checkpoints at 5 and 10
    cp2_dp2   CP 2 x DP 2 (4 ranks), 10 steps
    cp1_from  CP 1 x DP 2 resuming cp2's step-5 checkpoint, to step 10
    tp2_cp2   TP 2 x CP 2 (4 ranks) resuming cp2's step-5 checkpoint, to step 10

Losses alone cannot show a wrong gradient scale: Adam is blind to a constant factor and clipping
normalises the update, so a gradient CP x too large trains to the same losses. The grad norms the
launcher logs every step (before clipping) are compared as well. Checked by hand: with the loss
divided by the local instead of the CP-wide token count (gradient x 2), CP 2's losses still
matched CP 1's within 4.8e-7, its grad norms were 2.00 x CP 1's.

megatron's dist_checkpointing treats CP ranks as data-parallel replicas, so the model and
optimizer state saved at CP 2 is a layout-free checkpoint. Measured on 2 busy CPU cores: CP 2 and
CP 2 x DP 2 vs CP 1 differ by at most 4.8e-7 in loss and 3.2e-7 (relative) in grad norm over 10
steps, the CP 1 and TP 2 x CP 2 resumes vs CP 2 by at most 3.6e-7 in loss (reduction order),
well inside the 1e-5 bounds.
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.functional.inprocess import completed, launch
from tests.functional.test_pretrain import TINY, TRACKER, check, losses

TOL = 1e-5


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, run_distributed_shared):
    """``cp_runs(name)`` -> the run's result; each run once, when a test first asks for it (the
    two resumes are opt-in, -m slow: the default run makes three of the five). Each is the
    launcher's ``main`` in the tests' gloo ranks, 2 or 4 (tests/functional/inprocess.py: no
    torchrun's imports per run; the launcher's torchrun path at CP 2: test_sft.py's recipe)."""
    tmp = tmp_path_factory.mktemp("pretrain_cp")
    common = [
        "--config", TINY, f"data.prefix={tmp / 'data' / 'stdlib_byte'}",
        "model.seq_length=64", "parallelism.tensor_model_parallel_size=1",
        "training.micro_batch_size=4", "training.global_batch_size=8",
        "training.train_iters=10", "training.eval_interval=null", "checkpoint.save_interval=5",
        "logging.log_interval=1", "optimizer.lr_warmup_iters=2",
    ]
    cp2 = "parallelism.context_parallel_size=2"
    layouts = {  # name: (overrides, ranks)
        "cp1": ([f"checkpoint.save={tmp / 'cp1'}", "checkpoint.load=null"], 2),
        "cp2": ([cp2, f"checkpoint.save={tmp / 'cp2'}", "checkpoint.load=null"], 2),
        "cp2_dp2": ([cp2, "checkpoint.save=null", "checkpoint.load=null"], 4),
        "cp1_from": ([], 2),
        "tp2_cp2": (["parallelism.tensor_model_parallel_size=2", cp2], 4),
    }
    done = {}

    def get(name):
        if name in done:
            return done[name]
        overrides, nproc = layouts[name]
        if name in ("cp1_from", "tp2_cp2"):  # resume cp2's step-5 checkpoint
            get("cp2")
            resumed = tmp / name
            shutil.copytree(tmp / "cp2" / "iter_0000005", resumed / "iter_0000005")
            (resumed / TRACKER).write_text("5")
            overrides = [*overrides, f"checkpoint.save={resumed}", f"checkpoint.load={resumed}",
                         "checkpoint.save_interval=null"]
        result = run_distributed_shared(
            launch, *common, f"logging.metrics_file={tmp / name}.jsonl", *overrides,
            world_size=nproc, timeout=600)[0]
        done[name] = check(completed(result), name)
        return done[name]

    get.tmp = tmp
    return get


def grad_norms(path) -> dict[int, float]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["grad_norm"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("name, layout", [("cp2", "TP 1 x CP 2 x PP 1 x DP 1"),
                                          ("cp2_dp2", "TP 1 x CP 2 x PP 1 x DP 2")])
def test_cp_losses_and_grad_norms_match_cp1(cp_runs, name, layout):
    """Per step, the loss and the (pre-clipping) grad norm of CP 2 equal CP 1's (abs 1e-5 and
    rel 1e-5: reduction order only)."""
    cp_runs("cp1"), cp_runs(name)
    cp1, cp = (losses(cp_runs.tmp / f"{n}.jsonl") for n in ("cp1", name))
    norms1, norms = (grad_norms(cp_runs.tmp / f"{n}.jsonl") for n in ("cp1", name))
    assert sorted(cp) == list(range(1, 11)) and cp[10] < cp[1] - 0.5, cp
    assert sorted(norms) == list(range(1, 11)) and min(norms.values()) > 0.01, norms
    for step in range(1, 11):
        assert cp[step] == pytest.approx(cp1[step], abs=TOL, rel=0), (step, cp, cp1)
        assert norms[step] == pytest.approx(norms1[step], rel=TOL), (step, norms, norms1)
    assert layout in cp_runs(name).stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp1_from", "tp2_cp2"])
def test_cp2_checkpoint_resumes_at_another_layout(cp_runs, name):
    cp_runs(name)
    cp2, resumed = (losses(cp_runs.tmp / f"{n}.jsonl") for n in ("cp2", name))
    assert sorted(resumed) == list(range(6, 11)), resumed
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(cp2[step], abs=TOL, rel=0), (step, resumed, cp2)
    assert "resumed from" in cp_runs(name).stdout
