"""LoRA through the launcher: torchrun, 2 gloo ranks, TP 2 + SP, the tiny gated config with 1
query group (so at TP 2 q / k / v's B is kept whole on each rank; g_proj's B and o_proj's A are
TP-sharded).

A base run (6 steps, full training, checkpoints at 3 and 6) saves a checkpoint; a LoRA run
fine-tunes its iteration 6 (``checkpoint.finetune``, ``lora.rank=8``, every target) for 16 steps,
saving at 8 and 16. The LoRA run's validation loss is below the base's (same batches); its
checkpoints hold the adapters, their optimizer state and a reference to the base (not the frozen
weights); the base's files are untouched. A copy of its iteration 8 resumes to the uninterrupted
run's losses bit for bit; another goes TP 2 -> TP 1 (x DP 2) -> TP 2 over 9..12 and 13..16 with
the same losses within 1e-4 (fp32). A base changed since the adapters were saved is one line,
exit code 2. The run's iteration-16 adapters, written in PEFT's format, start a new run
(``lora.init_from``) at the LoRA run's validation loss. The LoRA run and the changed base go
through torchrun; the base run, the resume, the reshard's two runs and the PEFT start are the
launcher's ``main`` in the tests' gloo ranks (no torchrun's imports). So is the MoE + MTP test
at the end (routed experts' adapters saved at EP 2, resumed at EP 1 and back at EP 2).
So do the PP 2 tests (the dense Step-3.5 miniature at TP 1 x PP 2: exact resume, PP 2 -> PP 1
x DP 2 and -> TP 2, the adapters in PEFT's format written at PP 2 and loaded by a PP 2 run).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.functional.inprocess import completed, launch
from tests.functional.test_megatron_lm_pretrain import checkpoint_tensors
from tests.functional.test_pretrain import stdlib_prefix  # noqa: F401  (the shared dataset fixture)
from tests.functional.test_pretrain import (
    LAUNCHER, ROOT, TIMEOUT_S, TINY, TRACKER, _free_port, check, losses, torchrun)

ADAPTER = "_lora."


def valid_losses(path) -> dict:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r["kind"] == "valid"}


def copy_checkpoint(source_root, iteration, root):
    """A save directory holding a copy of ``source_root``'s iteration (as tracked)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(Path(source_root) / name, Path(root) / name)
    (Path(root) / TRACKER).write_text(str(iteration))


def quiet_torchrun(*args) -> subprocess.CompletedProcess:
    """``python -m mcore_ext.torchrun`` (a user's mistake: exit code 2, said once)."""
    return subprocess.run(
        [sys.executable, "-m", "mcore_ext.torchrun", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={_free_port()}", LAUNCHER, *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def gpt_layer_tensors(directory) -> dict:
    """``checkpoint_tensors`` of a launcher checkpoint with GPTModel's layer numbers: a
    HybridModel's (the launcher's default from megatron-core 0.19; its config.yaml says) layers
    2g (attention) and 2g + 1 (MLP) are GPT layer g, as in transformers' model."""
    import yaml

    tensors = checkpoint_tensors(directory)
    config = yaml.safe_load((Path(directory) / "config.yaml").read_text())
    if config["model"]["architecture"] != "hybrid":
        return tensors
    return {re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) // 2}.",
                   key): value for key, value in tensors.items()}


def in_process(run_distributed, *args, name):
    """The launcher's ``main`` on the tests' 2 gloo ranks (tests/functional/inprocess.py: no
    torchrun's imports per run), checked as a torchrun (rank 0's output)."""
    return check(completed(run_distributed(launch, *args, world_size=2, timeout=600)[0]), name)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, stdlib_prefix, run_distributed_shared):
    tmp = tmp_path_factory.mktemp("lora")
    # Evaluated at the end only (the same validation batches in both runs).
    common = ["--config", TINY, f"data.prefix={stdlib_prefix}", "training.eval_interval=100",
              "logging.log_interval=1", "parallelism.sequence_parallel=true",
              "optimizer.lr_warmup_iters=2", "model.num_query_groups=1"]
    in_process(run_distributed_shared, *common, "training.train_iters=6",
               "checkpoint.save_interval=3", f"checkpoint.save={tmp / 'base'}",
               f"checkpoint.load={tmp / 'base'}", f"logging.metrics_file={tmp / 'base.jsonl'}",
               name="base")
    lora = [*common, f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
            "lora.rank=8", "lora.alpha=16", "lora.targets=all-linear", "optimizer.lr=1e-2",
            "optimizer.lr_decay_style=constant", "checkpoint.save_interval=8"]
    result = check(torchrun(*lora, "training.train_iters=16", f"checkpoint.save={tmp / 'lora'}",
                            f"logging.metrics_file={tmp / 'lora.jsonl'}"), "lora")
    return tmp, result, lora


