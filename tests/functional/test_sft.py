"""Fine-tuning on chat data through the launcher: configs/step35_sft_tiny_cpu.yaml as written (the
tiny Step-3.5 with MoE + MTP, TP 2 + SP, packed conversations of configs/sft_tiny) on 2 gloo
ranks through torchrun, shortened to 8 steps and saving at 4 (~1 minute on 2 busy cores), then
resumed from its step-4 checkpoint at TP 2 and at TP 1 x DP 2 to step 8, and at TP 1 x DP 2 with
EP 2 and with micro-batches of 1 row to step 6, in the tests' gloo ranks (the launcher's
``main``, tests/functional/inprocess.py); a bad line of chat data under torchrun
is one error before training; the recipe at CP 2 trains; the recipe at PP 2 trains and resumes
exactly, also at PP 1, and a PP 1 checkpoint resumes at PP 2 (in the tests' ranks); at CP 2 x
PP 2 and EP 2 x PP 2 (-m slow) it trains and resumes exactly; pretraining text with
data.document_masking trains.
"""

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest

from tests.functional.inprocess import completed, launch
from tests.functional.test_pretrain import (ROOT, TINY, TRACKER, check, check_exact_resume,
                                            losses, torchrun)

RECIPE = str(ROOT / "configs" / "step35_sft_tiny_cpu.yaml")
STEPS = 8


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, run_distributed_shared):
    """The recipe for 8 steps (checkpoints at 4 and 8) through torchrun; a copy of its step-4
    checkpoint resumed at the same layout, and the step-4 checkpoint resumed at TP 1 x DP 2 (no
    SP), both to 8, and at TP 1 x DP 2 with EP 2 and with micro-batches of 1 row, to 6, as the
    launcher's ``main`` in the tests' 2 gloo ranks (no torchrun's imports per run:
    tests/functional/inprocess.py)."""
    tmp = tmp_path_factory.mktemp("sft")
    out = {"tmp": tmp}
    out["full"] = check(torchrun(*_recipe_args(tmp, "full"), f"checkpoint.save={tmp / 'ckpt'}",
                                 "checkpoint.load=null"), "full")
    resumed = tmp / "resumed"
    shutil.copytree(tmp / "ckpt" / "iter_0000004", resumed / "iter_0000004")
    (resumed / TRACKER).write_text("4")
    for name, result in run_distributed_shared(_resumed_recipe_runs, tmp, world_size=2,
                                               timeout=600)[0].items():
        out[name] = check(completed(result), name)
    return out


def _recipe_args(tmp, name):
    return ["--config", RECIPE, "model.architecture=gpt", f"training.train_iters={STEPS}",
            "training.eval_interval=8", "logging.attention_probe=4",
            "logging.log_interval=1", "checkpoint.save_interval=4",
            f"data.cache_dir={tmp / 'cache'}", f"logging.metrics_file={tmp / name}.jsonl"]


def _resumed_recipe_runs(tmp):
    """``tp1``, ``ep2``, ``micro1`` and ``same`` of ``recipe_runs`` on this rank, from the
    checkout as torchrun runs (the recipe names its data relative to it); ``same`` last, as it
    saves into the directory the others load."""
    from mcore_ext.data import chat

    chat._FILES.clear()  # each start reads the cache, not an earlier test's memo
    resumed = tmp / "resumed"
    tp1 = ["parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false"]
    with contextlib.chdir(ROOT):
        return {
            "tp1": launch(*_recipe_args(tmp, "tp1"), "checkpoint.save=null",
                          f"checkpoint.load={resumed}", *tp1),
            # Steps 5 and 6 only (training.exit_interval keeps the LR schedule of 8 steps).
            **{name: launch(*_recipe_args(tmp, name), "checkpoint.save=null",
                            f"checkpoint.load={resumed}", *tp1, change,
                            "training.exit_interval=6")
               for name, change in (("ep2", "parallelism.expert_model_parallel_size=2"),
                                    ("micro1", "training.micro_batch_size=1"))},
            "same": launch(*_recipe_args(tmp, "same"), f"checkpoint.save={resumed}",
                           f"checkpoint.load={resumed}"),
        }


