"""The launcher with ``model.architecture=hybrid`` (megatron's HybridModel, issue 36): the tiny
gated config with one depth of Step-3.5's MTP (the pattern's ``/*-``) at TP 2 on 2 gloo ranks
trains (loss and MTP loss fall), and resumes exactly from its checkpoint; a GPT run's checkpoint
with its MTP layer continues as a hybrid run (``gpt_to_hybrid_runs``), and the reverse is
refused.

``full`` runs 8 steps through torchrun, saving at 4 and 8; ``resumed`` starts from a copy of
``full``'s iteration 4 (the only one its save directory tracks) and runs to 8, the launcher's
``main`` in the tests' gloo ranks (tests/functional/inprocess.py). Same layout, weights,
optimizer state, data position and RNG: steps 5-8 must give the same floats.
"""

import json
import shutil

import pytest

from tests.functional.inprocess import completed, launch
from tests.functional.test_pretrain import (  # noqa: F401 (stdlib_prefix: a fixture)
    ROOT, TINY, TRACKER, check, check_exact_resume, losses, stdlib_prefix, torchrun)

SMALL = ["model.seq_length=64", "training.micro_batch_size=4", "training.global_batch_size=8",
         "training.eval_interval=100", "logging.log_interval=1",
         "optimizer.lr_warmup_iters=2", "model.mtp_num_layers=1"]


