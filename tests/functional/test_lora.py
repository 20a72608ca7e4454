"""LoRA through the launcher: torchrun, 2 gloo ranks, TP 2 + SP, the tiny gated config.

A base run (6 steps, full training) saves a checkpoint; a LoRA run fine-tunes it
(``checkpoint.finetune``, ``lora.rank=8``, every target) for 16 steps and saves its own. The LoRA
run's validation loss is below the base's (same batches), its checkpoint holds the base weights unchanged (bit for bit) beside trained
adapters (every B moved from its zero init), and the optimizer state covers the adapters only.
About a minute on 2 cores.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.functional.test_megatron_lm_pretrain import checkpoint_tensors
from tests.functional.test_pretrain import stdlib_prefix  # noqa: F401  (the shared dataset fixture)
from tests.functional.test_pretrain import TINY, check, launcher, losses, torchrun

ADAPTER = "_lora."


def valid_losses(path) -> dict:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r["kind"] == "valid"}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, stdlib_prefix):
    tmp = tmp_path_factory.mktemp("lora")
    # Evaluated at the end only (the same validation batches in both runs).
    common = ["--config", TINY, f"data.prefix={stdlib_prefix}", "training.eval_interval=100",
              "logging.log_interval=1", "parallelism.sequence_parallel=true",
              "optimizer.lr_warmup_iters=2"]
    check(torchrun(*common, "training.train_iters=6", f"checkpoint.save={tmp / 'base'}",
                   f"checkpoint.load={tmp / 'base'}", f"logging.metrics_file={tmp / 'base.jsonl'}"),
          "base")
    result = check(torchrun(
        *common, "training.train_iters=16", f"checkpoint.load={tmp / 'base'}",
        "checkpoint.finetune=true", f"checkpoint.save={tmp / 'lora'}",
        "lora.rank=8", "lora.alpha=16", "lora.targets=all-linear", "optimizer.lr=1e-2",
        "optimizer.lr_decay_style=constant",
        f"logging.metrics_file={tmp / 'lora.jsonl'}"), "lora")
    return tmp, result


def test_lora_run_trains_adapters_only(lora_runs):
    tmp, result = lora_runs
    assert "LoRA adapter parameters trained, r 8" in result.stdout, result.stdout[-2000:]
    assert sorted(losses(tmp / "lora.jsonl")) == list(range(1, 17))
    # The adapters lower the frozen base's validation loss (training losses are too noisy over
    # 16 steps of different batches to show it).
    base_valid, lora_valid = (valid_losses(tmp / f"{name}.jsonl") for name in ("base", "lora"))
    assert list(base_valid) == [6] and list(lora_valid) == [16]
    assert lora_valid[16] < base_valid[6] - 0.05, (base_valid, lora_valid)

    base = checkpoint_tensors(tmp / "base" / "iter_0000006")
    tuned = checkpoint_tensors(tmp / "lora" / "iter_0000016")
    # Model tensors: every key but the optimizer's (the layers stacked along a leading axis).
    base_weights = {k: v for k, v in base.items() if not k.startswith("optimizer.")}
    tuned_weights = {k: v for k, v in tuned.items() if not k.startswith("optimizer.")}
    adapters = {k: v for k, v in tuned_weights.items() if ADAPTER in k}
    assert "embedding.word_embeddings.weight" in base_weights
    assert set(tuned_weights) - set(adapters) == set(base_weights)
    changed = [k for k in base_weights if not torch.equal(base_weights[k], tuned_weights[k])]
    assert changed == [], changed
    # 8 targets x (A, B); every B trained away from zero in every layer.
    assert len(adapters) == 16, sorted(adapters)
    assert all(v.flatten(1).abs().amax(1).min() > 0 for k, v in adapters.items()
               if k.endswith("lora_B")), adapters
    # Adam's moments exist for the adapters only.
    moments = [k for k in tuned if k.startswith("optimizer.") and "exp_avg" in k]
    assert moments and all(ADAPTER in k for k in moments), moments[:5]


@pytest.mark.parametrize("override, message", [
    ("lora.rank=-2", "lora.rank must be an integer >= 0, got -2"),
    ("lora.targets=q_proj w_proj", "lora.targets: unknown target(s) ['w_proj']"),
])
def test_lora_config_errors_name_the_field(override, message):
    result = launcher("--config", TINY, override, "--check", "--world-size", "2")
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
