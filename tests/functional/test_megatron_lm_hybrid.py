"""The Megatron-LM entry's HybridModel (``--hybrid-layer-pattern``) through megatron.training's
``pretrain()``: ``torchrun -m mcore_ext.megatron_lm.pretrain_gpt``, mock data, the flags of
test_megatron_lm_pretrain plus the pattern of its 2 gated GPT layers.

Default suite (one process, TP 1): '*-*-' with --mtp-num-layers 1 (one MTP depth '/*-'; 24 CPU
seconds), 3 iterations, the main and MTP losses fall, the checkpoint is HybridModel's with the
gate, no GPTModel deprecation notice; the same for '*-*E' (a dense MLP and a MoE layer, 60 CPU
seconds). Slow: '*-*-' alone (about 40 CPU seconds; the MTP run asserts all it does), and
'*-*-/*-' at TP 2 resumed exactly in the other spelling (2 CPU ranks, 90 CPU seconds). Slow: '*E*E' at TP 2 x SP and '*-|*-' at PP 2 (2 CPU ranks, 3 iterations each,
164 CPU seconds); and (2 CPU ranks at TP 2, 142 CPU seconds, 5 minutes on the shared cores):

    full     5 iterations, checkpoints at 2 and 4 (and the final one at 5)
    resumed  loads full's iteration-2 checkpoint (--ckpt-step 2) and trains 3..5

and (slow, one process) a GPT run's iteration-2 checkpoint continued as the hybrid model gives
the GPT run's own iterations 3 to 5 (megatron.training's GPT -> hybrid translation at load).

As there: the resumed run gives the uninterrupted one's losses of the iterations megatron prints
alone (3 and 5), and at iteration 5 the same weights and Adam moments bit for bit (torch's DCP
reader). The checkpoint is HybridModel's (``decoder.final_norm``, hybrid layer numbers) with the
gate's keys. That the model is build_hybrid_model's, computing the GPT entry's logits for the
same weights: tests/unit/test_megatron_lm.py (test_hybrid_flags_build_the_hybrid_model_on_two_ranks).
Neither run prints the GPTModel deprecation notice (test_megatron_lm_pretrain: once, for GPT).
"""

import re
from pathlib import Path

import pytest
import torch

from tests.functional.test_megatron_lm_pretrain import (
    MEGATRON_LM,
    MODEL,
    TIMEOUT_S,
    TRAINING,
    check_resumed_from_iteration_2,
    checkpoint_tensors,
    losses,
    pretrain_gpt,
)
from tests.functional.test_pretrain import check, torchrun

pytest.importorskip("megatron.core.models.hybrid", reason="megatron-core >= 0.19")

HYBRID = ("--hybrid-layer-pattern", "*-*-")


def _hybrid_checkpoint_keys(keys) -> None:
    assert any(key.startswith("decoder.final_norm.") for key in keys)  # HybridModel's keys
    assert not any("decoder.final_layernorm" in key for key in keys)
    assert any("linear_qkv.weight._gate" in key for key in keys)  # the gate
    assert any("exp_avg_sq" in key for key in keys)  # Adam's moments


@pytest.mark.slow  # every assertion of it: test_mtp_trains_through_pretrain_on_one_rank
def test_hybrid_model_trains_through_pretrain_on_one_rank(tmp_path):
    run = check(torchrun(*MODEL, *TRAINING, *HYBRID, "--tensor-model-parallel-size", "1",
                         "--train-iters", "3", "--save", str(tmp_path), nproc=1,
                         program=MEGATRON_LM, timeout=TIMEOUT_S), "pretrain_gpt hybrid")
    trained = losses(run)
    assert sorted(trained) == [1, 2, 3] and float(trained[3]) < float(trained[1])
    assert "GPTModel is deprecated" not in run.stdout + run.stderr
    _hybrid_checkpoint_keys(checkpoint_tensors(tmp_path / "iter_0000003"))


