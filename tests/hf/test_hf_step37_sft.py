"""Fine-tuning Step-3.7-Flash on images through the launcher (issue 55, item 4), as README's
"Fine-tune Step-3.7-Flash on images" says: a random Step-3.7 release of the recipe's shapes
(tests/hf/models.save_step37_recipe: transformers' ``Step3p7ForConditionalGeneration`` with its
own initialisation, one MTP layer, the vl_tiny processor) imported with ``hf import --vision``
(TP 1) with a signing key, then trained on configs/vl_tiny/captions.jsonl at TP 2 + SP in the
tests' 2 gloo ranks (the launcher's ``main``: tests/functional/inprocess.py), each run signed
with the key and 4 steps long unless said:

- ``frozen``: README's command (the import's config.yaml: the tower frozen, its default);
- ``trained``: configs/step37_vl_sft_tiny_cpu.yaml from the import (``checkpoint.load``,
  ``checkpoint.finetune``: the recipe's model is the import's) with ``model.vision.freeze=false``,
  saving at 2 and 4; ``resumed``: the same run stopped at 2 (``training.exit_interval``) and
  started again; ``pp2`` and ``cp2``: the recipe at PP 2 and at CP 2, 2 steps;
- the trained step-4 checkpoint loaded into the launcher's model at TP 1 and at TP 2 + SP, its
  logits on a micro-batch of the captions with their images; then one byte of a tower tensor
  flipped (the manifest's checksums rewritten to match): the signed resume is refused;
- what is refused at start: image data for a model without a vision tower, text that holds the
  image placeholder for a vision-language model.

The run that learns through the images (``-m slow``) trains the recipe as written through
torchrun and compares its caption loss on the true pictures with configs/vl_tiny/mismatched.jsonl's
(the same captions under pictures of another shape and colour).
"""

import contextlib
import json

import pytest
import torch

from tests.functional.inprocess import ROOT, completed, launch, losses
from tests.functional.test_pretrain import check
from tests.hf import models

pytest.importorskip("transformers")
pytest.importorskip("torchvision", reason="the Step-3.7 image processor needs torchvision")
pytest.importorskip("PIL", reason="images are decoded with Pillow")

RECIPE = str(ROOT / "configs" / "step37_vl_sft_tiny_cpu.yaml")
CAPTIONS = ROOT / "configs" / "vl_tiny" / "captions.jsonl"
MISMATCHED = ROOT / "configs" / "vl_tiny" / "mismatched.jsonl"
STEPS = 4
TOWER = "vision_model."
PROJECTOR = "vision_projection."
LOGIT_TOL = 1e-5  # fp32, TP 2 + SP against TP 1 (the order of TP's partial sums)
PP2 = ["parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
       "parallelism.pipeline_model_parallel_size=2"]
CP2 = ["parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
       "parallelism.context_parallel_size=2"]


def _readme(tmp):
    """README's fine-tune command on the import (its config.yaml: the model with model.vision,
    the copied tokenizer and processor as data.tokenizer), as written."""
    return ["--config", tmp / "imported" / "iter_0000000" / "config.yaml",
            "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
            "data.source=chat", f"data.path={CAPTIONS.relative_to(ROOT)}",
            f"checkpoint.load={tmp / 'imported'}", "checkpoint.finetune=true"]


def _recipe(tmp):
    """The recipe from the import (its model section is the import's)."""
    return ["--config", RECIPE, f"checkpoint.load={tmp / 'imported'}",
            "checkpoint.finetune=true"]


def _short(tmp, name, command, *overrides):
    """``command`` at test size, saving to ``name`` at steps 2 and 4, signed."""
    return [*command, f"checkpoint.save={tmp / name}", f"checkpoint.key_file={tmp / 'key'}",
            f"data.cache_dir={tmp / 'cache'}", f"logging.metrics_file={tmp / name}.jsonl",
            "logging.log_interval=1", f"training.train_iters={STEPS}",
            "training.eval_interval=null", "checkpoint.save_interval=2", "optimizer.lr=3e-3",
            "optimizer.lr_warmup_iters=1", *overrides]


