"""The launcher with ``optimizer.type=muon`` (megatron-core's Muon, Adam for the rest): the tiny
gated config at TP 2 on 2 gloo ranks trains, resumes exactly, and reshards to TP 1.

Three torchrun runs (about 1.5 min on 2 loaded cores), with ``muon_tp_mode=duplicated`` so that a
projection is orthogonalised whole at any TP: ``full`` runs 8 steps saving at 4 and 8;
``resumed`` starts from a copy of ``full``'s iteration 4 and runs to 8 at TP 2 (same floats);
``tp1`` does the same at TP 1 x DP 2 (same losses within 1e-4, as the Adam runs' TP change).
A config error is one line and exit code 2.
"""

import shutil

import pytest

from tests.functional.test_pretrain import (  # noqa: F401 (stdlib_prefix: a fixture)
    TINY, TRACKER, check, check_exact_resume, launcher, losses, stdlib_prefix,
    torchrun)

SMALL = ["model.seq_length=64", "training.micro_batch_size=4", "training.global_batch_size=8",
         "training.eval_interval=100", "logging.log_interval=1", "optimizer.lr_warmup_iters=2"]
MUON = ["optimizer.type=muon", "optimizer.muon_tp_mode=duplicated", "optimizer.lr=0.01"]


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory, stdlib_prefix):
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_muon():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no Muon")
    tmp = tmp_path_factory.mktemp("muon")
    common = ["--config", TINY, f"data.prefix={stdlib_prefix}", *SMALL, *MUON,
              "training.train_iters=8", "checkpoint.save_interval=4"]
    runs = dict(tmp=tmp)
    runs["full"] = check(torchrun(*common, f"checkpoint.save={tmp / 'full'}",
                                  f"checkpoint.load={tmp / 'full'}",
                                  f"logging.metrics_file={tmp / 'full.jsonl'}"), "full")
    for name, layout in (("resumed", []), ("tp1", ["parallelism.tensor_model_parallel_size=1"])):
        shutil.copytree(tmp / "full" / "iter_0000004", tmp / name / "iter_0000004")
        (tmp / name / TRACKER).write_text("4")
        runs[name] = check(torchrun(*common, *layout, f"checkpoint.save={tmp / name}",
                                    f"checkpoint.load={tmp / name}",
                                    f"logging.metrics_file={tmp / name}.jsonl"), name)
    return runs


def test_muon_run_trains_and_resumes_exactly(muon_runs):
    tmp = muon_runs["tmp"]
    check_exact_resume(tmp, muon_runs["resumed"])
    # Muon's momentum is in the checkpoint, the gated linear_qkv's as its QKV and gate tensors
    # (TP-reshardable); Adam's moments for the embedding, norms and biases only.
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp / "full" / "iter_0000004"))
               .read_metadata().state_dict_metadata)
    layer = "decoder.layers.self_attention.linear_qkv"
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
    for step in range(5, 9):
        assert tp1[step] == pytest.approx(full[step], abs=1e-4, rel=0), (step, tp1, full)
    assert "TP 1 x PP 1 x DP 2" in muon_runs["tp1"].stdout


def test_muon_config_error_is_one_line_exit_2():
    """The launcher's form of a Muon config error (the others: tests/unit/test_muon.py)."""
    result = launcher("--config", TINY, "optimizer.type=muon",
                      "optimizer.use_distributed_optimizer=true", "--check", "--world-size", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "optimizer.use_distributed_optimizer=true" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
