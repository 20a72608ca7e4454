"""The launcher with ``optimizer.type=muon`` (megatron-core's Muon, Adam for the rest): the tiny
gated config at TP 2 on 2 gloo ranks trains, resumes exactly, and reshards to TP 1; the tiny
Step-3.5 MoE config (MTP included) at EP 2 trains and resumes exactly.

Three runs of the launcher's ``main`` in the tests' 2 gloo ranks (tests/functional/inprocess.py;
the launcher's torchrun path: test_pretrain.py), with ``muon_tp_mode=duplicated`` so that a
projection is orthogonalised whole at any TP: ``full`` runs 8 steps saving at 4 and 8;
``resumed`` starts from a copy of ``full``'s iteration 4 and runs to 8 at TP 2 (same floats);
``tp1`` does the same at TP 1 x DP 2 (same losses within 1e-4, as the Adam runs' TP change).
The MoE config at EP 2 the same way (no torchrun, no imports per run): ``full`` 6 steps saving at 3, ``resumed`` from 3, bit for bit,
routed experts' momentum in the expert-parallel optimizer, the router and the MTP head on Adam;
the same on megatron's layer-wise distributed optimizer (slow). A config error is one line and exit code 2.
"""

import re
import shutil
import types

import pytest

from tests.functional.test_pretrain import (  # noqa: F401 (stdlib_prefix: a fixture)
    ROOT, TINY, TRACKER, check_exact_resume, gated_qkv, launcher, losses, stdlib_prefix)

MOE_TINY = str(ROOT / "configs" / "step35_moe_tiny_cpu.yaml")

SMALL = ["model.seq_length=64", "training.micro_batch_size=4", "training.global_batch_size=8",
         "training.eval_interval=100", "logging.log_interval=1", "optimizer.lr_warmup_iters=2"]
MUON = ["optimizer.type=muon", "optimizer.muon_tp_mode=duplicated", "optimizer.lr=0.01"]


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory, stdlib_prefix, run_distributed_shared):
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_muon():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no Muon")
    tmp = tmp_path_factory.mktemp("muon")
    runs = run_distributed_shared(_muon_runs, tmp, stdlib_prefix, world_size=2, timeout=600)[0]
    for name, result in runs.items():
        assert result["code"] == 0, (name, result)
    return dict(tmp=tmp, **{name: types.SimpleNamespace(**result) for name, result in runs.items()})


def _muon_runs(tmp, data):
    """``full``, ``resumed`` and ``tp1`` in this rank's process (tests/functional/inprocess.py)."""
    import torch.distributed as dist

    from tests.functional.inprocess import launch

    common = ["--config", TINY, f"data.prefix={data}", *SMALL, *MUON,
              "training.train_iters=8", "checkpoint.save_interval=4"]
    runs = {"full": launch(*common, f"checkpoint.save={tmp / 'full'}",
                           f"checkpoint.load={tmp / 'full'}",
                           f"logging.metrics_file={tmp / 'full.jsonl'}")}
    for name, layout in (("resumed", []), ("tp1", ["parallelism.tensor_model_parallel_size=1"])):
        if dist.get_rank() == 0:
            shutil.copytree(tmp / "full" / "iter_0000004", tmp / name / "iter_0000004")
            (tmp / name / TRACKER).write_text("4")
        dist.barrier()
        runs[name] = launch(*common, *layout, f"checkpoint.save={tmp / name}",
                            f"checkpoint.load={tmp / name}",
                            f"logging.metrics_file={tmp / name}.jsonl")
    return runs


def test_muon_run_trains_and_resumes_exactly(muon_runs):
    tmp = muon_runs["tmp"]
    check_exact_resume(tmp, muon_runs["resumed"])
    # Muon's momentum is in the checkpoint, the gated linear_qkv's as its QKV and gate tensors
    # (TP-reshardable); Adam's moments for the embedding, norms and biases only.
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp / "full" / "iter_0000004"))
               .read_metadata().state_dict_metadata)
    layer = gated_qkv(keys)
    assert {f"optimizer.state.momentum_buffer.{layer}.weight._qkv",
            f"optimizer.state.momentum_buffer.{layer}.weight._gate",
            f"optimizer.state.exp_avg.{layer}.bias._gate",
            "optimizer.state.exp_avg.embedding.word_embeddings.weight"} <= keys
    assert not any(k.startswith("optimizer.state.exp_avg.") and k.endswith("linear_fc1.weight")
                   for k in keys)


def test_muon_state_reshards_tp2_to_tp1(muon_runs):
    tmp = muon_runs["tmp"]
    full, tp1 = losses(tmp / "full.jsonl"), losses(tmp / "tp1.jsonl")
    assert sorted(tp1) == list(range(5, 9))
    # fp32 at TP 1 against TP 2 sums in other orders, and Muon's Newton-Schulz iterations
    # amplify that: 1.6e-4 at step 7 measured on 2026-11-28 on this test's commit and on
    # ee5173b alike (where it had passed under 1e-4 before); a state resharded wrongly moves the
    # loss by tenths.
    for step in range(5, 9):
        assert tp1[step] == pytest.approx(full[step], abs=5e-4, rel=0), (step, tp1, full)
    assert "TP 1 x PP 1 x DP 2" in muon_runs["tp1"].stdout