def _import(tmp):
    """README's ``python -m mcore_ext.hf import --vision HF_DIR CKPT`` (its ``main``; TP 1, here
    on 2 data-parallel ranks) of the random release, signed with the key."""
    from mcore_ext.checkpoint import signing
    from mcore_ext.hf.__main__ import main

    signing.use_key_file(str(tmp / "key"))
    try:
        code = main(["import", "--vision", str(tmp / "hf"), str(tmp / "imported")])
    finally:
        signing.use_key_file(None)
    assert code == 0, code


def _runs(tmp):
    """The runs of the module docstring on this rank: {name: launch result}, and the weights
    and logits of ``_state_and_logits``."""
    import torch.distributed as dist

    from mcore_ext.checkpoint import signing
    from mcore_ext.data import chat

    chat._FILES.clear()  # each start reads the cache, not an earlier test's memo
    _import(tmp)
    out = {}
    trained = "model.vision.freeze=false"
    try:
        with contextlib.chdir(ROOT):
            out["frozen"] = _ok(launch(*_short(tmp, "frozen", _readme(tmp))), "frozen")
            out["trained"] = _ok(launch(*_short(tmp, "trained", _recipe(tmp), trained)),
                                 "trained")
            out["stopped"] = _ok(launch(*_short(tmp, "resumed", _recipe(tmp), trained,
                                                "training.exit_interval=2")), "stopped")
            out["resumed"] = _ok(launch(*_short(tmp, "resumed", _recipe(tmp), trained)),
                                 "resumed")
            out["pp2"] = _ok(launch(*_short(tmp, "pp2", _recipe(tmp), *PP2,
                                            "training.train_iters=2")), "pp2")
            out["cp2"] = _ok(launch(*_short(tmp, "cp2", _recipe(tmp), *CP2,
                                            "training.train_iters=2")), "cp2")
            out["weights"] = {
                "imported": _state_and_logits(tmp, tmp / "imported" / "iter_0000000", 1)[0],
                "frozen": _state_and_logits(tmp, tmp / "frozen" / "iter_0000004", 1)[0],
                "resumed": _state_and_logits(tmp, tmp / "resumed" / "iter_0000004", 1)[0]}
            out["weights"]["trained"], out["tp1"] = _state_and_logits(
                tmp, tmp / "trained" / "iter_0000004", 1)
            out["tp2"] = _state_and_logits(tmp, tmp / "trained" / "iter_0000004", 2)[1]
            if dist.get_rank() == 0:
                out["tampered"] = _tamper(tmp / "trained" / "iter_0000004",
                                          "vision_model.decoder.layers.mlp.linear_fc1.weight")
            dist.barrier()
            out["refused"] = launch(*_short(tmp, "trained", _recipe(tmp), trained,
                                            "training.train_iters=6"))
            out["no_tower"] = launch(*_short(tmp, "no_tower", _recipe(tmp), "model.vision=null"))
            stray = tmp / "stray.jsonl"
            if dist.get_rank() == 0:  # text only: no processor reads it
                line = lambda text: json.dumps({"messages": [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "A token."}]}) + "\n"
                stray.write_text(line("What is this?") * 20 + line("What is <im_patch>?"))
            dist.barrier()
            out["stray"] = launch(*_short(tmp, "stray", _recipe(tmp), f"data.path={stray}"))
    finally:
        signing.use_key_file(None)  # main set the run's key in this process
    return out


def _ok(result, name):
    """A run that must finish: its output in the failure, here, where the later steps would
    only find its checkpoint missing."""
    check(completed(result), name)
    return result


def _tamper(directory, tensor):
    """One byte of ``tensor`` (layer 1's rows of a stacked tower tensor) flipped in its data file
    and the file's size, CRC32 and SHA-256 rewritten in the manifest, as one without the key
    can; returns the file changed."""
    from tests.hf.test_hf_step37_vision import flip_byte

    return flip_byte(str(directory), tensor)


