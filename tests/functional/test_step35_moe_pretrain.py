"""The launcher trains configs/step35_moe_tiny_cpu.yaml (gate, both attention kinds, MoE with a
shared expert, sigmoid router with expert bias, routed / shared clamps, aux loss and expert-bias
update, one Step-3.5 MTP depth) on 4 gloo ranks at EP 4 with the all-to-all dispatcher, and
resumes it.

Five runs: ``ep4`` trains 10 steps and saves at 5 and 10; ``ep4_resume`` loads the step-5
checkpoint at the same layout and must reproduce steps 6-10 exactly (main and MTP losses); ``ep1``
loads it at EP 1 and TP 1 (DP 4, every expert on every rank), ``tp2_ep2`` at TP 2 x EP 2 with
expert TP 1 (expert TP != TP, sequence parallel, expert DP 2) and ``cp2_ep2`` at CP 2 x EP 2
(DP 2; MTP under CP too); these must match within 1e-3 (fp32; other reduction orders).
"""

import pytest

import json
from pathlib import Path

from tests.functional.test_pretrain import ROOT, check, torchrun
from tests.functional.test_pretrain import stdlib_prefix  # noqa: F401  (the shared dataset fixture)

MOE_TINY = str(ROOT / "configs" / "step35_moe_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, stdlib_prefix):
    tmp = tmp_path_factory.mktemp("step35_moe")
    common = ["--config", MOE_TINY, f"data.prefix={stdlib_prefix}", "training.train_iters=10",
              "training.eval_interval=null", "checkpoint.save_interval=5",
              "logging.log_interval=1"]
    out = {"tmp": tmp}
    out["ep4"] = check(torchrun(*common, f"logging.metrics_file={tmp / 'ep4'}.jsonl",
                                f"checkpoint.save={tmp / 'ep4'}", "checkpoint.load=null",
                                nproc=4), "ep4")
    (tmp / "resume").mkdir()
    (tmp / "ep4" / "iter_0000005").rename(tmp / "resume" / "iter_0000005")
    (tmp / "resume" / "latest_checkpointed_iteration.txt").write_text("5")
    for name, overrides in (("ep4_resume", []),
                            ("ep1", ["parallelism.expert_model_parallel_size=1",
                                     "parallelism.tensor_model_parallel_size=1"]),
                            ("tp2_ep2", ["parallelism.expert_model_parallel_size=2",
                                         "parallelism.tensor_model_parallel_size=2",
                                         "parallelism.sequence_parallel=true"]),
                            ("cp2_ep2", ["parallelism.expert_model_parallel_size=2",
                                         "parallelism.context_parallel_size=2"])):
        out[name] = check(torchrun(*common, f"logging.metrics_file={tmp / name}.jsonl",
                                   f"checkpoint.load={tmp / 'resume'}", "checkpoint.save=null",
                                   *overrides, nproc=4), name)
    return out


def _train_records(path) -> dict:
    lines = Path(path).read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


def _losses(record) -> list:
    return [record["loss"], *record["mtp_losses"]]


@pytest.mark.slow
def test_step35_moe_tiny_trains_at_ep4_and_resumes_exactly_and_at_other_layouts(moe_runs):
    tmp = moe_runs["tmp"]
    full = _train_records(f"{tmp / 'ep4'}.jsonl")
    assert "(experts: EP 4)" in moe_runs["ep4"].stdout
    assert "load_balancing_loss" in moe_runs["ep4"].stdout
    assert "mtp loss" in moe_runs["ep4"].stdout
    assert sorted(full) == list(range(1, 11))
    first, last = _losses(full[1]), _losses(full[10])
    assert len(first) == 2, full[1]  # main + 1 MTP depth
    for before, after in zip(first, last):
        assert after < before - 0.5, (first, last)
    balance = [record["load_balancing_loss"] for record in full.values()]
    # sum over experts of (fraction routed x mean prob) x E / topk: 1 when balanced (here ~1)
    assert all(0.5 < b < 4.0 for b in balance), balance
    same = _train_records(f"{tmp / 'ep4_resume'}.jsonl")
    assert sorted(same) == list(range(6, 11))
    for step in range(6, 11):
        assert _losses(same[step]) == _losses(full[step]), (step, full[step], same[step])
    assert "(experts: EP 2)" in moe_runs["tp2_ep2"].stdout
    assert "CP 2" in moe_runs["cp2_ep2"].stdout
    for name in ("ep1", "tp2_ep2", "cp2_ep2"):
        other = _train_records(f"{tmp / name}.jsonl")
        assert sorted(other) == list(range(6, 11)), name
        for step in range(6, 11):
            assert _losses(other[step]) == pytest.approx(_losses(full[step]), abs=1e-3, rel=0), (
                name, step, full[step], other[step])


def test_step35_moe_tiny_trains_in_bf16_at_ep2(tmp_path, stdlib_prefix):  # noqa: F811
    """bf16 (megatron's Float16Module and mixed-precision optimizer; the router in fp32) at
    EP 2 on 2 ranks: main and MTP losses both fall over 8 steps."""
    metrics = tmp_path / "bf16.jsonl"
    result = check(torchrun("--config", MOE_TINY, f"data.prefix={stdlib_prefix}",
                            "training.train_iters=8", "training.eval_interval=null",
                            "training.global_batch_size=4", "training.precision=bf16",
                            "parallelism.expert_model_parallel_size=2", "checkpoint.save=null",
                            "checkpoint.load=null", "logging.log_interval=1",
                            f"logging.metrics_file={metrics}", nproc=2), "bf16")
    assert "(experts: EP 2)" in result.stdout and "bf16 on cpu" in result.stdout
    records = _train_records(metrics)
    assert sorted(records) == list(range(1, 9))
    first, last = _losses(records[1]), _losses(records[8])
    assert len(first) == 2
    for before, after in zip(first, last):
        assert after < before - 0.5, (first, last)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory, stdlib_prefix):
    """With moe_layer_freq [0, 0, 1, 1] at PP 2, stage 0 has no MoE layer and stage 1 has two
    and the MTP depth. ``start``: one PP 2 step, saved; ``pp2`` and ``pp1``: 3 steps each from
    its weights (checkpoint.finetune: the same weights, a fresh optimizer, the same samples)."""
    tmp = tmp_path_factory.mktemp("step35_moe_pp")
    common = ["--config", MOE_TINY, f"data.prefix={stdlib_prefix}", "training.eval_interval=null",
              "logging.log_interval=1", "optimizer.lr_warmup_iters=1",
              "model.moe_layer_freq=[0,0,1,1]", "parallelism.expert_model_parallel_size=1"]
    pp2 = "parallelism.pipeline_model_parallel_size=2"
    out = {"tmp": tmp}
    out["start"] = check(torchrun(*common, pp2, "training.train_iters=3",
                                  "training.exit_interval=1", "checkpoint.save_interval=1",
                                  f"checkpoint.save={tmp / 'start'}", "checkpoint.load=null",
                                  f"logging.metrics_file={tmp / 'start'}.jsonl", nproc=2), "start")
    for name, layout, nproc in (("pp2", [pp2], 2), ("pp1", [], 1)):
        out[name] = check(torchrun(*common, *layout, "training.train_iters=3",
                                   f"checkpoint.load={tmp / 'start'}", "checkpoint.finetune=true",
                                   "checkpoint.save=null",
                                   f"logging.metrics_file={tmp / name}.jsonl", nproc=nproc), name)
    return out


def test_moe_balancing_loss_logs_with_mtp_and_a_pipeline_stage_without_moe(pp_runs):
    """Each step's load_balancing_loss (megatron's reduction: a stage that recorded nothing
    joins with zeros sized num_layers + mtp_num_layers) and the main and MTP losses at PP 2
    equal PP 1's from the same weights (rel 1e-5, fp32: reduction order). Before, the stage
    without MoE layers all-reduced a tensor of num_layers entries against megatron's 5 over the
    pipeline group: SIGABRT on gloo at the first step."""
    tmp = pp_runs["tmp"]
    pp2, pp1 = (_train_records(f"{tmp / name}.jsonl") for name in ("pp2", "pp1"))
    assert sorted(pp2) == sorted(pp1) == [1, 2, 3], (pp2, pp1)
    assert "PP 2" in pp_runs["pp2"].stdout
    for step in (1, 2, 3):
        expected, got = pp1[step], pp2[step]
        assert 0.5 < expected["load_balancing_loss"] < 4.0, expected
        assert got["load_balancing_loss"] == pytest.approx(expected["load_balancing_loss"],
                                                           rel=1e-5), (step, expected, got)
        assert _losses(got) == pytest.approx(_losses(expected), rel=1e-5), (step, expected, got)
