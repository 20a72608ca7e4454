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

import json
from pathlib import Path

import pytest

from tests.functional.inprocess import completed, launch
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
    return _records(path, "train")


def _records(path, kind) -> dict:
    lines = Path(path).read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines) if r["kind"] == kind}


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


def test_step35_moe_tiny_trains_in_bf16_at_ep2(run_distributed, tmp_path,
                                              stdlib_prefix):  # noqa: F811
    """bf16 (megatron's Float16Module and mixed-precision optimizer; the router in fp32) at
    EP 2 on 2 ranks: main and MTP losses both fall over 8 steps. The launcher's ``main`` in the
    tests' gloo ranks (tests/functional/inprocess.py)."""
    metrics = tmp_path / "bf16.jsonl"
    result = check(completed(run_distributed(
        launch, "--config", MOE_TINY, f"data.prefix={stdlib_prefix}", "training.train_iters=8",
        "training.eval_interval=null", "training.global_batch_size=4", "training.precision=bf16",
        "parallelism.expert_model_parallel_size=2", "checkpoint.save=null",
        "checkpoint.load=null", "logging.log_interval=1", f"logging.metrics_file={metrics}",
        world_size=2, timeout=600)[0]), "bf16")
    assert "(experts: EP 2)" in result.stdout and "bf16 on cpu" in result.stdout
    records = _train_records(metrics)
    assert sorted(records) == list(range(1, 9))
    first, last = _losses(records[1]), _losses(records[8])
    assert len(first) == 2
    for before, after in zip(first, last):
        assert after < before - 0.5, (first, last)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory, stdlib_prefix, run_distributed_shared):
    """With moe_layer_freq [0, 0, 1, 1] at PP 2, stage 0 has no MoE layer and stage 1 has two
    and the MTP depth. ``start``: 3 PP 2 steps, saved after each; ``pp2`` and ``pp1``: 3 steps
    each from its step-1 weights (checkpoint.finetune: the same weights, a fresh optimizer, the
    same samples); ``pp1_resume``: resumes its step-1 checkpoint (optimizer state included) at
    PP 1. The launcher's ``main`` in the tests' gloo ranks, 2 and 1 (tests/functional/inprocess.py:
    four runs of 3 steps would spend most of their time importing under torchrun)."""
    tmp = tmp_path_factory.mktemp("step35_moe_pp")
    out = {"tmp": tmp}
    out.update(run_distributed_shared(_pp_runs, tmp, stdlib_prefix, ("start", "pp2"),
                                      world_size=2, timeout=600)[0])
    check(out["start"], "start")
    out.update(run_distributed_shared(_pp_runs, tmp, stdlib_prefix, ("pp1", "pp1_resume"),
                                      world_size=1, timeout=600)[0])
    return out


def _pp_runs(tmp, data, names):
    """The runs ``names`` of ``pp_runs`` on this rank, each as a finished torchrun's fields."""
    common = ["--config", MOE_TINY, f"data.prefix={data}", "training.eval_interval=null",
              "logging.log_interval=1", "optimizer.lr_warmup_iters=1", "training.train_iters=3",
              "model.moe_layer_freq=[0,0,1,1]", "parallelism.expert_model_parallel_size=1",
              "logging.attention_probe=3"]
    pp2 = "parallelism.pipeline_model_parallel_size=2"
    step1 = tmp / "start" / "iter_0000001"
    runs = {
        "start": [pp2, "checkpoint.save_interval=1", f"checkpoint.save={tmp / 'start'}",
                  "checkpoint.load=null"],
        "pp2": [pp2, "checkpoint.finetune=true", f"checkpoint.load={step1}",
                "checkpoint.save=null"],
        "pp1": ["checkpoint.finetune=true", f"checkpoint.load={step1}", "checkpoint.save=null"],
        "pp1_resume": [f"checkpoint.load={step1}", "checkpoint.save=null"],
    }
    out = {}
    for name in names:
        out[name] = completed(launch(*common, *runs[name],
                                     f"logging.metrics_file={tmp / name}.jsonl"))
    return out


def test_moe_balancing_loss_logs_with_mtp_and_a_pipeline_stage_without_moe(pp_runs):
    """Each step's load_balancing_loss (megatron's reduction: a stage that recorded nothing
    joins with zeros sized num_layers + mtp_num_layers) and the main and MTP losses at PP 2
    equal PP 1's from the same weights (rel 1e-5, fp32: reduction order). Before, the stage
    without MoE layers all-reduced a tensor of num_layers entries against megatron's 5 over the
    pipeline group: SIGABRT on gloo at the first step."""
    tmp = pp_runs["tmp"]
    check(pp_runs["pp2"], "pp2"), check(pp_runs["pp1"], "pp1")
    pp2, pp1 = (_train_records(f"{tmp / name}.jsonl") for name in ("pp2", "pp1"))
    assert sorted(pp2) == sorted(pp1) == [1, 2, 3], (pp2, pp1)
    assert "PP 2" in pp_runs["pp2"].stdout
    for step in (1, 2, 3):
        expected, got = pp1[step], pp2[step]
        assert 0.5 < expected["load_balancing_loss"] < 4.0, expected
        assert got["load_balancing_loss"] == pytest.approx(expected["load_balancing_loss"],
                                                           rel=1e-5), (step, expected, got)
        assert _losses(got) == pytest.approx(_losses(expected), rel=1e-5), (step, expected, got)