def test_lora_run_trains_adapters_only(lora_runs):
    tmp, result, _ = lora_runs
    assert "LoRA adapter parameters trained, r 8" in result.stdout, result.stdout[-2000:]
    assert sorted(losses(tmp / "lora.jsonl")) == list(range(1, 17))
    # The adapters lower the frozen base's validation loss (training losses are too noisy over
    # 16 steps of different batches to show it).
    base_valid, lora_valid = (valid_losses(tmp / f"{name}.jsonl") for name in ("base", "lora"))
    assert list(base_valid) == [6] and list(lora_valid) == [16]
    assert lora_valid[16] < base_valid[6] - 0.05, (base_valid, lora_valid)

    base = checkpoint_tensors(tmp / "base" / "iter_0000006")
    tuned = gpt_layer_tensors(tmp / "lora" / "iter_0000016")
    assert "embedding.word_embeddings.weight" in base
    # The adapters and their optimizer state only: no frozen weight is saved again.
    weights = {k: v for k, v in tuned.items() if not k.startswith("optimizer.")}
    assert weights and all(ADAPTER in k for k in weights), sorted(weights)[:5]
    # 8 targets x (A, B), one key each (GPTModel's stacked layers) or one per layer (HybridModel,
    # the default from megatron-core 0.19); every B trained away from zero in every layer.
    per_target = {re.sub(r"decoder\.layers\.\d+\.", "decoder.layers.", k) for k in weights}
    assert len(per_target) == 16 and len(weights) in (16, 32), sorted(weights)
    assert all(v.flatten(1).abs().amax(1).min() > 0 for k, v in weights.items()
               if k.endswith("lora_B")), weights
    # Adam's moments exist for the adapters only.
    moments = [k for k in tuned if k.startswith("optimizer.") and "exp_avg" in k]
    assert moments and all(ADAPTER in k for k in moments), moments[:5]
    # The reference to the base: its iteration directory and iteration.
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(tmp / "lora" / "iter_0000016"))
    assert common["lora_base"]["directory"] == str(tmp / "base" / "iter_0000006")
    assert common["lora_base"]["iteration"] == 6
    # A copy of the adapters checkpoint is far smaller than the base's.
    size = {name: sum(f.stat().st_size for f in (tmp / name / it).iterdir())
            for name, it in (("base", "iter_0000006"), ("lora", "iter_0000016"))}
    assert size["lora"] < size["base"] / 2, size


def test_lora_run_resumes_exactly_from_its_adapters(lora_runs, run_distributed):
    tmp, _, lora = lora_runs
    copy_checkpoint(tmp / "lora", 8, tmp / "resumed")
    result = in_process(run_distributed, *lora, "training.train_iters=16",
                        f"checkpoint.save={tmp / 'resumed'}",
                        f"logging.metrics_file={tmp / 'resumed.jsonl'}", name="resumed")
    assert f"the base weights from {tmp / 'base' / 'iter_0000006'}" in result.stdout, \
        result.stdout[-2000:]
    full, resumed = losses(tmp / "lora.jsonl"), losses(tmp / "resumed.jsonl")
    assert sorted(resumed) == list(range(9, 17))
    assert {it: full[it] for it in resumed} == resumed  # bit for bit


def test_lora_adapters_reshard_tp2_tp1_tp2(lora_runs, run_distributed):
    """Iteration 8 (TP 2: q / k / v's B whole on each rank) resumed at TP 1 x DP 2 to 12 (B one
    shard), then at TP 2 to 16: the uninterrupted run's losses within 1e-4 (fp32; the TP and DP
    reductions sum in another order)."""
    tmp, _, lora = lora_runs
    copy_checkpoint(tmp / "lora", 8, tmp / "reshard")
    out = [f"checkpoint.save={tmp / 'reshard'}", f"logging.metrics_file={tmp / 'reshard.jsonl'}"]
    tp1 = in_process(run_distributed, *lora, *out, "training.train_iters=12",
                     "parallelism.tensor_model_parallel_size=1",
                     "parallelism.sequence_parallel=false", name="tp1")
    assert "TP 1 x PP 1 x DP 2" in tp1.stdout
    in_process(run_distributed, *lora, *out, "training.train_iters=16", name="tp2")
    full, resharded = losses(tmp / "lora.jsonl"), losses(tmp / "reshard.jsonl")
    assert sorted(resharded) == list(range(9, 17))
    for it, loss in resharded.items():
        assert loss == pytest.approx(full[it], abs=1e-4, rel=0), (it, resharded, full)