def mtp_losses(path) -> dict:
    """{step: [MTP loss per depth]} of a run's metrics file (training records)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: r["mtp_losses"] for r in records
            if r.get("kind") == "train" and "mtp_losses" in r}


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, stdlib_prefix, run_distributed_shared):
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
    resumed = check(completed(run_distributed_shared(
        launch, *common, f"checkpoint.save={tmp / 'resumed'}",
        f"checkpoint.load={tmp / 'resumed'}", f"logging.metrics_file={tmp / 'resumed.jsonl'}",
        world_size=2, timeout=600)[0]), "resumed")
    return dict(tmp=tmp, full=full, resumed=resumed)


def test_hybrid_run_trains_and_resumes_exactly(hybrid_runs):
    tmp = hybrid_runs["tmp"]
    check_exact_resume(tmp, hybrid_runs["resumed"])
    full, resumed = mtp_losses(tmp / "full.jsonl"), mtp_losses(tmp / "resumed.jsonl")
    assert sorted(full) == list(range(1, 9)) and full[8][0] < 0.8 * full[1][0], full
    assert [resumed[step] for step in range(5, 9)] == [full[step] for step in range(5, 9)]
    assert "GPTModel" not in hybrid_runs["full"].stdout + hybrid_runs["full"].stderr
    # The checkpoint holds HybridModel's layers: GPT layer 2's MLP is hybrid layer 4, the MTP
    # depth's MLP its layer 1.
    saved = (tmp / "full" / "iter_0000008" / ".metadata").read_bytes()
    assert b"decoder.layers.3.mlp.linear_fc1.weight" in saved
    assert b"mtp.layers.0.mtp_model_layer.layers.1.mlp.linear_fc1.weight" in saved


# ------------------------------------------------------------------- GPT checkpoint -> hybrid run


@pytest.fixture(scope="module")
def gpt_to_hybrid_runs(tmp_path_factory, stdlib_prefix, run_distributed_shared):
    """A GPT run of 8 steps at TP 2 (saves 4 and 8), and its iteration 4 continued to 8 as a
    hybrid run at TP 2 and at TP 1 x DP 2: the launcher's ``main`` in the tests' 2 gloo ranks
    (tests/functional/inprocess.py; both architectures' torchrun path: ``hybrid_runs`` and
    test_pretrain.py)."""
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_hybrid_model():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no HybridModel")
    tmp = tmp_path_factory.mktemp("gpt_to_hybrid")
    common = ["--config", TINY, f"data.prefix={stdlib_prefix}", *SMALL, "training.train_iters=8",
              "checkpoint.save_interval=4"]
    out = {"tmp": tmp}

    def run(name, *overrides):
        return check(completed(run_distributed_shared(
            launch, *common, *overrides, f"logging.metrics_file={tmp / name}.jsonl",
            world_size=2, timeout=600)[0]), name)

    out["gpt"] = run("gpt", "model.architecture=gpt", f"checkpoint.save={tmp / 'gpt'}",
                     f"checkpoint.load={tmp / 'gpt'}")
    for name, tp in (("hybrid", 2), ("hybrid_tp1", 1)):
        out[name] = run(name, "model.architecture=hybrid",
                        f"parallelism.tensor_model_parallel_size={tp}",
                        f"checkpoint.load={tmp / 'gpt' / 'iter_0000004'}",
                        f"checkpoint.save={tmp / name}")
    return out


def test_gpt_checkpoint_continues_as_a_hybrid_run(gpt_to_hybrid_runs):
    """megatron's load-time translation (mcore_ext.checkpoint.architecture), model and Adam's
    state: at the same TP the hybrid run's steps 5-8 are the GPT run's bit for bit (the same
    layers computing in the same order, as test_hybrid_model shows). At TP 1 the order of the
    TP reductions changes: within 1e-4 absolute (test_pretrain's bound for a TP 2 -> 1 resume,
    which dropping Adam's state exceeds by more than 1000x)."""
    runs = gpt_to_hybrid_runs
    tmp = runs["tmp"]
    gpt = losses(tmp / "gpt.jsonl")
    gpt_mtp = mtp_losses(tmp / "gpt.jsonl")
    for name in ("hybrid", "hybrid_tp1"):
        hybrid, hybrid_mtp = losses(tmp / f"{name}.jsonl"), mtp_losses(tmp / f"{name}.jsonl")
        assert sorted(hybrid) == list(range(5, 9)), (name, hybrid)
        assert f"resumed from {tmp / 'gpt' / 'iter_0000004'} (iteration 4" in runs[name].stdout
        for step in range(5, 9):
            if name == "hybrid":
                assert hybrid[step] == gpt[step], (step, hybrid, gpt)
                assert hybrid_mtp[step] == gpt_mtp[step], (step, hybrid_mtp, gpt_mtp)
            else:
                assert hybrid[step] == pytest.approx(gpt[step], abs=1e-4, rel=0), (step, hybrid)
                assert hybrid_mtp[step] == pytest.approx(gpt_mtp[step], abs=1e-4, rel=0), step
    assert "TP 1 x PP 1 x DP 2" in runs["hybrid_tp1"].stdout
    # The hybrid run saves hybrid keys: GPT layer 2's MLP is hybrid layer 4.
    saved = (tmp / "hybrid" / "iter_0000008" / ".metadata").read_bytes()
    assert b"decoder.layers.3.mlp.linear_fc1.weight" in saved and b"final_norm" in saved


def _gpt_loads_hybrid(hybrid_dir, save):
    from tests.functional.inprocess import launch

    return launch("--config", TINY, *SMALL, "data.source=mock", "training.train_iters=10",
                  "model.architecture=gpt", f"checkpoint.load={hybrid_dir}",
                  f"checkpoint.save={save}")


def test_a_hybrid_checkpoint_into_a_gpt_run_is_one_line(gpt_to_hybrid_runs, run_distributed):
    """The reverse is refused, naming both architectures: exit 2, one line on rank 0, nothing
    written (the old code failed with megatron's missing-key error per rank)."""
    tmp = gpt_to_hybrid_runs["tmp"]
    zero, one = run_distributed(_gpt_loads_hybrid, tmp / "hybrid", tmp / "refused", world_size=2)
    directory = tmp / "hybrid" / "iter_0000008"
    assert zero["code"] == 2 and one["code"] == 2, (zero, one)
    assert zero["stderr"] == (
        f"error: {directory} holds a HybridModel checkpoint (model.architecture=hybrid) but this "
        "run builds GPTModel (model.architecture=gpt): a hybrid checkpoint does not load into GPT "
        "(megatron translates GPT -> hybrid only); continue it with "
        "model.architecture=hybrid\n"), zero["stderr"]
    assert one["stderr"] == "" and "Traceback" not in zero["stdout"] + one["stdout"]
    assert not (tmp / "refused").exists()


MOE_TINY = ["--config", str(ROOT / "configs" / "step35_moe_tiny_cpu.yaml"), "data.source=mock",
            "model.mtp_num_layers=null",
            "model.layer_types=[full_attention,sliding_attention,sliding_attention,"
            "sliding_attention]", "model.swiglu_limits=[0,0,0,16.0]",
            "parallelism.expert_model_parallel_size=2", "training.eval_interval=null",
            "logging.log_interval=1", "training.train_iters=4", "checkpoint.save_interval=2",
            "optimizer.lr_warmup_iters=1"]


def _step35_gpt_then_hybrid(tmp):
    """Step-3.5's kinds with MoE (dense layer 1, layers 2-4 MoE with the expert bias, EP 2, no
    MTP): a GPT run of 4 steps saving 2 and 4, and its iteration 2 continued as a hybrid run."""
    from tests.functional.inprocess import launch

    gpt = launch(*MOE_TINY, "model.architecture=gpt", f"checkpoint.save={tmp / 'gpt'}",
                 f"checkpoint.load={tmp / 'gpt'}", f"logging.metrics_file={tmp / 'gpt.jsonl'}")
    hybrid = launch(*MOE_TINY, "model.architecture=hybrid", f"checkpoint.save={tmp / 'hybrid'}",
                    f"checkpoint.load={tmp / 'gpt' / 'iter_0000002'}",
                    f"logging.metrics_file={tmp / 'hybrid.jsonl'}")
    return gpt, hybrid


@pytest.mark.slow  # ~100 s on the 2 loaded cores; test_hybrid_checkpoint covers it in the suite
def test_step35_moe_gpt_checkpoint_continues_as_a_hybrid_run(run_distributed, tmp_path):
    """Per-layer checkpoint keys (kinds differ by layer): each layer number retargeted, the
    experts sharded over EP, the router's expert bias and Adam's state too: steps 3-4 are the
    GPT run's bit for bit (the old code: 'the model has head_wise_attn_gate=True but checkpoint
    ... has no gate tensors decoder.layers.2...', hybrid layer 2 being GPT layer 1's attention)."""
    from mcore_ext import _mcore_compat
    from tests.functional.inprocess import losses as read_losses

    if not _mcore_compat.has_hybrid_model():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no HybridModel")
    (gpt, hybrid), _ = run_distributed(_step35_gpt_then_hybrid, tmp_path, world_size=2,
                                       timeout=600)
    assert gpt["code"] == 0 and hybrid["code"] == 0, (gpt, hybrid)
    assert f"resumed from {tmp_path / 'gpt' / 'iter_0000002'} (iteration 2)" in hybrid["stdout"]
    expected, continued = read_losses(tmp_path / "gpt.jsonl"), read_losses(tmp_path / "hybrid.jsonl")
    assert sorted(continued) == [3, 4] and sorted(expected) == [1, 2, 3, 4]
    assert [continued[3], continued[4]] == [expected[3], expected[4]], (continued, expected)