def test_recipe_fine_tunes_packed_conversations_and_loss_falls(recipe_runs):
    tmp_path, metrics = recipe_runs["tmp"], recipe_runs["tmp"] / "full.jsonl"
    out = recipe_runs["full"].stdout
    assert "configs/sft_tiny/chat.jsonl: 256 conversations" in out, out
    # tokenized once (rank 0), cached; the resumed runs read the cache: the same counts line
    assert out.count("tokenized conversations cached in") == 1, out
    summary = [line for line in out.splitlines() if "256 conversations" in line]
    for later in ("same", "tp1"):
        assert "tokenized conversations cached in" not in recipe_runs[later].stdout
        assert [line for line in recipe_runs[later].stdout.splitlines()
                if "256 conversations" in line] == summary
    assert out.count("[data] train: ") == 1 and "(packed)" in out, out
    loss = losses(metrics)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < 0.9 * loss[1], loss
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    mtp = [r["mtp_losses"][0] for r in records if r["kind"] == "train"]
    assert mtp[-1] < mtp[0], mtp  # the MTP depth trains on the packed documents too
    assert any(r["kind"] == "valid" for r in records)
    assert (tmp_path / "ckpt" / TRACKER).read_text() == str(STEPS)


def test_resumed_sft_run_reproduces_the_uninterrupted_losses(recipe_runs):
    """Same layout: the same packed rows in the same order (sample k = iteration x global batch
    on), weights, Adam, schedule and RNG -> the same floats, the main and the MTP loss."""
    tmp = recipe_runs["tmp"]
    full = [json.loads(line) for line in (tmp / "full.jsonl").read_text().splitlines()]
    same = [json.loads(line) for line in (tmp / "same.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in same if r["kind"] == "train"] == list(range(5, STEPS + 1))
    for kind in ("train", "valid"):
        tail = [(r["iteration"], r["loss"], r.get("mtp_losses")) for r in full
                if r["kind"] == kind and r["iteration"] > 4]
        assert tail and tail == [(r["iteration"], r["loss"], r.get("mtp_losses")) for r in same
                                 if r["kind"] == kind], (kind, full, same)
    out = recipe_runs["same"].stdout
    assert "resumed from" in out and "(iteration 4)" in out and "RNG not restored" not in out


def test_sft_checkpoint_at_tp2_resumes_at_tp1(recipe_runs):
    """TP 2 + SP -> TP 1 x DP 2: the same rows reach the same losses up to the order of fp32
    reductions (TP's partial sums, DP's gradient average)."""
    full = losses(recipe_runs["tmp"] / "full.jsonl")
    tp1 = losses(recipe_runs["tmp"] / "tp1.jsonl")
    assert sorted(tp1) == list(range(5, STEPS + 1))
    for step in range(5, STEPS + 1):
        assert tp1[step] == pytest.approx(full[step], abs=1e-4, rel=0), (step, tp1, full)
    assert "TP 1 x PP 1 x DP 2" in recipe_runs["tp1"].stdout


def test_sft_checkpoint_resumes_at_expert_parallel_2_and_at_micro_batch_1(recipe_runs):
    """The step-4 checkpoint at TP 1 x DP 2 with one more change each, to step 6, against the
    TP 1 x DP 2 resume (EP 1, micro-batches of 2 rows). EP 2 (each MoE layer's 4 experts 2 per
    rank, tokens exchanged by alltoall): the same main and MTP losses of steps 5 and 6 within
    1e-5 (fp32 sums in another order; the same floats at step 5 measured, 2e-7 apart at 6).
    Micro-batches of 1 row (4 a step): the same 8 rows make up step 5, so its main loss is the
    same within 1e-5 (the same float measured); megatron weighs each micro-batch's MTP loss by
    its own loss tokens over its rolled ones and computes the balancing loss per micro-batch, so
    the logged MTP loss and the update move a little with the split: step 5's MTP loss and step
    6's losses within 1e-3 (9e-5 and 4e-5 apart measured)."""
    tp1 = _train_losses(recipe_runs["tmp"] / "tp1.jsonl")
    change = "(iteration 4, layout {'tp': 2, 'pp': 1, 'dp': 1} -> {'tp': 1, 'pp': 1, 'dp': 2}"
    for name in ("ep2", "micro1"):
        assert change in recipe_runs[name].stdout, recipe_runs[name].stdout
    assert "(experts: EP 2)" in recipe_runs["ep2"].stdout
    assert "micro 1 x DP 2 x 4 micro-batches" in recipe_runs["micro1"].stdout
    _same_losses(_train_losses(recipe_runs["tmp"] / "ep2.jsonl"), tp1, steps=(5, 6))
    micro1 = _train_losses(recipe_runs["tmp"] / "micro1.jsonl")
    assert sorted(micro1) == [5, 6], micro1
    assert micro1[5][0] == pytest.approx(tp1[5][0], abs=1e-5, rel=0), (micro1, tp1)
    for got, want in ((micro1[5][1], tp1[5][1]), (micro1[6][0], tp1[6][0]),
                      (micro1[6][1], tp1[6][1])):
        assert got == pytest.approx(want, abs=1e-3, rel=0), (micro1, tp1)


def _probe_records(path) -> dict:
    return {r["iteration"]: r for r in map(json.loads, Path(path).read_text().splitlines())
            if r["kind"] == "probe"}


def _same_probe_figures(got, want, where, tol=1e-5):
    """Every figure of two probe records (nested per layer, per head) within ``tol``."""
    for key, value in want.items():
        if key in ("iteration", "time_s"):
            continue
        if isinstance(value, dict):
            assert got[key].keys() == value.keys(), (where, key)
            _same_probe_figures(got[key], value, f"{where}/{key}", tol)
        elif isinstance(value, (list, float)):
            assert got[key] == pytest.approx(value, abs=tol, rel=tol), (where, key)
        else:
            assert got[key] == value, (where, key)


def test_attention_probe_gives_the_same_figures_at_every_layout(recipe_runs):
    """logging.attention_probe=4 on packed conversations (Step-3.5: full and sliding layers, the
    gate, MoE, the MTP depth): the step-4 weights, measured by the uninterrupted TP 2 + SP run
    after its step 4 and by every run resumed from its checkpoint before its first step (TP 2 +
    SP again; TP 1 x DP 2, where the first replica measures; EP 2), give the same figures: the
    first token's and each document's first token's share, the sink rate, every head's share,
    gate and output maximum, the residual and attention maxima, per layer and MTP depth (fp32,
    1e-5: reductions in another order; the same run resumed: the same floats)."""
    tmp = recipe_runs["tmp"]
    full = _probe_records(tmp / "full.jsonl")
    assert sorted(full) == [0, 4, 8], full
    at4 = full[4]
    assert list(at4["layers"]) == ["1", "2", "3", "4", "mtp0"], at4["layers"].keys()
    assert 0 < at4["doc_first_token_share"] and 0 < at4["first_token_share"] < 1, at4
    assert all(len(f["gate_mean_per_head"]) == 6 for k, f in at4["layers"].items()
               if k != "1")  # the sliding layers' 6 heads (the full layer has 4)
    out = recipe_runs["full"].stdout
    assert "[probe] iteration 0 | sink share " in out, out
    assert f"| sink share {at4['first_token_share']:.3f} rate {at4['sink_rate']:.2f}" in out
    same = _probe_records(tmp / "same.jsonl")
    assert sorted(same) == [4, 8], same
    for step in (4, 8):  # the exact resume measures the same floats
        _same_probe_figures(same[step], full[step], f"same {step}", tol=0)
    for name in ("tp1", "ep2"):
        _same_probe_figures(_probe_records(tmp / f"{name}.jsonl")[4], at4, name)


def test_bad_chat_line_under_torchrun_is_one_error_before_training(tmp_path):
    data = tmp_path / "chat.jsonl"
    good = json.dumps({"prompt": "Q", "completion": "A"})
    data.write_text(f"{good}\n{good}\n{{'role': 'user'}}\n")
    result = torchrun("--config", RECIPE, f"data.path={data}", f"data.cache_dir={tmp_path / 'c'}",
                      f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.load=null")
    assert result.returncode != 0
    both = result.stdout + result.stderr
    assert both.count(f"error: {data}:3: not JSON") == 1, result.stderr[-3000:]
    assert 'launch/pretrain.py", line' not in both and "[train]" not in both  # no rank traceback
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "c").exists()  # nor a cache
    assert Path(data).read_text().count("\n") == 3  # the user's file is left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]  # nothing beside it


@pytest.mark.parametrize("layout", [
    [],
    pytest.param(["parallelism.tensor_model_parallel_size=1",
                  "parallelism.pipeline_model_parallel_size=2"], marks=pytest.mark.slow),
], ids=["tp2", "pp2"])
def test_document_masking_trains_text_as_packed_documents(run_distributed, tmp_path, layout):
    """configs/tiny_cpu.yaml at TP 2 on short documents (several per 128-token sample), each
    attending only to itself; at TP 1 x PP 2 (-m slow) the stages exchange each micro-batch of
    8 samples as one [1024, 1, h] THD sequence. The launcher's ``main`` in the tests' gloo
    ranks (tests/functional/inprocess.py)."""
    from mcore_ext.data.preprocess import preprocess

    texts = tmp_path / "docs.jsonl"
    texts.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                             for i in range(400)))
    preprocess([str(texts)], str(tmp_path / "docs"))
    metrics = tmp_path / "metrics.jsonl"
    check(completed(run_distributed(
        launch, "--config", TINY, "data.source=files", f"data.prefix={tmp_path / 'docs'}",
        "data.document_masking=true", "training.train_iters=6", "training.eval_interval=null",
        "optimizer.lr_warmup_iters=2", "logging.log_interval=1", "checkpoint.save=null",
        "checkpoint.load=null", f"logging.metrics_file={metrics}", *layout, world_size=2,
        timeout=600)[0]), "document_masking")
    loss = losses(metrics)
    assert sorted(loss) == list(range(1, 7)) and loss[6] < loss[1], loss