def test_a_changed_base_is_refused_in_one_line(lora_runs):
    """The base's iteration 6 replaced by its iteration 3 (a valid checkpoint, other weights):
    resuming the adapters is one line, exit code 2, nothing written."""
    tmp, _, lora = lora_runs
    copy_checkpoint(tmp / "lora", 16, tmp / "changed")
    base = tmp / "base" / "iter_0000006"
    base.rename(tmp / "base_6")
    try:
        shutil.copytree(tmp / "base" / "iter_0000003", base)
        result = quiet_torchrun(*lora, "training.train_iters=20",
                                f"checkpoint.save={tmp / 'changed'}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        (tmp / "base_6").rename(base)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1, result.stderr
    assert (f"the LoRA adapters in {tmp / 'changed' / 'iter_0000016'} were trained on the base "
            f"checkpoint {base} (iteration 6), which has changed since they were saved"
            in result.stderr), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert sorted(os.listdir(tmp / "changed")) == ["iter_0000016", TRACKER]


_PEFT_MODULE = {"self_attention.linear_qkv_lora": "self_attn",
                "self_attention.linear_proj_lora": "self_attn",
                "mlp.linear_fc1_lora": "mlp", "mlp.linear_fc2_lora": "mlp"}


def test_a_new_run_starts_from_a_peft_adapter(lora_runs, run_distributed):
    """The LoRA run's iteration-16 adapters written in PEFT's format by the test (the
    checkpoint's global tensors under transformers' module names); a new run over the same base
    with ``lora.init_from`` and lr 0 validates after its one step to the LoRA run's loss at 16."""
    from safetensors.torch import save_file

    tmp, _, lora = lora_runs
    adapter = tmp / "peft"
    adapter.mkdir()
    tensors = {}
    for key, value in gpt_layer_tensors(tmp / "lora" / "iter_0000016").items():
        if key.startswith("optimizer.") or ADAPTER not in key:
            continue
        local, _, rest = key.removeprefix("decoder.layers.").partition(".targets.")
        number, _, module = local.partition(".")
        if number.isdigit():  # HybridModel: a key per layer
            local, layers = module, [(int(number), value)]
        else:  # GPTModel: the layers stacked along a leading axis
            layers = enumerate(value)
        for layer, tensor in layers:
            tensors[f"base_model.model.model.layers.{layer}.{_PEFT_MODULE[local]}.{rest}.weight"] = (
                tensor.contiguous())
    save_file(tensors, adapter / "adapter_model.safetensors")
    targets = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": targets}))
    result = in_process(run_distributed, *lora, "training.train_iters=1", "optimizer.lr=0",
                        "optimizer.lr_warmup_iters=0",
                        "optimizer.min_lr=0", f"lora.init_from={adapter}",
                        f"checkpoint.save={tmp / 'from_peft'}",
                        f"logging.metrics_file={tmp / 'from_peft.jsonl'}", name="from_peft")
    assert f"LoRA adapters from {adapter}" in result.stdout, result.stdout[-2000:]
    started, trained = (valid_losses(tmp / f"{n}.jsonl") for n in ("from_peft", "lora"))
    assert started[1] == pytest.approx(trained[16], abs=1e-6, rel=0), (started, trained)


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=-2"], "lora.rank must be an integer >= 0, got -2"),
    (["lora.targets=q_proj w_proj"], "lora.targets: unknown target(s) ['w_proj']"),
    (["lora.rank=8", "lora.init_from=/no/adapter"],
     "lora.init_from: /no/adapter is not a PEFT adapter (no adapter_config.json"),
])
def test_lora_config_errors_name_the_field(overrides, message, capsys):
    """The launcher's --check in this process (the same main() torchrun's ranks call; a process
    per case would spend its time importing megatron)."""
    from mcore_ext.training import main

    code = main(["--config", TINY, *overrides, "--check", "--world-size", "2"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in err and err.count("\n") == 1, err
    assert "Traceback" not in err + out


# ------------------------------------------------ experts and MTP: EP 2 -> EP 1, in process

MOE_LORA = ["--config", str(ROOT / "configs" / "step35_moe_tiny_cpu.yaml"), "data.source=mock",
            "parallelism.expert_model_parallel_size=2", "training.eval_interval=null",
            "logging.log_interval=1", "optimizer.lr_warmup_iters=1", "checkpoint.save_interval=2",
            "training.global_batch_size=4"]


def _moe_lora_runs(tmp):
    """configs/step35_moe_tiny_cpu.yaml (MoE layers 2-4 with a shared expert, 1 MTP layer) at
    EP 2: a base run of 2 steps; a LoRA run over it (every target, routed experts included) of 4
    steps saving at 2 and 4; its iteration 2 resumed at EP 1 to 4 (saving at 3 and 4); that
    run's iteration 3 resumed at EP 2 to 4."""
    from tests.functional.inprocess import launch

    base = launch(*MOE_LORA, "training.train_iters=2", f"checkpoint.save={tmp / 'base'}",
                  "checkpoint.load=null")
    lora = [*MOE_LORA, f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
            "model.moe_router_bias_update_rate=0",
            "lora.rank=4", "lora.alpha=8", "optimizer.lr=1e-2", "optimizer.lr_decay_style=constant",
            "lora.targets=[all-linear,experts.gate_up_proj,experts.down_proj]",
            "training.train_iters=4"]
    full = launch(*lora, f"checkpoint.save={tmp / 'lora'}",
                  f"logging.metrics_file={tmp / 'lora.jsonl'}")
    if base["code"] or full["code"]:
        return base, full
    if torch.distributed.get_rank() == 0:
        copy_checkpoint(tmp / "lora", 2, tmp / "ep1")
    torch.distributed.barrier()
    # Saving at 3 and 4: its iteration 3 (EP 1) goes back to EP 2 for step 4.
    ep1 = launch(*lora, "parallelism.expert_model_parallel_size=1", "checkpoint.save_interval=1",
                 f"checkpoint.save={tmp / 'ep1'}", f"logging.metrics_file={tmp / 'ep1.jsonl'}")
    if ep1["code"]:
        return base, full, ep1
    if torch.distributed.get_rank() == 0:
        copy_checkpoint(tmp / "ep1", 3, tmp / "ep2")
    torch.distributed.barrier()
    ep2 = launch(*lora, f"checkpoint.save={tmp / 'ep2'}",
                 f"logging.metrics_file={tmp / 'ep2.jsonl'}")
    return base, full, ep1, ep2


def test_expert_and_mtp_adapters_reshard_ep2_ep1_ep2(run_distributed, tmp_path):
    """The adapters-only checkpoint of a LoRA run at EP 2 (each routed expert's A and B saved
    along the global expert axis, the shared expert's and the MTP layer's beside them, no frozen
    weight) resumes at EP 1, and the EP 1 run's checkpoint at EP 2 (each rank its half of the
    experts' adapters and Adam state), with the uninterrupted run's losses within 1e-4 (fp32;
    the expert gradients are reduced in another order)."""
    from tests.functional.inprocess import losses as read_losses

    for result in run_distributed(_moe_lora_runs, tmp_path, world_size=2, timeout=600)[0]:
        assert result["code"] == 0, result
    tensors = checkpoint_tensors(tmp_path / "lora" / "iter_0000004")
    weights = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    assert weights and all(ADAPTER in k for k in weights), sorted(weights)[:5]
    experts = {k: v for k, v in weights.items() if ".experts.linear_fc" in k}
    # 3 MoE layers x (fc1, fc2) x (A, B), each of the 8 experts its own along the expert axis
    assert len(experts) == 12 and all(v.shape[0] == 8 for v in experts.values()), \
        {k: v.shape for k, v in experts.items()}
    assert any(k.startswith("mtp.") for k in weights), sorted(weights)
    assert any("shared_experts.linear_fc1_lora" in k for k in weights), sorted(weights)
    full, resumed = read_losses(tmp_path / "lora.jsonl"), read_losses(tmp_path / "ep1.jsonl")
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4], (full, resumed)
    back = read_losses(tmp_path / "ep2.jsonl")
    assert sorted(back) == [4], back
    for it, loss in [*resumed.items(), *back.items()]:
        assert loss == pytest.approx(full[it], abs=1e-4, rel=0), (it, resumed, back, full)
    # The EP 1 checkpoint holds the experts' adapters whole, as the EP 2 run's.
    ep1 = checkpoint_tensors(tmp_path / "ep1" / "iter_0000003")
    assert all(ep1[k].shape == v.shape for k, v in experts.items())


# ------------------------------------ PP 2: resume, PP 2 -> PP 1 / TP 2, PEFT's format, in process

# The dense Step-3.5 miniature (4 layers of both kinds; a layout hf export writes), made tinier.
PP_LORA = ["--config", str(ROOT / "configs" / "step35_tiny_cpu.yaml"), "data.source=mock",
           "model.seq_length=32", "training.micro_batch_size=2", "training.global_batch_size=4",
           "training.eval_interval=null", "optimizer.lr_warmup_iters=0", "logging.log_interval=1",
           "logging.metrics_file=null", "parallelism.tensor_model_parallel_size=1",
           "parallelism.pipeline_model_parallel_size=2", "checkpoint.save_interval=2"]


def _hf(*argv) -> dict:
    """``python -m mcore_ext.hf ARGV`` on this rank, its output captured."""
    import contextlib
    import io

    from mcore_ext.hf.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _pp_lora_runs(tmp):
    """configs/step35_tiny_cpu.yaml (made tinier) at TP 1 x PP 2, two layers a stage: a base
    run of 2 steps; a LoRA run over it (every target) of 4 steps saving at 2 and 4, evaluated at
    4; its iteration 2 resumed at PP 2, at PP 1 x DP 2, at TP 2 and at CP 2; its iteration 4's adapters
    exported in PEFT's format at PP 2 and at PP 1; a new PP 2 run started from them (lr 0)."""
    from tests.functional.inprocess import launch

    rank0 = torch.distributed.get_rank() == 0
    results = {"base": launch(*PP_LORA, "training.train_iters=2", f"checkpoint.save={tmp / 'base'}",
                              "checkpoint.load=null")}
    lora = [*PP_LORA, f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
            "lora.rank=4", "lora.alpha=8", "optimizer.lr=1e-2", "optimizer.lr_decay_style=constant",
            "training.train_iters=4"]
    results["lora"] = launch(*lora, f"checkpoint.save={tmp / 'lora'}", "training.eval_interval=4",
                             f"logging.metrics_file={tmp / 'lora.jsonl'}")
    for name, layout in (("pp2", []), ("pp1", ["parallelism.pipeline_model_parallel_size=1"]),
                         ("tp2", ["parallelism.pipeline_model_parallel_size=1",
                                  "parallelism.tensor_model_parallel_size=2"]),
                         ("cp2", ["parallelism.pipeline_model_parallel_size=1",
                                  "parallelism.context_parallel_size=2"])):
        if any(r["code"] for r in results.values()):
            return results
        if rank0:
            copy_checkpoint(tmp / "lora", 2, tmp / name)
        torch.distributed.barrier()
        results[name] = launch(*lora, *layout, f"checkpoint.save={tmp / name}",
                               f"logging.metrics_file={tmp / f'{name}.jsonl'}")
    for pp in (2, 1):
        results[f"export_pp{pp}"] = _hf("export", tmp / "lora", tmp / f"peft_pp{pp}", "--adapter",
                                        "--pp", pp)
    results["from_peft"] = launch(*lora, "training.train_iters=1", "optimizer.lr=0",
                                  "optimizer.min_lr=0", "training.eval_interval=1", f"lora.init_from={tmp / 'peft_pp2'}",
                                  f"checkpoint.save={tmp / 'from_peft'}",
                                  f"logging.metrics_file={tmp / 'from_peft.jsonl'}")
    return results


@pytest.fixture(scope="module")
def pp_lora_runs(run_distributed_shared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_pp")
    results = run_distributed_shared(_pp_lora_runs, tmp, world_size=2, timeout=600)
    return tmp, results


def test_pp2_lora_trains_adapters_only_and_resumes_exactly(pp_lora_runs):
    """At PP 2 each stage trains its layer's adapters (both stages' are saved, no frozen weight)
    and the iteration-2 adapters resume to the uninterrupted run's losses bit for bit."""
    from tests.functional.inprocess import losses as read_losses

    tmp, results = pp_lora_runs
    for name in ("base", "lora", "pp2"):
        assert all(r[name]["code"] == 0 for r in results), [r[name] for r in results]
    assert "TP 1 x PP 2 x DP 1" in results[0]["lora"]["stdout"], results[0]["lora"]["stdout"]
    weights = {k: v for k, v in gpt_layer_tensors(tmp / "lora" / "iter_0000004").items()
               if not k.startswith("optimizer.")}
    # 4 layers (keys per layer: the kinds' shapes differ) x 8 targets x (A, B): both stages'
    # layers, every B trained away from zero.
    assert len(weights) == 64 and all(ADAPTER in k for k in weights), sorted(weights)
    assert {k.split(".")[2] for k in weights} == {"0", "1", "2", "3"}, sorted(weights)
    assert all(v.abs().amax() > 0 for k, v in weights.items() if k.endswith("lora_B")), weights
    full, resumed = read_losses(tmp / "lora.jsonl"), read_losses(tmp / "pp2.jsonl")
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4], (full, resumed)
    assert {it: full[it] for it in resumed} == resumed  # bit for bit


@pytest.mark.parametrize("name, layout", [("pp1", "TP 1 x PP 1 x DP 2"),
                                          ("tp2", "TP 2 x PP 1 x DP 1"),
                                          ("cp2", "TP 1 x CP 2 x PP 1 x DP 1")])
def test_pp2_adapters_resume_at_another_layout(pp_lora_runs, name, layout):
    """The PP 2 run's iteration-2 adapters resumed at PP 1 x DP 2, at TP 2 x PP 1 and at CP 2
    (full and sliding layers: the halo exchange with adapters on q / k / v / g_proj): the
    uninterrupted run's losses of steps 3-4 within 1e-4 (fp32; reductions in another order)."""
    from tests.functional.inprocess import losses as read_losses

    tmp, results = pp_lora_runs
    assert all(r[name]["code"] == 0 for r in results), [r[name] for r in results]
    assert layout in results[0][name]["stdout"], results[0][name]["stdout"]
    full, resumed = read_losses(tmp / "lora.jsonl"), read_losses(tmp / f"{name}.jsonl")
    assert sorted(resumed) == [3, 4], resumed
    for it, loss in resumed.items():
        assert loss == pytest.approx(full[it], abs=1e-4, rel=0), (it, resumed, full)


def test_pp2_adapters_in_peft_format(pp_lora_runs):
    """``hf export --adapter`` at PP 2 writes the PP 1 export's files (every stage's layers, the
    checkpoint's tensors under transformers' names), and a new PP 2 run started from them
    (``lora.init_from``, lr 0) validates to the LoRA run's loss at step 4."""
    from safetensors.torch import load_file

    tmp, results = pp_lora_runs
    for name in ("export_pp2", "export_pp1", "from_peft"):
        assert all(r[name]["code"] == 0 for r in results), [r[name] for r in results]
    pp2, pp1 = (load_file(tmp / f"peft_pp{pp}" / "adapter_model.safetensors") for pp in (2, 1))
    assert sorted(pp2) == sorted(pp1) and all(torch.equal(pp2[k], pp1[k]) for k in pp1)
    for key, value in gpt_layer_tensors(tmp / "lora" / "iter_0000004").items():
        if key.startswith("optimizer."):
            continue
        layer, _, local = key.removeprefix("decoder.layers.").partition(".")
        local, _, rest = local.partition(".targets.")
        peft = f"base_model.model.model.layers.{layer}.{_PEFT_MODULE[local]}.{rest}.weight"
        assert torch.equal(pp2.pop(peft), value), peft
    assert not pp2, sorted(pp2)
    assert json.loads((tmp / "peft_pp2" / "adapter_config.json").read_text()) == json.loads(
        (tmp / "peft_pp1" / "adapter_config.json").read_text())
    started, trained = (valid_losses(tmp / f"{n}.jsonl") for n in ("from_peft", "lora"))
    assert list(started) == [1] and list(trained) == [4], (started, trained)
    assert started[1] == pytest.approx(trained[4], abs=1e-6, rel=0), (started, trained)


def _pp_mtp_export(tmp):
    """configs/step35_mtp_tiny_cpu.yaml (2 MTP depths, on the last stage) at TP 1 x PP 2: a LoRA
    run of 1 step from scratch, its adapters exported in PEFT's format at PP 2."""
    from tests.functional.inprocess import launch

    run = launch("--config", ROOT / "configs" / "step35_mtp_tiny_cpu.yaml", *PP_LORA[2:],
                 "training.train_iters=1", "checkpoint.save_interval=1", "checkpoint.load=null",
                 f"checkpoint.save={tmp / 'mtp'}", "lora.rank=4")
    if run["code"]:
        return run
    return _hf("export", tmp / "mtp", tmp / "peft", "--adapter", "--pp", 2)


@pytest.mark.slow
def test_pp2_export_of_mtp_adapters_writes_them_beside_the_peft_files(run_distributed,
                                                                      tmp_path):
    """The MTP layers' adapters (no module in transformers' model) are on the last stage only;
    ``--adapter`` at PP 2 writes them beside the PEFT files (mtp_adapter_model.safetensors, both
    depths as layers num_layers + k), said once; the decoder's file holds every stage's layers
    and no MTP layer (before issue 44 the export was refused)."""
    import yaml
    from safetensors.torch import load_file

    results = run_distributed(_pp_mtp_export, tmp_path, world_size=2, timeout=600)
    assert [r["code"] for r in results] == [0, 0], results
    said = "".join(r["stdout"] for r in results).count("the MTP layers' adapters are in")
    assert said == 1, [r["stdout"] for r in results]
    n = yaml.safe_load(open(ROOT / "configs" / "step35_mtp_tiny_cpu.yaml"))["model"]["num_layers"]
    layer = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.")
    mtp = {int(layer.match(k)[1]) for k in load_file(tmp_path / "peft" /
                                                      "mtp_adapter_model.safetensors")}
    main = {int(layer.match(k)[1]) for k in load_file(tmp_path / "peft" /
                                                       "adapter_model.safetensors")}
    assert mtp == {n, n + 1} and main == set(range(n)), (mtp, main)


# ------------------------------------------- chat data: LoRA over the SFT recipe, in process

SFT_LORA = ["--config", str(ROOT / "configs" / "step35_sft_tiny_cpu.yaml"),
            f"data.path={ROOT / 'configs' / 'sft_tiny' / 'chat.jsonl'}",
            f"data.tokenizer={ROOT / 'configs' / 'sft_tiny' / 'tokenizer'}",
            "training.eval_interval=null", "logging.log_interval=1", "checkpoint.save_interval=2",
            "optimizer.lr_warmup_iters=0"]


def _sft_lora_runs(tmp):
    """The chat recipe (TP 2 + SP, MoE, one MTP depth, packed conversations, answer-only loss): a
    base run of 2 steps; a LoRA run over it (every linear target) of 4 steps saving at 2 and 4;
    its iteration 2 resumed to 4."""
    from mcore_ext.data import chat
    from tests.functional.inprocess import launch

    chat._FILES.clear()  # each start reads the cache, not an earlier test's memo
    cache = f"data.cache_dir={tmp / 'cache'}"  # not the checkout's runs/data/cache
    base = launch(*SFT_LORA, cache, "training.train_iters=2", f"checkpoint.save={tmp / 'base'}",
                  "checkpoint.load=null")
    lora = [*SFT_LORA, cache, f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
            "model.moe_router_bias_update_rate=0", "lora.rank=4", "lora.alpha=8",
            "lora.targets=all-linear", "optimizer.lr=1e-2", "optimizer.lr_decay_style=constant",
            "training.train_iters=4"]
    full = launch(*lora, f"checkpoint.save={tmp / 'lora'}",
                  f"logging.metrics_file={tmp / 'lora.jsonl'}")
    if base["code"] or full["code"]:
        return base, full
    if torch.distributed.get_rank() == 0:
        copy_checkpoint(tmp / "lora", 2, tmp / "resumed")
    torch.distributed.barrier()
    resumed = launch(*lora, f"checkpoint.save={tmp / 'resumed'}",
                     f"logging.metrics_file={tmp / 'resumed.jsonl'}")
    return base, full, resumed


# LoRA's exact resume: test_lora_run_resumes_exactly_from_its_adapters (and PP 2's); packed chat
# data's: tests/functional/test_sft.py (the recipe); the two together here
@pytest.mark.slow
def test_lora_fine_tunes_packed_chat_data_and_resumes_exactly(run_distributed, tmp_path):
    """LoRA on the SFT data path: the recipe's packed conversations train the adapters only (the
    checkpoint holds adapters, no frozen weight), the loss on the answers falls, and the
    iteration-2 adapters resume to the uninterrupted run's main and MTP losses bit for bit."""
    results = run_distributed(_sft_lora_runs, tmp_path, world_size=2, timeout=600)[0]
    for result in results:
        assert result["code"] == 0, result
    base, full, resumed = results
    assert "(packed)" in full["stdout"] and "TP 2 x PP 1 x DP 1" in full["stdout"], full["stdout"]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the conversations, cached once
    weights = {k: v for k, v in checkpoint_tensors(tmp_path / "lora" / "iter_0000004").items()
               if not k.startswith("optimizer.")}
    assert weights and all(ADAPTER in k for k in weights), sorted(weights)[:5]
    assert any(k.startswith("mtp.") for k in weights), sorted(weights)
    records = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text()
                      .splitlines() if '"train"' in line] for name in ("lora", "resumed")}
    full_losses = {r["iteration"]: (r["loss"], r.get("mtp_losses")) for r in records["lora"]}
    resumed_losses = {r["iteration"]: (r["loss"], r.get("mtp_losses")) for r in records["resumed"]}
    assert sorted(full_losses) == [1, 2, 3, 4] and sorted(resumed_losses) == [3, 4], records
    assert full_losses[4][0] < full_losses[1][0], full_losses
    assert resumed_losses == {it: full_losses[it] for it in (3, 4)}  # bit for bit