MOE_MUON = ["--config", MOE_TINY, "parallelism.expert_model_parallel_size=2",
            # layer 1 dense, layer 2 MoE, the MTP depth (CPU seconds: 2 MoE layers fewer)
            "model.num_layers=2", "model.moe_layer_freq=[0,1]",
            "model.layer_types=[full_attention,sliding_attention,sliding_attention]",
            "model.swiglu_limits=[0,16.0,0]", "model.moe_expert_swiglu_limits=[0,7.0]",
            "model.seq_length=32", "training.micro_batch_size=2", "training.global_batch_size=4",
            "training.eval_interval=null", "logging.log_interval=1", *MUON,
            "optimizer.lr_warmup_iters=2", "training.train_iters=6", "checkpoint.save_interval=3"]


def _muon_moe_runs(tmp, data, distributed=False):
    """The MoE config at EP 2 in this rank's process (tests/functional/inprocess.py): ``full``
    6 steps saving at 3 and 6, ``resumed`` from a copy of its iteration 3; ``distributed``: on
    megatron's layer-wise distributed optimizer (the dense parameters' state split over DP 2)."""
    moe_muon = [*MOE_MUON, f"optimizer.use_distributed_optimizer={str(distributed).lower()}"]
    import torch.distributed as dist

    from tests.functional.inprocess import launch

    full = launch(*moe_muon, f"data.prefix={data}", f"checkpoint.save={tmp / 'full'}",
                  "checkpoint.load=null",
                  f"logging.metrics_file={tmp / 'full.jsonl'}")
    if full["code"]:
        return full, None
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "full" / "iter_0000003", tmp / "resumed" / "iter_0000003")
        (tmp / "resumed" / TRACKER).write_text("3")
    dist.barrier()
    resumed = launch(*moe_muon, f"data.prefix={data}", f"checkpoint.load={tmp / 'resumed'}",
                     "checkpoint.save=null",
                     f"logging.metrics_file={tmp / 'resumed.jsonl'}")
    return full, resumed


@pytest.mark.parametrize("distributed", [
    pytest.param(False, id="muon"),
    # 30 CPU s more; the default suite's layer-wise runs: tests/functional/test_muon_distributed.py
    pytest.param(True, id="layer_wise", marks=pytest.mark.slow),
])
def test_muon_moe_run_trains_and_resumes_exactly(run_distributed, tmp_path, stdlib_prefix,
                                                 distributed):
    """The tiny Step-3.5 MoE config (a dense and a MoE layer: 8 experts, a shared expert, the
    expert bias; one MTP depth) with Muon at EP 2 trains and resumes bit for bit; the checkpoint
    holds Muon's momentum for the experts and Adam's moments for the router and the MTP head.
    Also on megatron's layer-wise distributed optimizer (``use_distributed_optimizer``)."""
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_muon():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no Muon")
    full, resumed = run_distributed(_muon_moe_runs, tmp_path, stdlib_prefix, distributed,
                                    world_size=2, timeout=600)[0]
    assert full["code"] == 0 and resumed and resumed["code"] == 0, (full, resumed)
    assert "(experts: EP 2)" in full["stdout"], full["stdout"]
    check_exact_resume(tmp_path, types.SimpleNamespace(**resumed), steps=6, saved_at=3)
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp_path / "full" / "iter_0000003"))
               .read_metadata().state_dict_metadata)
    state = "optimizer.state"
    # The MoE layer (the first is dense): GPTModel's layer 1, HybridModel's layer 3.
    (mlp,) = [k.removesuffix(".router.weight") for k in keys
              if re.fullmatch(r"decoder\.layers\.\d+\.mlp\.router\.weight", k)]
    assert {f"{state}.momentum_buffer.{mlp}.experts.experts.linear_fc1.weight",
            f"{state}.momentum_buffer.{mlp}.experts.experts.linear_fc2.weight",
            f"{state}.momentum_buffer.{mlp}.shared_experts.linear_fc1.weight",
            f"{state}.exp_avg.{mlp}.router.weight"} <= keys, sorted(keys)
    assert f"{state}.exp_avg.mtp.layers.0.output_layer.weight" in keys, sorted(keys)
    assert not any(k.startswith(f"{state}.momentum_buffer.") and ("router" in k or "output" in k)
                   for k in keys), sorted(keys)


def test_muon_config_error_is_one_line_exit_2():
    """The launcher's form of a Muon config error (the others: tests/unit/test_muon.py)."""
    result = launcher("--config", TINY, "optimizer.type=muon", "lora.rank=4", "--check",
                      "--world-size", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "optimizer.type=muon with lora.rank=4" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