def _micro_batch(tmp):
    """The first 2 rows of the captions (packed, with their images) as the launcher's DataLoader
    gives them."""
    import numpy
    from megatron.core.datasets.utils import Split
    from transformers import AutoTokenizer

    from mcore_ext.data.chat import ChatDataset, ChatDatasetConfig, load_chat_file
    from mcore_ext.training.data import collate_packed

    tokenizer = AutoTokenizer.from_pretrained(models.VL_TINY_PROCESSOR, local_files_only=True)
    chat_file = load_chat_file(str(CAPTIONS), tokenizer, 128, "assistant", "truncate",
                               cache_dir=str(tmp / "cache"))
    config = ChatDatasetConfig(random_seed=1, sequence_length=128, split="1,0,0", tokenizer=None,
                               hf_tokenizer=tokenizer)
    dataset = ChatDataset(chat_file, str(CAPTIONS), numpy.arange(len(chat_file)), None,
                          Split.train, config)
    return collate_packed([dataset[0], dataset[1]])


def _state_and_logits(tmp, directory, tp):
    """The launcher's model of the recipe (``model.vision.freeze=false``) at TP ``tp`` (+ SP at
    2) loaded from ``directory``: its vision parameters (whole at TP 1; None at TP 2) and its
    logits [1, t, vocab] on ``_micro_batch`` (transformers' image keywords)."""
    import mcore_ext
    from mcore_ext import checkpoint
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.training.config import load_config
    from mcore_ext.training.data import packed_seq_params
    from mcore_ext.training.loop import build_model, padded_vocab_size
    from tests.hf.test_hf_step37_vision import gather_vocab

    layout = [f"parallelism.tensor_model_parallel_size={tp}",
              f"parallelism.sequence_parallel={str(tp > 1).lower()}"]
    cfg = load_config(RECIPE, [*layout, "model.vision.freeze=false", "checkpoint.save=null",
                               "training.micro_batch_size=1",
                               "checkpoint.load=null", f"data.cache_dir={tmp / 'cache'}"],
                      world_size=2)
    batch = _micro_batch(tmp)
    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    try:
        with cuda_to_cpu():
            model = build_model(cfg, padded_vocab_size(models.VL_TINY_VOCAB, cfg)).module
        state = checkpoint.load({"model": model.sharded_state_dict()}, str(directory))
        model.load_state_dict(state["model"])
        model.eval()
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], None,
                           packed_seq_params=packed_seq_params(batch, "cpu"),
                           pixel_values=batch["pixel_values"],
                           pixel_values_local=batch.get("pixel_values_local"),
                           num_local_patches=batch["num_local_patches"])
        logits = gather_vocab(logits, models.VL_TINY_VOCAB)
        vision = None if tp > 1 else {
            n: p.detach().clone() for n, p in model.named_parameters()
            if n.startswith((TOWER, PROJECTOR))}
        return vision, logits
    finally:
        mcore_ext.destroy_parallel()


@pytest.fixture(scope="module")
def vl_runs(tmp_path_factory, run_distributed_shared):
    tmp = tmp_path_factory.mktemp("vl_sft")
    (tmp / "key").write_text("step37-sft-key\n")
    models.save_step37_recipe(str(tmp / "hf"))
    results = run_distributed_shared(_runs, tmp, world_size=2, timeout=900)
    return tmp, results


def test_imported_release_fine_tunes_on_images_at_tp2_sp_with_the_tower_frozen(vl_runs):
    """README's command on the import: the captions' loss falls in 4 steps at TP 2 + SP; the
    frozen tower's weights are the imported ones bit for bit, every projector tensor has
    moved."""
    tmp, results = vl_runs
    out = check(completed(results[0]["frozen"]), "frozen").stdout
    assert "finetune: loaded the model weights" in out, out
    assert f"{CAPTIONS.relative_to(ROOT)}: 384 conversations" in out and "384 images" in out
    assert "TP 2 x PP 1 x DP 1" in out
    loss = losses(tmp / "frozen.jsonl")
    assert sorted(loss) == list(range(1, STEPS + 1)) and loss[STEPS] < 0.9 * loss[1], loss
    weights = results[0]["weights"]
    imported, frozen = weights["imported"], weights["frozen"]
    assert sorted(imported) == sorted(frozen)
    tower = [n for n in imported if n.startswith(TOWER)]
    projector = [n for n in imported if n.startswith(PROJECTOR)]
    assert tower and projector
    assert [n for n in tower if not torch.equal(imported[n], frozen[n])] == []
    assert [n for n in projector if torch.equal(imported[n], frozen[n])] == []


