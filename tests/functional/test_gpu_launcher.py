"""The launcher on GPUs (marked gpu: skipped without CUDA, with the reason; benchmarks/gpu_check.py
runs them): bf16 with the distributed optimizer, async checkpoints through a kill, CP 2 on NCCL;
Muon (layer-wise distributed), HybridModel with MTP, LoRA, and the chat-SFT recipe's packed
documents on the varlen kernel against the sdpa kernel.

The tiny config at seq 128, 10 steps, checkpoints every 5. One GPU runs one rank: NCCL refuses
two ranks on one GPU, so CP 2 needs two GPUs. Tolerances: bf16 steps on a GPU are not bitwise
reproducible (flash attention's backward accumulates with atomics), so a bf16 resume must agree
within 2e-2 on losses of ~2-5 (bf16 keeps 8 bits: 2^-8 x 4 = 0.016 is one rounding of such a
loss); fp32 runs within 1e-4 (kernels' summation order only).
"""

import os
import shutil

import pytest
import torch

from tests.functional.test_pretrain import ROOT, TINY, TRACKER, check, losses, torchrun

pytestmark = pytest.mark.gpu


def _common(tmp_path, *extra):
    return ["--config", TINY, f"data.prefix={tmp_path / 'data' / 'stdlib_byte'}",
            "parallelism.tensor_model_parallel_size=1", "training.train_iters=10",
            "training.eval_interval=null", "checkpoint.save_interval=5",
            "logging.log_interval=1", "optimizer.lr_warmup_iters=2", *extra]


def _resume_from_step5(source, target):
    shutil.copytree(source / "iter_0000005", target / "iter_0000005")
    (target / TRACKER).write_text("5")


