"""``optimizer.type=muon`` with ``optimizer.use_distributed_optimizer=true``: megatron's
layer-wise distributed optimizer (whole parameters per DP rank, Megatron-LM's ``--optimizer muon
--use-distributed-optimizer --no-use-layer-wise-param-layout``), on 2 gloo ranks at DP 2 in the
test's processes (tests/functional/inprocess.py).

One step of the tiny gated config equals the non-distributed Muon's step (fp32, 1e-6), each rank
holding optimizer state for its share of the parameters only; a run saved at iteration 3 resumes
to 6 bit for bit (dist checkpoint; fp32 and bf16), and not at another layout.
"""

import shutil
import types

import pytest
import torch

from tests.functional.inprocess import TINY_MOCK, launch
from tests.functional.test_pretrain import (  # noqa: F401 (stdlib_prefix: a fixture)
    TRACKER, check_exact_resume, gated_qkv, stdlib_prefix)

DP2 = ["parallelism.tensor_model_parallel_size=1"]  # the tiny config is TP 2
MUON = ["optimizer.type=muon", "optimizer.lr=0.01"]
LAYER_WISE = "optimizer.use_distributed_optimizer=true"
_seen = {}  # what the last run's trainer held after training, on this rank


def _skip_without_muon():
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_muon():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no Muon")


def _optimizer_state_owners(optimizer) -> set:
    """The parameters ``optimizer`` (megatron's, chained or not) holds state for on this rank."""
    owners, stack = set(), [optimizer]
    while stack:
        opt = stack.pop()
        if hasattr(opt, "chained_optimizers"):
            stack += opt.chained_optimizers
        else:  # FP32Optimizer / Float16OptimizerWithFloat16Params over a torch optimizer
            owners |= {id(p) for p, state in opt.optimizer.state.items() if state}
    return owners


def _one_step(distributed: bool) -> dict:
    """One Muon step of the tiny gated config at DP 2 (fp32): this rank's parameters after it and
    the names of those it holds optimizer state for."""
    from mcore_ext.training import loop

    class Seen(loop._Trainer):
        def run(self):
            finished = super().run()
            named = list(self.model.named_parameters())
            owners = _optimizer_state_owners(self.optimizer)
            _seen.update(params={n: p.detach().clone() for n, p in named},
                         owners={n for n, p in named if id(p) in owners})
            return finished

    trainer, loop._Trainer = loop._Trainer, Seen
    try:
        result = launch(*TINY_MOCK, *DP2, *MUON, "training.train_iters=1", "checkpoint.save=null",
                        "checkpoint.load=null", *([LAYER_WISE] if distributed else []))
    finally:
        loop._Trainer = trainer
    assert result["code"] == 0, result
    return dict(_seen)


def _steps_with_and_without():
    return _one_step(False), _one_step(True)


def test_layer_wise_step_equals_muon_and_shards_state(run_distributed):
    """The layer-wise distributed optimizer's step is the non-distributed Muon's (fp32, 1e-6) and
    its state is split across the DP ranks: disjoint shares, together every trained parameter,
    where the non-distributed optimizer holds all of them on every rank."""
    _skip_without_muon()
    ranks = run_distributed(_steps_with_and_without, world_size=2, timeout=300)
    (plain0, layer_wise0), (plain1, layer_wise1) = ranks
    names = set(plain0["params"])
    for plain, layer_wise in ranks:
        assert set(layer_wise["params"]) == names
        for name in names:
            torch.testing.assert_close(layer_wise["params"][name], plain["params"][name],
                                       atol=1e-6, rtol=0, msg=name)
        assert plain["owners"] == names  # every rank holds all the state
    share0, share1 = layer_wise0["owners"], layer_wise1["owners"]
    assert share0 and share1 and not share0 & share1, (share0, share1)
    assert share0 | share1 == names, names - (share0 | share1)
    gated_qkv = [n for n in names if n.endswith("self_attention.linear_qkv.weight")]
    assert gated_qkv and set(gated_qkv) <= share0 | share1


# On the tiny config's stdlib text (mock tokens are random: their loss does not fall).
RESUME = [*[a for a in TINY_MOCK if a != "data.source=mock"], *DP2, *MUON, LAYER_WISE,
          "training.train_iters=6", "checkpoint.save_interval=3", "optimizer.lr_warmup_iters=2"]


def _saved_and_resumed(tmp, data, precision):
    """``full`` 6 steps saving at 3 and 6, ``resumed`` from a copy of its iteration 3,
    ``other_layout`` from full's iteration 6 at TP 2 x DP 1."""
    import torch.distributed as dist

    data = [f"data.prefix={data}", f"training.precision={precision}"]
    full = launch(*RESUME, *data, f"checkpoint.save={tmp / 'full'}", "checkpoint.load=null",
                  f"logging.metrics_file={tmp / 'full.jsonl'}")
    if full["code"]:
        return full, None, None
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "full" / "iter_0000003", tmp / "resumed" / "iter_0000003")
        (tmp / "resumed" / TRACKER).write_text("3")
    dist.barrier()
    resumed = launch(*RESUME, *data, f"checkpoint.load={tmp / 'resumed'}", "checkpoint.save=null",
                     f"logging.metrics_file={tmp / 'resumed.jsonl'}")
    other_layout = launch(*RESUME, *data, "parallelism.tensor_model_parallel_size=2",
                          f"checkpoint.load={tmp / 'full'}", "checkpoint.save=null")
    return full, resumed, other_layout


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_layer_wise_run_saves_and_resumes_exactly(run_distributed, tmp_path, stdlib_prefix,
                                                  precision):
    """A DP 2 run on the layer-wise distributed optimizer saved at iteration 3 resumes to 6 with
    the uninterrupted run's losses to the last bit: each rank's Muon momentum and Adam moments
    (its share; in bf16 with its fp32 main copies, megatron's own wrapping) are in the dist
    checkpoint."""
    _skip_without_muon()
    full, resumed, other_layout = run_distributed(_saved_and_resumed, tmp_path, stdlib_prefix,
                                                  precision, world_size=2, timeout=300)[0]
    assert full["code"] == 0 and resumed and resumed["code"] == 0, (full, resumed)
    check_exact_resume(tmp_path, types.SimpleNamespace(**resumed), steps=6, saved_at=3)
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp_path / "full" / "iter_0000003"))
               .read_metadata().state_dict_metadata)
    layer = gated_qkv(keys)
    assert {f"optimizer.state.momentum_buffer.{layer}.weight._qkv",
            f"optimizer.state.momentum_buffer.{layer}.weight._gate",
            "optimizer.state.exp_avg.embedding.word_embeddings.weight"} <= keys, sorted(keys)
    # megatron's layer-wise state resumes at the layout it was saved at only: TP 2 x DP 1 is
    # refused, one line, naming both layouts.
    assert other_layout["code"] == 2, other_layout
    error = other_layout["stderr"].strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert "layer-wise" in error and "'dp': 2" in error and "'dp': 1" in error, error
