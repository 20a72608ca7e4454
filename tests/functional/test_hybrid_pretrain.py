"""The launcher with ``model.architecture=hybrid`` (megatron's HybridModel, issue 36): the tiny
gated config at TP 2 on 2 gloo ranks trains, and resumes exactly from its checkpoint.

Two torchrun runs (about 40-60 s on 2 loaded cores): ``full`` runs 8 steps saving at 4 and 8;
``resumed`` starts from a copy of ``full``'s iteration 4 (the only one its save directory
tracks) and runs to 8. Same layout, weights, optimizer state, data position and RNG: steps 5-8
must give the same floats.
"""

import shutil

import pytest

from tests.functional.test_pretrain import (  # noqa: F401 (stdlib_prefix: a fixture)
    TINY, TRACKER, check, losses, stdlib_prefix, torchrun)

SMALL = ["model.seq_length=64", "training.micro_batch_size=4", "training.global_batch_size=8",
         "training.eval_interval=100", "logging.log_interval=1",
         "optimizer.lr_warmup_iters=2"]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, stdlib_prefix):
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_hybrid_model():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no HybridModel")
    tmp = tmp_path_factory.mktemp("hybrid")
    common = ["--config", TINY, f"data.prefix={stdlib_prefix}", "model.architecture=hybrid",
              *SMALL, "training.train_iters=8", "checkpoint.save_interval=4"]
    full = check(torchrun(*common, f"checkpoint.save={tmp / 'full'}",
                          f"checkpoint.load={tmp / 'full'}",
                          f"logging.metrics_file={tmp / 'full.jsonl'}"), "full")
    shutil.copytree(tmp / "full" / "iter_0000004", tmp / "resumed" / "iter_0000004")
    (tmp / "resumed" / TRACKER).write_text("4")
    resumed = check(torchrun(*common, f"checkpoint.save={tmp / 'resumed'}",
                             f"checkpoint.load={tmp / 'resumed'}",
                             f"logging.metrics_file={tmp / 'resumed.jsonl'}"), "resumed")
    return dict(tmp=tmp, full=full, resumed=resumed)


def test_hybrid_run_trains_and_resumes_exactly(hybrid_runs):
    tmp = hybrid_runs["tmp"]
    full, resumed = losses(tmp / "full.jsonl"), losses(tmp / "resumed.jsonl")
    assert sorted(full) == list(range(1, 9)) and sorted(resumed) == list(range(5, 9))
    assert full[8] < 0.8 * full[1], full
    assert [resumed[step] for step in range(5, 9)] == [full[step] for step in range(5, 9)]
    assert "resumed from" in hybrid_runs["resumed"].stdout
    assert "GPTModel" not in hybrid_runs["full"].stdout + hybrid_runs["full"].stderr
    # The checkpoint holds HybridModel's layers: GPT layer 2's MLP is hybrid layer 4.
    saved = (tmp / "full" / "iter_0000008" / ".metadata").read_bytes()
    assert b"decoder.layers.3.mlp.linear_fc1.weight" in saved
