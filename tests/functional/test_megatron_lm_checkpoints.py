"""Checkpoints cross between mcore_ext's launcher and Megatron-LM's training (megatron.training
through ``mcore_ext.megatron_lm.pretrain_gpt``), both ways, on 2 CPU ranks at TP 2, one tiny gated
model configured alike on both sides (schedule, optimizer, sizes, padded vocabulary).

The two launchers read different data (the launcher's mock dataset with its byte tokenizer, and
Megatron-LM's with its NullTokenizer), so a run is only continued in the launcher that saved it,
after a round trip through the other one:

    Megatron-LM -> launcher -> Megatron-LM
        mlm_full     Megatron-LM, 5 iterations, checkpoints at 2, 4, 5
        launcher_rt  the launcher loads mlm_full's iteration 2 (a copy tracking it) and saves it
                     again (no step)
        mlm_resumed  Megatron-LM resumes launcher_rt, trains 3..5
    launcher -> Megatron-LM -> launcher
        l_full       the launcher, 5 iterations, checkpoints at 2, 4, 5
        mlm_rt       Megatron-LM loads l_full's iteration 2 and saves it again (--train-iters 2:
                     no step; --use-checkpoint-opt-param-scheduler because its schedule then
                     spans 2 iterations instead of 5)
        l_resumed    the launcher resumes mlm_rt, trains 3..5

Compared: every tensor (weights, Adam moments, optimizer step) of the round-tripped iteration-2
checkpoint equals the original's bit for bit (torch's DCP reader), its iteration and schedule
(steps mapped iterations <-> samples) and consumed samples are the original's; and the resumed
run's losses at 3 and 5 (and its final weights, for Megatron-LM) equal the uninterrupted run's
exactly, which needs the schedule, optimizer state and data position to have crossed intact.
Dropout is 0 (see test_megatron_lm_pretrain: the CPU RNG quirk), so the losses do not check the
RNG restore. Both sides use a 257-token vocabulary padded to 384 rows (NullTokenizer
--vocab-size 257 with --make-vocab-size-divisible-by 64 at TP 2; the byte tokenizer with 128).
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.functional.test_pretrain import check, torchrun

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")

from tests.functional.test_megatron_lm_pretrain import MEGATRON_LM  # noqa: E402

TIMEOUT_S = 600
# The same model, optimizer and schedule for both launchers (Megatron-LM's defaults where the
# launcher has a setting: linear decay to 0, weight decay 0.01, clip 1.0).
MLM = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--position-embedding-type", "rope", "--no-rope-fusion",
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--swiglu",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--head-wise-attn-gate",
    "--mcore-ext-backend", "sdpa", "--tensor-model-parallel-size", "2", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "257", "--make-vocab-size-divisible-by", "64", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--ckpt-format", "torch_dist",
]
LAUNCHER = {  # GPTModel, as the Megatron-LM entry builds without --hybrid-layer-pattern
    "model": {"architecture": "gpt", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
              "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 32,
              "head_wise_attn_gate": True, "add_qkv_bias": True, "normalization": "RMSNorm",
              "attention_backend": "sdpa", "make_vocab_size_divisible_by": 128},
    "parallelism": {"tensor_model_parallel_size": 2},
    "training": {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 5,
                 "eval_interval": None, "seed": 1234, "precision": "fp32"},
    "optimizer": {"lr": 1.0e-3, "min_lr": 0.0, "lr_warmup_iters": 1, "lr_decay_style": "linear",
                  "weight_decay": 0.01, "clip_grad": 1.0},
    "data": {"source": "mock", "tokenizer": "byte"},
    "checkpoint": {"save_interval": 2},
    "logging": {"log_interval": 1},
}
MLM_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def megatron_lm(*flags, train_iters=5):
    return check(torchrun(*MLM, "--train-iters", str(train_iters), *flags, program=MEGATRON_LM,
                          timeout=TIMEOUT_S), "Megatron-LM")


def launcher(tmp, name, *overrides, script="launch/pretrain.py"):
    config = tmp / "launcher.yaml"
    config.write_text(json.dumps(LAUNCHER))  # YAML is a superset of JSON
    return check(torchrun("--config", str(config), f"logging.metrics_file={tmp / name}.jsonl",
                          *overrides, program=(script,), timeout=TIMEOUT_S), name)


def mlm_losses(result) -> dict[int, str]:
    return {int(step): loss for step, loss in MLM_LOSS.findall(result.stdout)}


def launcher_losses(path) -> dict[int, float]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r["kind"] == "train"}


def tensors_and_common(directory) -> tuple[dict, dict]:
    """Every tensor of a torch_dist checkpoint (torch's DCP reader), and its common dict."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = Path(str(directory) + ".pt")
    dcp_to_torch_save(directory, target)
    state = torch.load(target, weights_only=False)
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    return tensors, dist_checkpointing.load_common_state_dict(str(directory))


def assert_same_tensors(a: dict, b: dict) -> None:
    assert any("linear_qkv.weight._gate" in key for key in a)  # the gate, upstream's keys
    assert any("exp_avg_sq" in key for key in a)  # Adam's moments
    assert a.keys() == b.keys()
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


@pytest.mark.slow
def test_megatron_lm_checkpoint_resumes_through_the_launcher(tmp_path):
    full = megatron_lm("--save", str(tmp_path / "mlm_full"), "--save-interval", "2")
    # The launcher loads the tracked (latest) iteration: a directory tracking iteration 2.
    at2 = tmp_path / "mlm_at2"
    shutil.copytree(tmp_path / "mlm_full" / "iter_0000002", at2 / "iter_0000002")
    (at2 / "latest_checkpointed_iteration.txt").write_text("2")
    launcher(tmp_path, "launcher_rt", f"checkpoint.load={at2}",
             f"checkpoint.save={tmp_path / 'launcher_rt'}",
             script="tests/functional/launcher_resave.py")
    resumed = megatron_lm("--load", str(tmp_path / "launcher_rt"),
                          "--save", str(tmp_path / "mlm_resumed"), "--save-interval", "2")

    original, original_common = tensors_and_common(tmp_path / "mlm_full" / "iter_0000002")
    crossed, crossed_common = tensors_and_common(tmp_path / "launcher_rt" / "iter_0000002")
    assert_same_tensors(original, crossed)
    assert crossed_common["iteration"] == original_common["iteration"] == 2
    assert crossed_common["opt_param_scheduler"] == original_common["opt_param_scheduler"]
    assert crossed_common["args"].consumed_train_samples == 8
    assert crossed_common["consumed_samples"] == 8 and crossed_common["scheduler"]["num_steps"] == 2

    assert "loading distributed checkpoint from" in resumed.stdout
    full_losses, resumed_losses = mlm_losses(full), mlm_losses(resumed)
    assert sorted(resumed_losses) == [3, 4, 5]
    # Megatron-LM prints iteration 4 averaged with 3 in the uninterrupted run: compare 3 and 5.
    assert resumed_losses[3] == full_losses[3] and resumed_losses[5] == full_losses[5]
    end_full, _ = tensors_and_common(tmp_path / "mlm_full" / "iter_0000005")
    end_resumed, _ = tensors_and_common(tmp_path / "mlm_resumed" / "iter_0000005")
    assert_same_tensors(end_full, end_resumed)


@pytest.mark.slow
def test_launcher_checkpoint_resumes_through_megatron_lm(tmp_path):
    launcher(tmp_path, "l_full", f"checkpoint.save={tmp_path / 'l_full'}")
    megatron_lm("--load", str(tmp_path / "l_full"), "--ckpt-step", "2",
                "--use-checkpoint-opt-param-scheduler", "--save", str(tmp_path / "mlm_rt"),
                "--save-interval", "1000", train_iters=2)
    launcher(tmp_path, "l_resumed", f"checkpoint.load={tmp_path / 'mlm_rt'}",
             f"checkpoint.save={tmp_path / 'l_resumed'}")

    original, original_common = tensors_and_common(tmp_path / "l_full" / "iter_0000002")
    crossed, crossed_common = tensors_and_common(tmp_path / "mlm_rt" / "iter_0000002")
    assert_same_tensors(original, crossed)
    assert crossed_common["iteration"] == 2
    assert crossed_common["opt_param_scheduler"] == original_common["opt_param_scheduler"]
    assert original_common["opt_param_scheduler"]["num_steps"] == 8  # 2 iterations x 4 samples
    assert crossed_common["args"].consumed_train_samples == 8

    full_losses = launcher_losses(tmp_path / "l_full.jsonl")
    resumed_losses = launcher_losses(tmp_path / "l_resumed.jsonl")
    assert sorted(resumed_losses) == [3, 4, 5]
    assert all(resumed_losses[i] == full_losses[i] for i in (3, 4, 5))