def test_recipe_at_context_parallel_2_trains_packed_conversations(tmp_path):
    """The recipe at CP 2 (TP 1, 2 ranks): every conversation padded to 2 x CP slots and split
    per document over the ranks, the sliding layers' halo and the full layer's all-gather with
    documents, MoE and the MTP depth; 4 steps (~1 minute), the loss falls."""
    metrics = tmp_path / "metrics.jsonl"
    result = check(torchrun("--config", RECIPE, "parallelism.tensor_model_parallel_size=1",
                            "parallelism.sequence_parallel=false",
                            "parallelism.context_parallel_size=2", "training.train_iters=4",
                            "optimizer.lr_warmup_iters=2",
                            "training.eval_interval=null", "logging.log_interval=1",
                            "checkpoint.save=null", "checkpoint.load=null",
                            f"logging.metrics_file={metrics}"), "cp2")
    assert "world 2 = TP 1 x CP 2 x PP 1 x DP 1" in result.stdout, result.stdout
    loss = losses(metrics)
    assert sorted(loss) == [1, 2, 3, 4] and loss[4] < loss[1], loss
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(math.isfinite(r["mtp_losses"][0]) for r in records if r["kind"] == "train")


def _train_losses(path):
    """{iteration: (loss, MTP losses)} of a run's training steps."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: (r["loss"], r["mtp_losses"]) for r in records if r["kind"] == "train"}


def _pipeline_args(tmp_path, *layout):
    """The recipe at TP 1 and ``layout`` (PP 2 and the global batch in it), lr 6e-3 after 2
    warmup steps, 6 steps."""
    return ["--config", RECIPE, "model.architecture=gpt",
            "parallelism.tensor_model_parallel_size=1",
            "parallelism.sequence_parallel=false", *layout, "training.train_iters=6",
            "optimizer.lr_warmup_iters=2", "optimizer.lr=6e-3", "training.eval_interval=null",
            "logging.log_interval=1", f"data.cache_dir={tmp_path / 'cache'}"]


def _pipeline_runs(tmp_path, layout):
    """On this rank, from the checkout (the recipe names its data relative to it): the recipe at
    ``layout`` saving at 3, then a copy of its step-3 checkpoint resumed to 6."""
    import torch.distributed as dist

    from mcore_ext.data import chat

    chat._FILES.clear()  # each start reads the cache, not an earlier test's memo
    common = [*_pipeline_args(tmp_path, *layout), "checkpoint.save_interval=3"]
    with contextlib.chdir(ROOT):
        full = launch(*common, f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.load=null",
                      f"logging.metrics_file={tmp_path / 'full.jsonl'}")
        if full["code"]:
            return full, None
        resumed = tmp_path / "resumed"
        if dist.get_rank() == 0:
            _checkpoint_copy(tmp_path / "ckpt", 3, resumed)
        dist.barrier()
        again = launch(*common, f"checkpoint.save={resumed}", f"checkpoint.load={resumed}",
                       f"logging.metrics_file={tmp_path / 'resumed.jsonl'}")
    return full, again


def _pipeline_run_and_resume(run_distributed, tmp_path, name, nproc, *layout):
    """``_pipeline_runs`` on ``nproc`` gloo ranks (the launcher's ``main`` in the tests' ranks:
    tests/functional/inprocess.py); the resume repeats steps 4-6 to the last bit
    (``check_exact_resume``). Returns the two runs."""
    full, again = run_distributed(_pipeline_runs, tmp_path, layout, world_size=nproc,
                                  timeout=600)[0]
    full = check(completed(full), name)
    assert all(math.isfinite(mtp[0]) for _, mtp in _train_losses(tmp_path / "full.jsonl").values())
    again = check(completed(again), f"{name} resumed")
    check_exact_resume(tmp_path, again, steps=6, saved_at=3)
    return full, again


def _checkpoint_copy(saved, iteration, to):
    """A copy of the checkpoint directory ``saved``'s ``iteration`` in ``to`` (its tracker
    naming it): a run resumed from it leaves the original as it was."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(saved / name, to / name)
    (to / TRACKER).write_text(str(iteration))
    return to