# ---------------------------------------------------------------- bf16 (Float16Module), in process

def _bf16_lora_run(tmp, steps, lr):
    """The tinier config in bf16 on one rank: a base run of 2 steps, then LoRA over it for
    ``steps`` at ``lr``, each evaluated at its end (its first evaluation: the same validation
    batches). Returns both runs' results and what the LoRA run's model and optimizer held: the
    trained parameters and their optimizer copies, and which weights moved during training."""
    from megatron.core.utils import unwrap_model

    from mcore_ext.training import checkpointing
    from tests.functional.inprocess import TINY_MOCK, launch

    common = [*TINY_MOCK, "training.precision=bf16", "checkpoint.save_interval=100",
              "parallelism.tensor_model_parallel_size=1", "training.eval_iters=4"]
    base = launch(*common, "training.train_iters=2", "training.eval_interval=2",
                  f"checkpoint.save={tmp / 'base'}", "checkpoint.load=null",
                  f"logging.metrics_file={tmp / 'base.jsonl'}")
    seen = {}
    load = checkpointing.load_checkpoint

    def loading(cfg, model, optimizer, *args, **kwargs):  # the run's model as it starts
        out = load(cfg, model, optimizer, *args, **kwargs)
        seen.update(model=model, optimizer=optimizer, start={
            name: p.detach().clone() for name, p in unwrap_model(model).named_parameters()})
        return out

    checkpointing.load_checkpoint = loading
    try:
        lora = launch(*common, f"training.train_iters={steps}", f"training.eval_interval={steps}",
                      f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
                      "lora.rank=4", f"optimizer.lr={lr}", "optimizer.lr_decay_style=constant",
                      f"checkpoint.save={tmp / 'lora'}",
                      f"logging.metrics_file={tmp / 'lora.jsonl'}")
    finally:
        checkpointing.load_checkpoint = load
    model = unwrap_model(seen["model"])
    names = {id(p): name for name, p in model.named_parameters()}
    # megatron's mixed-precision optimizers (one per parameter kind: a ChainedOptimizer): the
    # bf16 parameters each steps, and the fp32 main copies it steps them from.
    parts = getattr(seen["optimizer"], "chained_optimizers", [seen["optimizer"]])
    trained = sorted(names[id(p)] for part in parts for group in part.float16_groups
                     for p in group)
    main_dtypes = {p.dtype for part in parts for group in part.fp32_from_float16_groups
                   for p in group}
    moved = sorted(name for name, p in model.named_parameters()
                   if not torch.equal(p.detach(), seen["start"][name]))
    zero_b = sorted(name for name, p in model.named_parameters()
                    if name.endswith("lora_B") and not p.detach().abs().amax(-1).min() > 0)
    model_dtypes = {p.dtype for p in model.parameters()}
    return base, lora, dict(trained=trained, main_dtypes=main_dtypes, moved=moved,
                            zero_b=zero_b, model_dtypes=model_dtypes)