# Both kinds of MLP: GPT layer 1 dense, layer 2 MoE (the flags' MoE layers must be the pattern's
# 'E's: megatron's --moe-layer-freq 1 would make both MoE).
MOE = ("--num-experts", "2", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]")


def test_moe_pattern_trains_through_pretrain_on_one_rank(tmp_path):
    """'*-*E': megatron's HybridModel with a dense MLP and a MoE layer (mcore_ext's MoE spec),
    3 iterations through pretrain() in one process at TP 1: the loss falls, megatron logs the
    MoE layer's load-balancing loss, and the checkpoint holds layer 1's MLP and layer 3's router
    and experts."""
    run = check(torchrun(*MODEL, *TRAINING, "--hybrid-layer-pattern", "*-*E", *MOE,
                         "--tensor-model-parallel-size", "1", "--train-iters", "3",
                         "--save", str(tmp_path), nproc=1, program=MEGATRON_LM,
                         timeout=TIMEOUT_S), "pretrain_gpt hybrid MoE")
    trained = losses(run)
    assert sorted(trained) == [1, 2, 3] and float(trained[3]) < float(trained[1])
    assert "load_balancing_loss" in run.stdout
    keys = checkpoint_tensors(tmp_path / "iter_0000003")
    _hybrid_checkpoint_keys(keys)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in keys  # '-': a dense MLP
    assert not any(key.startswith("decoder.layers.1.mlp.router") for key in keys)
    assert "decoder.layers.3.mlp.router.weight" in keys  # 'E': megatron's MoE layer
    assert any(key.startswith("decoder.layers.3.mlp.experts.") for key in keys)


@pytest.mark.slow
def test_moe_at_tp2_with_sequence_parallel_and_pattern_stages_at_pp2_train(tmp_path):
    """'*E*E' at TP 2 with sequence parallelism (megatron's MoE with TP needs it), and '*-|*-'
    at PP 2 (the pattern's own pipeline stages), each 3 iterations on 2 CPU ranks through
    pretrain(): the loss falls and the checkpoint holds every layer; at PP 2 the last stage has
    exactly the final norm's parameters more than the first (one GPT layer on each; the shared
    embedding / output weight on both)."""
    moe = check(torchrun(*MODEL, *TRAINING, "--hybrid-layer-pattern", "*E*E", "--num-experts",
                         "4", "--moe-router-topk", "2", "--sequence-parallel", "--train-iters",
                         "3", "--save", str(tmp_path / "moe"), program=MEGATRON_LM,
                         timeout=TIMEOUT_S), "pretrain_gpt hybrid MoE TP 2")
    stages = check(torchrun(*MODEL, *TRAINING, "--hybrid-layer-pattern", "*-|*-",
                            "--tensor-model-parallel-size", "1",
                            "--pipeline-model-parallel-size", "2", "--train-iters", "3",
                            "--save", str(tmp_path / "pp"), program=MEGATRON_LM,
                            timeout=TIMEOUT_S), "pretrain_gpt hybrid PP 2")
    for run in (moe, stages):
        trained = losses(run)
        assert sorted(trained) == [1, 2, 3] and float(trained[3]) < float(trained[1])
    moe_keys = checkpoint_tensors(tmp_path / "moe" / "iter_0000003")
    _hybrid_checkpoint_keys(moe_keys)
    assert {f"decoder.layers.{n}.mlp.router.weight" for n in (1, 3)} <= moe_keys.keys()
    assert "[ t 1/2," in moe.stdout
    pp_keys = checkpoint_tensors(tmp_path / "pp" / "iter_0000003")
    _hybrid_checkpoint_keys(pp_keys)
    assert {f"decoder.layers.{n}.mlp.linear_fc2.weight" for n in (1, 3)} <= pp_keys.keys()
    counts = dict(re.findall(r"number of parameters on \(tensor, gtp_remat, pipeline\) model "
                             r"parallel rank \(0, 0, (\d)\): (\d+)", stages.stdout))
    assert int(counts["1"]) - int(counts["0"]) == 2 * 64, counts  # final_norm weight and bias