def _resumed_at(tmp_path, checkpoint, name, *layout):
    """The recipe at ``layout`` (2 micro-batches of 2 rows a step) from ``checkpoint`` to step 6,
    on this rank, from the checkout; its metrics in ``name``.jsonl."""
    from mcore_ext.data import chat

    chat._FILES.clear()
    with contextlib.chdir(ROOT):
        return launch(*_pipeline_args(tmp_path, "training.global_batch_size=4", *layout),
                      f"checkpoint.load={checkpoint}",
                      f"logging.metrics_file={tmp_path / name}.jsonl")


def _same_losses(got, expected, steps):
    """Main and MTP losses of ``steps`` within 1e-5 (the same rows; fp32 reductions in another
    order)."""
    assert sorted(got) == list(steps), got
    for step in steps:
        (loss, mtp), (want, want_mtp) = got[step], expected[step]
        assert loss == pytest.approx(want, abs=1e-5, rel=0), (step, got, expected)
        assert mtp == pytest.approx(want_mtp, abs=1e-5, rel=0), (step, got, expected)


def test_recipe_at_pipeline_parallel_2_resumes_exactly_and_across_pp1_both_ways(run_distributed,
                                                                                 tmp_path):
    """The recipe at TP 1 x PP 2 (layers 1-2 | 3-4, MoE on both stages, the MTP depth on the
    last): each packed micro-batch of 2 rows crosses the stages as one [256, 1, h] THD sequence,
    2 micro-batches per step through the 1F1B schedule. 6 steps saving at 3, then a copy of the
    step-3 checkpoint resumed to 6: the loss falls below 0.8 x its first (0.73 x measured) and
    steps 4-6 repeat to the last bit. The step-3 checkpoint also resumes at PP 1 (one process,
    the same 2 micro-batches of 2 rows): the PP 2 run's main and MTP losses of steps 4-6 (the
    same floats measured; 1e-5 allowed for the order of reductions). That PP 1 run saves at 4,
    and its PP 1 checkpoint resumes at PP 2 the other way: the PP 1 run's losses of steps 5-6,
    main and MTP (1e-5). All in the tests' gloo ranks (2, then 1, then 2)."""
    pp2 = ["parallelism.pipeline_model_parallel_size=2"]
    full, _ = _pipeline_run_and_resume(run_distributed, tmp_path, "pp2", 2, *pp2,
                                       "training.global_batch_size=4")
    assert "world 2 = TP 1 x PP 2 x DP 1" in full.stdout and "2 micro-batches" in full.stdout
    at_3 = _checkpoint_copy(tmp_path / "ckpt", 3, tmp_path / "at_pp1")
    pp1_saved = tmp_path / "pp1_ckpt"
    pp1 = check(completed(run_distributed(
        _resumed_at, tmp_path, at_3, "pp1", f"checkpoint.save={pp1_saved}",
        "checkpoint.save_interval=4", world_size=1, timeout=600)[0]), "pp1")
    assert "layout {'tp': 1, 'pp': 2, 'dp': 1} -> {'tp': 1, 'pp': 1, 'dp': 1}" in pp1.stdout
    at_pp1 = _train_losses(tmp_path / "pp1.jsonl")
    _same_losses(at_pp1, _train_losses(tmp_path / "full.jsonl"), steps=(4, 5, 6))

    at_4 = _checkpoint_copy(pp1_saved, 4, tmp_path / "at_pp2")
    back = run_distributed(_resumed_at, tmp_path, at_4, "pp2_again", *pp2,
                           "checkpoint.save=null", world_size=2, timeout=600)
    back = check(completed(back[0]), "pp2 from pp1")
    assert "layout {'tp': 1, 'pp': 1, 'dp': 1} -> {'tp': 1, 'pp': 2, 'dp': 1}" in back.stdout
    assert "world 2 = TP 1 x PP 2 x DP 1" in back.stdout
    _same_losses(_train_losses(tmp_path / "pp2_again.jsonl"), at_pp1, steps=(5, 6))