def test_lora_learns_on_a_bf16_checkpoint_and_trains_adapters_only(run_distributed, tmp_path):
    """In bf16 (megatron's Float16Module and its mixed-precision optimizer) the adapters are what
    the optimizer trains, from fp32 main copies: every adapter weight moves, every base weight
    stays bit for bit what the base checkpoint holds, and the validation loss on the same batches
    falls (issue 58: the GPU test read training losses of different batches). The fine-tune's
    non-strict load of the base weights must not need Float16Module.load_state_dict's result
    (it returns nothing)."""
    base, lora, held = run_distributed(_bf16_lora_run, tmp_path, 8, 1e-2, world_size=1)[0]
    assert base["code"] == 0, base
    assert lora["code"] == 0, lora["code"]
    assert "LoRA adapter parameters trained, r 4" in lora["stdout"], lora["stdout"][-2000:]
    assert held["model_dtypes"] == {torch.bfloat16}
    assert held["trained"] and all(ADAPTER in n for n in held["trained"]), held["trained"][:5]
    assert held["main_dtypes"] == {torch.float32}
    # Every adapter moved (A and B, every target and layer: B from its zero start), nothing else.
    assert held["moved"] == held["trained"], sorted(set(held["moved"]) ^ set(held["trained"]))
    assert held["zero_b"] == []
    # The same validation batches (each run's first evaluation), on the frozen base and after
    # 8 LoRA steps: lower by a margin (measured 5.795 -> 5.619; the training losses, of other
    # batches each step, rose 5.38 -> 5.57 meanwhile). The loss is fp32 (Float16Module returns
    # fp32 logits); one bf16 rounding of the weights' update would be far below 0.1.
    base_valid = valid_losses(tmp_path / "base.jsonl")
    lora_valid = valid_losses(tmp_path / "lora.jsonl")
    assert list(base_valid) == [2] and list(lora_valid) == [8]
    assert lora_valid[8] < base_valid[2] - 0.1, (base_valid, lora_valid)
    assert sorted(losses(tmp_path / "lora.jsonl")) == list(range(1, 9))
    tuned = checkpoint_tensors(tmp_path / "lora" / "iter_0000008")
    weights = [k for k in tuned if not k.startswith("optimizer.")]
    assert weights and all(ADAPTER in k for k in weights), weights[:5]


