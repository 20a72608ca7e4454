"""The launcher trains configs/step35_tiny_cpu.yaml (both layer kinds, window, per-kind RoPE,
clamp, zero-centered norms, gate) on 2 gloo ranks at TP 2, and resumes it at TP 1 x DP 2.

Two runs (~1 minute on 2 cores): ``tp2`` trains 10 steps and saves at 5 and 10; ``tp1`` loads
the step-5 checkpoint at TP 1 and trains to step 10. After the reshard the losses match the
uninterrupted run within 1e-3 (fp32; different reduction orders at another TP size).
"""

import pytest

from tests.functional.test_pretrain import ROOT, check, losses, resolved_config, torchrun
from tests.functional.test_pretrain import stdlib_prefix  # noqa: F401  (the shared dataset fixture)

STEP35_TINY = str(ROOT / "configs" / "step35_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def step35_runs(tmp_path_factory, stdlib_prefix):
    tmp = tmp_path_factory.mktemp("step35")
    common = ["--config", STEP35_TINY, f"data.prefix={stdlib_prefix}",
              "training.train_iters=10", "training.eval_interval=null",
              "checkpoint.save_interval=5", "logging.log_interval=1"]
    out = {}
    for run in ("tp2", "tp1"):  # each run's metrics and resolved config.yaml in its own folder
        (tmp / f"log_{run}").mkdir()
    out["tp2"] = check(torchrun(*common, f"logging.metrics_file={tmp / 'log_tp2' / 'm.jsonl'}",
                                f"checkpoint.save={tmp / 'tp2'}", "checkpoint.load=null"), "tp2")
    # A copy of the step-5 checkpoint only, so that the TP 1 run resumes there.
    (tmp / "resume").mkdir()
    (tmp / "tp2" / "iter_0000005").rename(tmp / "resume" / "iter_0000005")
    (tmp / "resume" / "latest_checkpointed_iteration.txt").write_text("5")
    out["tp1"] = check(torchrun(*common, f"logging.metrics_file={tmp / 'log_tp1' / 'm.jsonl'}",
                                f"checkpoint.load={tmp / 'resume'}", "checkpoint.save=null",
                                "parallelism.tensor_model_parallel_size=1"), "tp1")
    out["tmp"] = tmp
    return out


@pytest.mark.slow
def test_step35_tiny_trains_at_tp2_and_resumes_at_tp1(step35_runs):
    tmp = step35_runs["tmp"]
    full, resumed = losses(tmp / "log_tp2" / "m.jsonl"), losses(tmp / "log_tp1" / "m.jsonl")
    config = resolved_config(step35_runs["tp2"].stdout)
    assert "sliding_num_attention_heads: 6" in config and "layernorm_zero_centered_gamma: true" in config
    assert sorted(full) == list(range(1, 11)) and sorted(resumed) == list(range(6, 11))
    assert full[10] < full[1] - 1.0, full
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(full[step], abs=1e-3, rel=0), (step, full, resumed)