@pytest.mark.slow
@pytest.mark.parametrize("layout, world", [
    (["parallelism.context_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
      "training.global_batch_size=4"], "world 4 = TP 1 x CP 2 x PP 2 x DP 1"),
    (["parallelism.expert_model_parallel_size=2", "parallelism.pipeline_model_parallel_size=2",
      "training.global_batch_size=8"], "world 4 = TP 1 x PP 2 x DP 2 (experts: EP 2)"),
], ids=["cp2_pp2", "ep2_pp2"])
def test_recipe_at_4_rank_pipeline_layouts_trains_and_resumes_exactly(run_distributed, tmp_path,
                                                                     layout, world):
    """The recipe on 4 ranks, 2 micro-batches of 2 packed rows per step: CP 2 x PP 2 (each
    document split over the CP ranks on both stages, the THD micro-batch crossing the stages as
    [128, 1, h]) and EP 2 x PP 2 (DP 2; the 4 experts of each MoE layer 2 per rank on both
    stages, the MTP depth's MoE on the last). 6 steps saving at 3, the loss below 0.8 x its first
    (0.74 x and 0.73 x measured), steps 4-6 resumed from 3 to the last bit. ~150 CPU seconds
    each (both runs), hence slow."""
    full, _ = _pipeline_run_and_resume(run_distributed, tmp_path, world, 4, *layout)
    assert world in full.stdout and "2 micro-batches" in full.stdout, full.stdout