# ------------------------------------------------------------ HybridModel: train and export

def _hybrid_lora_exports(tmp):
    """The dense Step-3.5 miniature as a HybridModel on one rank: a base run of 1 step; LoRA
    over it for 1 step; the base and the LoRA run exported (merged), and the LoRA run's adapters
    alone."""
    from tests.functional.inprocess import launch

    common = [*PP_LORA, "parallelism.pipeline_model_parallel_size=1", "model.architecture=hybrid",
              "training.train_iters=1", "checkpoint.save_interval=1"]
    runs = dict(base=launch(*common, f"checkpoint.save={tmp / 'base'}", "checkpoint.load=null"))
    runs["lora"] = launch(*common, f"checkpoint.load={tmp / 'base'}", "checkpoint.finetune=true",
                          "lora.rank=4", "lora.alpha=8", "lora.targets=all-linear",
                          "optimizer.lr=0.05", f"checkpoint.save={tmp / 'lora'}")
    for name, ckpt, extra in (("hf_base", "base", []), ("hf_lora", "lora", []),
                              ("peft", "lora", ["--adapter"])):
        if any(r["code"] for r in runs.values()):
            break
        runs[name] = _hf("export", tmp / ckpt, tmp / name, *extra)
    return runs


def test_hybrid_lora_run_exports_its_adapters_and_the_merged_model(run_distributed, tmp_path):
    """A LoRA run on HybridModel exports as a GPT one does. Its adapters in PEFT's format are the
    checkpoint's tensors under transformers' names (hybrid layer 2i's attention and 2i + 1's MLP
    are GPT layer i). The merged export's linears are the base export's plus (alpha / r) B A,
    from those PEFT tensors (fp32: 1e-6)."""
    from safetensors.torch import load_file

    runs = run_distributed(_hybrid_lora_exports, tmp_path, world_size=1)[0]
    assert all(r["code"] == 0 for r in runs.values()), {k: r for k, r in runs.items()
                                                        if r["code"]}
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    tuned = {k: v for k, v in checkpoint_tensors(tmp_path / "lora" / "iter_0000001").items()
             if not k.startswith("optimizer.")}
    assert tuned and all(ADAPTER in k for k in tuned), sorted(tuned)[:5]
    for key, value in tuned.items():
        layer, _, local = key.removeprefix("decoder.layers.").partition(".")
        local, _, rest = local.partition(".targets.")
        name = f"base_model.model.model.layers.{int(layer) // 2}.{_PEFT_MODULE[local]}.{rest}.weight"
        assert torch.equal(peft.pop(name), value), name
    assert not peft, sorted(peft)

    def weights(folder):
        return {k: v for f in sorted((tmp_path / folder).glob("*.safetensors"))
                for k, v in load_file(f).items()}

    base, merged = weights("hf_base"), weights("hf_lora")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    moved = 0
    for name, a in peft.items():
        if ".lora_A." not in name:
            continue
        b = peft[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        expected = base[target] + (8 / 4) * b @ a
        assert (merged[target] - expected).abs().max().item() <= 1e-6, target
        moved += not torch.equal(merged[target], base[target])
    assert moved > 0 and sorted(base) == sorted(merged)