# One MTP depth, in each of Megatron-LM's spellings (the entry adds '/*-' to the pattern for
# --mtp-num-layers): Step-3.5's depth, its own head.
MTP_PATTERN = ("--hybrid-layer-pattern", "*-*-/*-")
MTP_FLAG = ("--hybrid-layer-pattern", "*-*-", "--mtp-num-layers", "1")
MTP_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?mtp_1 loss: ([0-9.E+-]+)")
MTP_NOTE = ("mcore_ext: --mtp-num-layers 1 with --hybrid-layer-pattern '*-*-': each MTP depth "
            "is '/*-' (one dense GPT layer), the model's pattern is '*-*-/*-'")


def mtp_losses(result) -> dict[int, str]:
    return {int(step): loss for step, loss in MTP_LOSS.findall(result.stdout)}


def _mtp_checkpoint_keys(keys) -> None:
    """The depth's two hybrid layers (attention, dense MLP) and Step-3.5's head and norms."""
    _hybrid_checkpoint_keys(keys)
    depth = "mtp.layers.0."
    for name in ("mtp_model_layer.layers.0.self_attention.linear_qkv.weight._gate",
                 "mtp_model_layer.layers.1.mlp.linear_fc2.weight", "eh_proj.weight",
                 "enorm.weight", "hnorm.weight", "final_layernorm.weight",
                 "output_layer.weight"):
        assert depth + name in keys, name


def _saved_args(directory):
    """megatron's ``args`` in a torch_dist checkpoint's common state (after
    ``checkpoint_tensors``, which wrote the checkpoint's torch.save file)."""
    state = torch.load(Path(directory).with_suffix(".pt"), weights_only=False)
    common = [value for key, value in state.items() if key.startswith("common_state/")]
    return common[0][0]["args"]


def test_mtp_trains_through_pretrain_on_one_rank(tmp_path):
    """'*-*-' with --mtp-num-layers 1 (the depth '/*-' added, said once; megatron's warning
    that the pattern has no MTP depth is not printed), 3 iterations through pretrain() in one
    process at TP 1: the main and the MTP loss fall, the checkpoint holds the depth and its
    args the model's pattern (megatron's FLOPs count reads it too), and the GPTModel deprecation
    notice is not printed (the hybrid entry's; test_megatron_lm_pretrain: once, for GPT)."""
    run = check(torchrun(*MODEL, *TRAINING, *MTP_FLAG, "--tensor-model-parallel-size", "1",
                         "--train-iters", "3", "--save", str(tmp_path), nproc=1,
                         program=MEGATRON_LM, timeout=TIMEOUT_S), "pretrain_gpt hybrid MTP")
    trained, mtp = losses(run), mtp_losses(run)
    assert sorted(trained) == sorted(mtp) == [1, 2, 3]
    assert float(trained[3]) < float(trained[1]) and float(mtp[3]) < float(mtp[1]), (trained, mtp)
    output = run.stdout + run.stderr
    assert output.count(MTP_NOTE) == 1 and "no MTP pattern" not in output
    assert "GPTModel is deprecated" not in output
    _mtp_checkpoint_keys(checkpoint_tensors(tmp_path / "iter_0000003"))
    saved = _saved_args(tmp_path / "iter_0000003")  # the model's pattern, as '/' would give
    assert (saved.hybrid_layer_pattern, saved.mtp_num_layers) == ("*-*-/*-", 1)