def test_recipe_at_pp2_gives_the_images_to_the_first_stage(vl_runs):
    """At PP 2 (TP 1): the first stage's model gets the micro-batches' images (without them its
    placeholders would be refused); the first step's loss is the TP 2 +
    SP run's within fp32 rounding (the same 8 rows, the same weights)."""
    tmp, results = vl_runs
    out = check(completed(results[0]["pp2"]), "pp2").stdout
    assert "TP 1 x PP 2 x DP 1" in out, out
    pp2, tp2 = losses(tmp / "pp2.jsonl"), losses(tmp / "trained.jsonl")
    assert pp2[1] == pytest.approx(tp2[1], abs=1e-5, rel=0), (pp2, tp2)


def test_recipe_at_cp2_splits_the_tokens_and_keeps_the_images_whole(vl_runs):
    """At CP 2 (TP 1): every document padded to 4 slots and split over the 2 ranks, each rank's
    placeholders numbered among the whole micro-batch's by the model (one all-gather), the
    images whole on both; 2 steps train (a placeholder count that did not match its images'
    features on either rank would stop the run)."""
    tmp, results = vl_runs
    out = check(completed(results[0]["cp2"]), "cp2").stdout
    assert "CP 2 x PP 1" in out, out
    loss = losses(tmp / "cp2.jsonl")
    assert sorted(loss) == [1, 2] and loss[2] < loss[1], loss