def test_ten_bf16_steps_with_the_distributed_optimizer_resume_on_one_gpu(tmp_path):
    common = _common(tmp_path, "training.precision=bf16", "optimizer.use_distributed_optimizer=true")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    first = check(torchrun(*common, f"checkpoint.save={full}", "checkpoint.load=null",
                           f"logging.metrics_file={tmp_path / 'full.jsonl'}", nproc=1), "full")
    _resume_from_step5(full, resumed)
    check(torchrun(*common, f"checkpoint.save={resumed}", f"checkpoint.load={resumed}",
                   f"logging.metrics_file={tmp_path / 'resumed.jsonl'}", nproc=1), "resumed")
    loss, again = losses(tmp_path / "full.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert "bf16 on cuda" in first.stdout, first.stdout[-2000:]
    assert sorted(loss) == list(range(1, 11)) and loss[10] < loss[1] - 0.5, loss
    assert sorted(again) == list(range(6, 11)), again
    for step in range(6, 11):
        assert again[step] == pytest.approx(loss[step], abs=2e-2, rel=0), (step, again, loss)


def test_async_save_survives_a_kill_and_resumes(tmp_path):
    """Async saves at 5 and 10; rank 0 is SIGKILLed in step 8. The restart resumes from the
    step-5 checkpoint (finalized while steps 6 and 7 ran) and matches an uninterrupted run."""
    common = _common(tmp_path, "training.precision=fp32", "checkpoint.async_save=true")
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    check(torchrun(*common, f"checkpoint.save={plain}", "checkpoint.load=null",
                   f"logging.metrics_file={tmp_path / 'plain.jsonl'}", nproc=1), "uninterrupted")
    os.environ["MCORE_EXT_KILL_AT"] = "step,8,0"
    try:
        dead = torchrun(*common, f"checkpoint.save={killed}", f"checkpoint.load={killed}",
                        f"logging.metrics_file={tmp_path / 'dead.jsonl'}", nproc=1)
    finally:
        del os.environ["MCORE_EXT_KILL_AT"]
    assert dead.returncode != 0 and "SIGKILL at step 8" in dead.stderr, dead.stderr[-3000:]
    assert (killed / TRACKER).read_text() == "5"
    check(torchrun(*common, f"checkpoint.save={killed}", f"checkpoint.load={killed}",
                   f"logging.metrics_file={tmp_path / 'resumed.jsonl'}", nproc=1), "resumed")
    loss, again = losses(tmp_path / "plain.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(again) == list(range(6, 11)), again
    for step in range(6, 11):
        assert again[step] == pytest.approx(loss[step], abs=1e-4, rel=0), (step, again, loss)
    assert (killed / TRACKER).read_text() == "10"


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="CP 2 on NCCL needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_cp2_on_nccl_matches_cp1(tmp_path):
    common = _common(tmp_path, "training.precision=fp32", "model.seq_length=64",
                     "training.micro_batch_size=4", "training.global_batch_size=8",
                     "checkpoint.save=null", "checkpoint.load=null")
    check(torchrun(*common, f"logging.metrics_file={tmp_path / 'cp1.jsonl'}", nproc=1), "CP 1")
    check(torchrun(*common, "parallelism.context_parallel_size=2",
                   f"logging.metrics_file={tmp_path / 'cp2.jsonl'}", nproc=2), "CP 2")
    cp1, cp2 = losses(tmp_path / "cp1.jsonl"), losses(tmp_path / "cp2.jsonl")
    assert sorted(cp2) == list(range(1, 11))
    for step in cp1:
        assert cp2[step] == pytest.approx(cp1[step], abs=1e-4, rel=0), (step, cp1, cp2)


def _trains(tmp_path, name, *overrides, steps=10, fall=0.5):
    """One bf16 run of ``steps`` steps on one GPU; its losses (each logged, the last below the
    first by ``fall``; None: not compared)."""
    check(torchrun(*_common(tmp_path, "training.precision=bf16", f"training.train_iters={steps}",
                            f"logging.metrics_file={tmp_path / name}.jsonl", *overrides),
                   nproc=1), name)
    loss = losses(tmp_path / f"{name}.jsonl")
    assert sorted(loss) == list(range(1, steps + 1)), (name, loss)
    assert fall is None or loss[steps] < loss[1] - fall, (name, loss)
    return loss


@pytest.mark.parametrize("name, overrides", [
    ("muon", ["optimizer.type=muon", "optimizer.lr=0.01",
              "optimizer.use_distributed_optimizer=true"]),
    ("hybrid", ["model.architecture=hybrid", "model.mtp_num_layers=1"]),
])
def test_muon_and_the_hybrid_model_train_in_bf16_on_one_gpu(tmp_path, name, overrides):
    from mcore_ext import _mcore_compat

    if name == "muon" and not _mcore_compat.has_muon():
        pytest.skip("megatron-core's Muon needs emerging-optimizers (gpu_check prepare carries it)")
    _trains(tmp_path, name, "checkpoint.save=null", "checkpoint.load=null", *overrides)


def test_lora_fine_tunes_a_checkpoint_in_bf16_on_one_gpu(tmp_path):
    """LoRA over a 5-step base lowers the validation loss on the same batches (each run's one
    evaluation, at its end). Its training losses are of other batches each step: over 10 steps
    the frozen base's own losses spread 0.17 on those batches, the adapters gain 0.02-0.07, so
    the first and last of them tell nothing (issue 58: this test read them and failed on an
    H200; so did CPU runs at seed 3, in bf16 and fp32). At lr 1e-2 the adapters' early Adam
    steps made the loss jump at step 4 or 5 (the H200's 4.160 -> 4.569; CPU seeds 1 and 3: 0.19-
    0.20 above the frozen base's loss on that batch); at 3e-3 no step of 4 CPU seeds was above
    the frozen base's, the validation loss 0.044-0.069 lower (bf16)."""
    from tests.functional.test_lora import valid_losses

    _trains(tmp_path, "base", f"checkpoint.save={tmp_path / 'base'}", "checkpoint.load=null",
            "training.eval_interval=5", steps=5)
    _trains(tmp_path, "lora", f"checkpoint.load={tmp_path / 'base'}", "checkpoint.finetune=true",
            f"checkpoint.save={tmp_path / 'lora'}", "lora.rank=8", "lora.alpha=16",
            "lora.targets=all-linear", "optimizer.lr=3e-3", "optimizer.lr_decay_style=constant",
            "training.eval_interval=10", fall=None)
    assert (tmp_path / "lora" / TRACKER).read_text() == "10"
    base, lora = (valid_losses(tmp_path / f"{name}.jsonl") for name in ("base", "lora"))
    assert list(base) == [5] and list(lora) == [10], (base, lora)
    assert lora[10] < base[5] - 0.02, (base, lora)


def test_packed_chat_sft_on_varlen_matches_the_sdpa_kernel(tmp_path):
    """The chat-SFT recipe (Step-3.5 miniature: gate, sliding layers, MoE, MTP; conversations
    packed per row) at TP 1 in bf16, on the varlen kernel and on sdpa: the same losses within
    5e-2 over 6 steps (losses ~5: a few bf16 roundings; the kernels sum in other orders)."""
    common = ["--config", str(ROOT / "configs" / "step35_sft_tiny_cpu.yaml"),
              "parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
              "training.precision=bf16", "training.train_iters=6", "training.eval_interval=null",
              "logging.log_interval=1", "checkpoint.save=null", "checkpoint.load=null",
              f"data.cache_dir={tmp_path / 'cache'}"]
    for kernel in ("sdpa", "varlen"):
        check(torchrun(*common, f"model.attention_kernel={kernel}",
                       f"logging.metrics_file={tmp_path / kernel}.jsonl", nproc=1), kernel)
    sdpa, varlen = losses(tmp_path / "sdpa.jsonl"), losses(tmp_path / "varlen.jsonl")
    assert sorted(sdpa) == sorted(varlen) == list(range(1, 7)), (sdpa, varlen)
    for step in sdpa:
        assert varlen[step] == pytest.approx(sdpa[step], abs=5e-2, rel=0), (step, sdpa, varlen)