@pytest.mark.slow
def test_mtp_trains_saves_and_resumes_exactly_in_the_other_spelling(tmp_path):
    """'*-*-/*-' at TP 2 on 2 CPU ranks, 5 iterations saved at 2 and 4; resumed from iteration 2
    with '*-*-' and --mtp-num-layers 1 (the same model): the uninterrupted run's main and MTP
    losses of the iterations printed alone (3, 5), and at iteration 5 the same weights and Adam
    moments bit for bit."""
    full = pretrain_gpt(*MTP_PATTERN, "--save", str(tmp_path / "full"))
    resumed = pretrain_gpt(*MTP_FLAG, "--load", str(tmp_path / "full"), "--ckpt-step", "2",
                           "--save", str(tmp_path / "resumed"))
    check_resumed_from_iteration_2(tmp_path, full, resumed)
    uninterrupted, continued = mtp_losses(full), mtp_losses(resumed)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5] and sorted(continued) == [3, 4, 5]
    assert float(uninterrupted[5]) < float(uninterrupted[1])
    assert [continued[step] for step in (3, 5)] == [uninterrupted[step] for step in (3, 5)]
    assert MTP_NOTE not in full.stdout and MTP_NOTE in resumed.stdout
    a = checkpoint_tensors(tmp_path / "full" / "iter_0000005")
    b = checkpoint_tensors(tmp_path / "resumed" / "iter_0000005")
    assert a.keys() == b.keys()
    _mtp_checkpoint_keys(a)
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_lm_hybrid")
    full = pretrain_gpt(*HYBRID, "--save", str(tmp / "full"))
    resumed = pretrain_gpt(
        *HYBRID, "--load", str(tmp / "full"), "--ckpt-step", "2", "--save", str(tmp / "resumed")
    )
    return tmp, full, resumed


@pytest.mark.slow
def test_hybrid_model_trains_saves_and_resumes_exactly(runs):
    tmp, full, resumed = runs
    check_resumed_from_iteration_2(tmp, full, resumed)
    for run in (full, resumed):
        assert "GPTModel is deprecated" not in run.stdout + run.stderr

    a = checkpoint_tensors(tmp / "full" / "iter_0000005")
    b = checkpoint_tensors(tmp / "resumed" / "iter_0000005")
    assert a.keys() == b.keys()
    _hybrid_checkpoint_keys(a)
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


@pytest.mark.slow
def test_gpt_checkpoint_continues_as_the_hybrid_model(tmp_path):
    """megatron.training's own GPT -> hybrid translation at load (megatron-core's
    gpt_checkpoint_interop) takes the GPT entry's checkpoint, gate keys and Adam moments: a GPT
    run of 5 iterations, its iteration-2 checkpoint continued with --hybrid-layer-pattern, gives
    the GPT run's own losses of the iterations megatron prints alone (3 and 5: the first printed
    after a resume is averaged with the next, see test_megatron_lm_pretrain) and grad norms of 3
    to 5. One process at TP 1, about 70 CPU seconds."""
    common = [*MODEL, *TRAINING, "--tensor-model-parallel-size", "1"]
    gpt = check(torchrun(*common, "--save", str(tmp_path / "gpt"), nproc=1, program=MEGATRON_LM,
                         timeout=TIMEOUT_S), "pretrain_gpt")
    hybrid = check(torchrun(*common, *HYBRID, "--load", str(tmp_path / "gpt"), "--ckpt-step", "2",
                            "--save", str(tmp_path / "hybrid"), nproc=1, program=MEGATRON_LM,
                            timeout=TIMEOUT_S), "pretrain_gpt hybrid from gpt")
    assert "loading a GPT checkpoint into the hybrid model" in hybrid.stdout
    uninterrupted, continued = _logged(gpt), _logged(hybrid)
    assert sorted(continued) == [3, 4, 5]
    assert [continued[step][0] for step in (3, 5)] == [uninterrupted[step][0] for step in (3, 5)]
    assert [continued[step][1] for step in (3, 4, 5)] == [
        uninterrupted[step][1] for step in (3, 4, 5)]


def _logged(result) -> dict[int, tuple[str, str]]:
    """{iteration: (lm loss, grad norm)} as megatron printed them."""
    return {int(step): (loss, norm) for step, loss, norm in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+)",
        result.stdout)}