def test_trained_tower_moves_and_resumes_bit_for_bit(vl_runs):
    """``model.vision.freeze=false``: every tower tensor moves; a run stopped at step 2 and
    started again logs the uninterrupted run's losses (main and MTP) to the last bit, and ends
    with its vision weights bit for bit."""
    tmp, results = vl_runs
    rank0 = results[0]
    for name in ("trained", "stopped", "resumed"):
        check(completed(rank0[name]), name)
    assert "resumed from" in rank0["resumed"]["stdout"]
    full = [json.loads(line) for line in (tmp / "trained.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp / "resumed.jsonl").read_text().splitlines()]
    tail = lambda records: [(r["iteration"], r["loss"], r["mtp_losses"]) for r in records
                            if r["kind"] == "train" and r["iteration"] > 2]
    assert len(tail(full)) == STEPS - 2 and tail(again) == tail(full), (full, again)
    weights = rank0["weights"]
    imported, trained, resumed = weights["imported"], weights["trained"], weights["resumed"]
    assert [n for n in imported if torch.equal(imported[n], trained[n])] == []
    assert [n for n in trained if not torch.equal(trained[n], resumed[n])] == []


def test_trained_vision_weights_reshard_tp2_to_tp1(vl_runs):
    """The TP 2 + SP checkpoint of the trained tower loads into the launcher's model at TP 1
    and at TP 2 + SP: the same logits on captions with their images within fp32 rounding."""
    _, results = vl_runs
    for rank in results:
        assert rank["tp1"].shape == rank["tp2"].shape
        assert (rank["tp1"] - rank["tp2"]).abs().max().item() < LOGIT_TOL
    assert torch.equal(results[0]["tp1"], results[1]["tp1"])


def test_signed_checkpoint_refuses_a_flipped_tower_byte(vl_runs):
    """The trained run's last checkpoint, one byte of a tower tensor flipped and the manifest's
    checksums rewritten to match: resuming it with the key is one error line, exit code 2."""
    _, results = vl_runs
    assert results[0]["tampered"].endswith(".distcp")
    refused = completed(results[0]["refused"])
    assert refused.returncode == 2, refused
    assert "error:" in refused.stderr and "signature does not verify" in refused.stderr, \
        refused.stderr


def test_images_and_the_model_must_agree_at_start(vl_runs):
    """Refused before training, in one error line, exit code 2: the captions (images) for the
    text model alone (``model.vision=null``); a conversation whose text writes the image
    placeholder, no image with it, for the vision-language model."""
    tmp, results = vl_runs
    no_tower, stray = completed(results[0]["no_tower"]), completed(results[0]["stray"])
    assert no_tower.returncode == 2 and stray.returncode == 2, (no_tower, stray)
    for result in (no_tower, stray):
        assert result.stderr.count("error:") == 1, result.stderr
    assert "configs/vl_tiny/captions.jsonl:1: the conversation has images, but the model has " \
        "no vision tower" in no_tower.stderr, no_tower.stderr
    assert "stray.jsonl:21: the conversation has no image but its text holds the image " \
        "placeholder (token 259)" in stray.stderr, stray.stderr
    assert not (tmp / "no_tower").exists() and not (tmp / "stray").exists()


# ------------------------------------------------------------------ learning through the images

SWAP_MARGIN = 0.15  # nats per caption token: mismatched.jsonl's loss above captions.jsonl's


def _caption_losses(run_dir, cache_dir):
    """The mean loss per caption token of the checkpoint in ``run_dir`` (the recipe's model,
    TP 2 + SP) on captions.jsonl and on mismatched.jsonl: every conversation of the file once,
    one a row (the same loss as packed: a document attends only to itself), 48 micro-batches of
    8 rows forward through the launcher's forward step (images and all)."""
    import numpy
    from megatron.core.datasets.utils import Split

    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.data.chat import ChatDataset, ChatDatasetConfig, load_chat_file
    from mcore_ext.data.tokenizers import load_tokenizer
    from mcore_ext.training import checkpointing, loop
    from mcore_ext.training.config import load_config
    from mcore_ext.training.data import batch_iterator

    with contextlib.chdir(ROOT):
        cfg = load_config(RECIPE, [f"checkpoint.load={run_dir}", "checkpoint.save=null",
                                   "checkpoint.finetune=true", "logging.metrics_file=null",
                                   f"data.cache_dir={cache_dir}"], world_size=2)
    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    out = []
    try:
        with cuda_to_cpu():
            tokenizer = load_tokenizer(cfg.data.tokenizer)
            model = loop.build_model(cfg, loop.padded_vocab_size(tokenizer.vocab_size, cfg))
            checkpointing.load_checkpoint(cfg, model, None, None, vocab_size=tokenizer.vocab_size)
            model.eval()
            for path in (str(CAPTIONS), str(MISMATCHED)):
                chat_file = load_chat_file(path, tokenizer.hf, cfg.model.seq_length, "assistant",
                                           "truncate", cache_dir=str(cache_dir))
                config = ChatDatasetConfig(random_seed=1, sequence_length=cfg.model.seq_length,
                                           split="1,0,0", tokenizer=None,
                                           hf_tokenizer=tokenizer.hf, pack=False)
                dataset = ChatDataset(chat_file, path, numpy.arange(len(chat_file)), None,
                                      Split.train, config)
                iterator = batch_iterator(dataset, cfg)
                total = count = 0.0
                with torch.no_grad():
                    for _ in range(len(dataset) // cfg.training.micro_batch_size):
                        per_token, reduce = loop._forward_step(iterator, model)
                        loss_sum, tokens, _ = reduce(per_token)
                        total, count = total + float(loss_sum), count + float(tokens)
                out.append(total / count)
    finally:
        mcore_ext.destroy_parallel()
    return out


@pytest.mark.slow
def test_recipe_learns_to_read_the_pictures(tmp_path, run_distributed):
    """configs/step37_vl_sft_tiny_cpu.yaml as written through torchrun (200 steps at TP 2 + SP,
    the tower frozen: about 4 minutes on 2 busy cores): the loss falls below a tenth of its
    first, and the trained model's caption loss with the true pictures is below the same
    captions' under pictures of another shape and colour (mismatched.jsonl) by SWAP_MARGIN per
    caption token: a model that did not read the pictures would score both alike (measured over
    3 seeds: docs/training.md)."""
    from tests.functional.test_pretrain import torchrun

    metrics = tmp_path / "metrics.jsonl"
    result = check(torchrun("--config", RECIPE, f"checkpoint.save={tmp_path / 'ckpt'}",
                            "checkpoint.load=null", f"data.cache_dir={tmp_path / 'cache'}",
                            f"logging.metrics_file={metrics}", timeout=1800), "recipe")
    assert "384 images" in result.stdout
    loss = losses(metrics)
    # the recipe logs every 5 iterations (and the first)
    assert sorted(loss) == [1, *range(5, 201, 5)] and loss[200] < 0.1 * loss[1], loss
    results = run_distributed(_caption_losses, tmp_path / "ckpt", tmp_path / "cache",
                              world_size=2, timeout=900)
    (true, swapped), other = results
    assert other == [true, swapped]
    assert swapped - true > SWAP_MARGIN, (true, swapped)