def test_attention_probe_at_pp2_gives_pp1_figures(pp_runs):
    """logging.attention_probe on the step-1 weights, measured at the start of the PP 2 and PP 1
    runs that load them (and of the PP 1 run that resumes them): each stage measures its layers
    (the MTP depth on the last), the figures are PP 1's within 1e-5 (fp32)."""
    tmp = pp_runs["tmp"]
    pp2, pp1, resumed = (_records(f"{tmp / name}.jsonl", "probe")
                         for name in ("pp2", "pp1", "pp1_resume"))
    assert sorted(pp2) == sorted(pp1) == [0, 3] and sorted(resumed) == [1, 3], (pp2, pp1)
    want = pp1[0]
    assert list(want["layers"]) == ["1", "2", "3", "4", "mtp0"], want["layers"].keys()
    for got, where in ((pp2[0], "pp2"), (resumed[1], "pp1 resumed")):
        assert got["layers"].keys() == want["layers"].keys(), where
        for key in ("first_token_share", "sink_rate", "max_activation", "max_attn_output",
                    "gate_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (where, key)
        for layer, figures in want["layers"].items():
            for key, value in figures.items():
                assert got["layers"][layer][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (
                    where, layer, key)


def test_moe_checkpoint_of_a_pipeline_stage_without_moe_resumes_at_pp1(pp_runs):
    """The PP 2 checkpoint, saved where stage 0 (global rank 0, which writes the optimizer's
    common state) has no expert parameters, resumes at PP 1 with its Adam state: steps 2 and 3
    equal the uninterrupted PP 2 run's (rel 1e-5, fp32: reduction order). Before, megatron's
    optimizer saved the expert optimizer's step only from a rank that has experts, so the
    resume failed in torch Adam's load_state_dict with KeyError: 'step'."""
    tmp = pp_runs["tmp"]
    check(pp_runs["pp1_resume"], "pp1_resume")
    full, resumed = (_train_records(f"{tmp / name}.jsonl") for name in ("start", "pp1_resume"))
    assert "resumed from" in pp_runs["pp1_resume"].stdout
    assert sorted(resumed) == [2, 3], resumed
    for step in (2, 3):
        expected, got = full[step], resumed[step]
        assert _losses(got) == pytest.approx(_losses(expected), rel=1e-5), (step, expected, got)
        assert got["load_balancing_loss"] == pytest.approx(expected["load_balancing_loss"],
                                                           rel=1e-5), (step, expected, got)


@pytest.mark.parametrize("optimizer, tolerance", [
    # Both opt-in (-m slow; three MoE + MTP torchruns each, over a minute of CI each): the
    # default run keeps the plain optimizer's case (pp_runs above). Float16Optimizer (fp32 master
    # weights, bf16 model) guards workaround f of _mcore_compat, the distributed optimizer e.
    pytest.param(["training.precision=bf16"], 1e-3, marks=pytest.mark.slow),
    pytest.param(["optimizer.use_distributed_optimizer=true"], 1e-5, marks=pytest.mark.slow),
], ids=["bf16", "distributed_optimizer"])
def test_other_optimizers_of_a_pipeline_stage_without_moe_reshard_both_ways(
        tmp_path, stdlib_prefix, optimizer, tolerance):  # noqa: F811
    """As above for the two other optimizers megatron builds: 3 PP 2 steps saved after each; its
    step-1 checkpoint resumed at PP 1 (saving after each step), and that run's step-2 checkpoint
    resumed at PP 2 again (where rank 0's expert optimizer is empty and loads nothing). Every
    resumed step equals the PP 2 run's (bf16: rel 1e-3, reduction order in bf16; fp32: 1e-5).
    Before, with bf16 the PP 1 load failed in megatron's merge of the common state (rank 0's
    empty list of fp32 master weights: "Cannot merge two lists with different lengths"); the
    distributed optimizer over torch's Adam failed its first save on the stage without experts
    (an assert on the number of Adam steps) and its load there (no parameter state)."""
    common = ["--config", MOE_TINY, f"data.prefix={stdlib_prefix}", "training.eval_interval=null",
              "logging.log_interval=1", "optimizer.lr_warmup_iters=1", "training.train_iters=3",
              "checkpoint.save_interval=1", "model.moe_layer_freq=[0,0,1,1]",
              "parallelism.expert_model_parallel_size=1", *optimizer]
    pp2 = "parallelism.pipeline_model_parallel_size=2"
    runs = (("pp2", [pp2], "null", 2),
            ("pp1", [], tmp_path / "pp2" / "iter_0000001", 1),
            ("pp2_again", [pp2], tmp_path / "pp1" / "iter_0000002", 2))
    for name, layout, load, nproc in runs:
        result = check(torchrun(*common, *layout, f"checkpoint.load={load}",
                                f"checkpoint.save={tmp_path / name}",
                                f"logging.metrics_file={tmp_path / name}.jsonl", nproc=nproc),
                       name)
        assert name == "pp2" or "resumed from" in result.stdout, result.stdout
    full, pp1, again = (_train_records(f"{tmp_path / name}.jsonl") for name, *_ in runs)
    assert sorted(pp1) == [2, 3] and sorted(again) == [3], (pp1, again)
    for step, got in ((2, pp1[2]), (3, pp1[3]), (3, again[3])):
        assert _losses(got) == pytest.approx(_losses(full[step]), rel=tolerance), (
            step, full[step], got)
