"""Fine-tuning an imported Step-3.5 on chat data, end to end, as README's "Fine-tune
Step-3.5-Flash" says: ``hf import`` of the tiny released-layout MoE + MTP model with the SFT
recipe's ChatML tokenizer beside it, the launcher on configs/sft_tiny/chat.jsonl from the config
``import`` wrote (README's overrides, at tiny size on 2 ranks), ``hf export``; transformers reads
the export and its greedy decoding of a trained prompt gives the token ids the project's own
greedy loop gives on the launcher checkpoint (~1.5 minutes on 2 busy cores).
"""

import json
import os
import shutil

import pytest
import torch
import yaml

from tests.functional.test_pretrain import ROOT, check, losses, torchrun
from tests.hf import models
from tests.hf.test_hf_checkpoint import _cli

TOKENIZER = ROOT / "configs" / "sft_tiny" / "tokenizer"
CHAT = ROOT / "configs" / "sft_tiny" / "chat.jsonl"
VOCAB = 259  # the ChatML tokenizer: 256 bytes and 3 special tokens
STEPS = 8
NEW_TOKENS = 8


def _hf_config():
    return models.tiny_moe_config(vocab_size=VOCAB, max_position_embeddings=128)


def _project_greedy(ckpt_dir, prompt, new_tokens):
    """Greedy decoding with the project's model on the launcher checkpoint (one process, TP 1):
    the model its config.yaml describes (GPTModel or HybridModel), loaded from the checkpoint;
    each step the argmax of the last position's logits over the tokenizer's rows is appended.
    (decoded ids, their logits)."""
    from megatron.core import dist_checkpointing

    import mcore_ext
    from mcore_ext import checkpoint
    from mcore_ext.checkpoint.directory import find_checkpoint
    from mcore_ext.run_config import ParallelismConfig, PretrainConfig, build
    from mcore_ext.run_config.megatron_configs import transformer_config

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    directory = find_checkpoint(ckpt_dir).directory
    with open(os.path.join(directory, "config.yaml")) as f:
        cfg = build(PretrainConfig, yaml.safe_load(f))
    cfg.parallelism = ParallelismConfig()  # the checkpoint's TP 2 + SP -> this process alone
    config = transformer_config(cfg, use_cpu_initialization=True, perform_initialization=False)
    rows = dist_checkpointing.load_tensors_metadata(directory)["embedding.word_embeddings.weight"]
    build = {"gpt": mcore_ext.build_gpt_model,  # hybrid: hf import's default from 0.19
             "hybrid": mcore_ext.build_hybrid_model}[cfg.model.architecture]
    model = build(config, vocab_size=rows.global_shape[0],
                  max_sequence_length=cfg.model.seq_length, backend="sdpa",
                  share_embeddings_and_output_weights=False)
    loaded = checkpoint.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(ids.size(1))[None]
            logits = model(ids, positions, None)[..., :VOCAB]
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(ids, torch.arange(ids.size(1))[None], None)[..., :VOCAB]
    return ids[0].tolist(), logits


def _transformers_greedy(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(ids)
    return ids[0].tolist(), logits


def test_imported_step35_fine_tunes_on_chat_data_and_exports_what_transformers_decodes(
        run_distributed, tmp_path):
    from transformers import AutoTokenizer

    hf = tmp_path / "hf"
    models.save_moe(models.build_moe(_hf_config()), str(hf))
    for name in os.listdir(TOKENIZER):
        shutil.copyfile(TOKENIZER / name, hf / name)
    ckpt, run, out = tmp_path / "step35_ckpt", tmp_path / "ft", tmp_path / "HF_OUT"

    # README: python -m mcore_ext.hf import HF_DIR runs/step35_ckpt
    check(_cli("import", str(hf), str(ckpt), timeout=600), "import")
    imported = yaml.safe_load((ckpt / "iter_0000000" / "config.yaml").read_text())
    assert imported["model"]["seq_length"] == 128 and imported["model"]["mtp_num_layers"] == 1
    # README's SFT command, its overrides as written (the imported config names the copied
    # tokenizer), at tiny size on 2 ranks
    metrics = tmp_path / "metrics.jsonl"
    result = check(torchrun(
        "--config", str(ckpt / "iter_0000000" / "config.yaml"),
        "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
        "data.source=chat", f"data.path={CHAT}", f"checkpoint.load={ckpt}",
        "checkpoint.finetune=true", f"checkpoint.save={run}",
        "training.micro_batch_size=2", "training.global_batch_size=4",
        f"training.train_iters={STEPS}", "training.eval_interval=null", "optimizer.lr=3e-3",
        "optimizer.lr_warmup_iters=2", "logging.log_interval=1",
        f"logging.metrics_file={metrics}"), "launcher")
    assert "finetune: loaded the model weights" in result.stdout
    assert f"{CHAT}: 256 conversations" in result.stdout and "(packed)" in result.stdout
    loss = losses(metrics)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < 0.8 * loss[1], loss
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(len(r["mtp_losses"]) == 1 for r in records if r["kind"] == "train")
    # README: python -m mcore_ext.hf export runs/ft HF_OUT
    check(_cli("export", str(run), str(out), timeout=600), "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == VOCAB and exported["num_nextn_predict_layers"] == 1
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()

    # transformers reads the released MoE names through the Step-3.7 conversion mapping only:
    # the main layers renamed by released_tensors' inverse (as test_hf_moe does)
    after = models.read_tensors(str(out))
    model = models.build_moe(_hf_config())
    model.load_state_dict(models.transformers_tensors(after, len(models.MOE_TYPES)), strict=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    conversation = json.loads(CHAT.read_text().splitlines()[0])  # trained: in the train split
    text = tokenizer.apply_chat_template([{"role": "user", "content": conversation["prompt"]}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]  # as mcore_ext.data.chat
    theirs, their_logits = _transformers_greedy(model, prompt, NEW_TOKENS)
    [(ours, our_logits)] = run_distributed(_project_greedy, str(run), prompt, NEW_TOKENS,
                                           world_size=1)
    assert ours == theirs, (tokenizer.decode(ours), tokenizer.decode(theirs))
    assert len(ours) == len(prompt) + NEW_TOKENS
    # the same logits behind them, fp32 (imported parity is 1e-5; trained weights are larger)
    assert (our_logits - their_logits).abs().max().item() < 1e-4
    original = models.build_moe(_hf_config())
    untrained, _ = _transformers_greedy(original, prompt, NEW_TOKENS)
    assert untrained != ours  # the decoding is the fine-tuned model's
