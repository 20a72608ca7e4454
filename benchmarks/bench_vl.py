#!/usr/bin/env python
"""A Step-3.7 vision-language SFT step, the project's and transformers', side by side on the CPU:
the same tiny model and batch, the same loss, the step times and the vision tower's share.

The model: a random ``Step3p7ForConditionalGeneration`` made by transformers (fp32; the text
model full and sliding layers, MoE layers with a shared expert unless ``--dense``; a vision tower
of ``--vision-layers`` layers of width ``--vision-hidden``, its position table laid out for
``--image-size`` pixels), saved and loaded by ``mcore_ext.hf.load_pretrained(vision=...)`` (the
HybridModel ``hf import`` writes, wrapped as the launcher wraps it: megatron's DDP and
optimizer, Adam). The batch: ``--conversations`` image-caption conversations of
configs/vl_tiny/captions.jsonl rendered by the repository's tiny Step-3.7 processor at
``--image-size`` (global views) and half of it (local crops; an elongated image has two), one per
row, right-padded; the loss is the mean cross-entropy over the answers' tokens (transformers'
labels: -100 elsewhere).

Variants (tower frozen, the launcher's default, and trained; the projector and text model train
in both): ``mcore`` (the project's step: forward with the images, the masked mean loss, backward,
DDP's gradient sync, the optimizer's step) and ``hf`` (transformers' forward with ``labels``,
backward, torch's AdamW step). Reported:

    first loss    each variant's loss on the batch before any update, and its difference to
                  transformers' (the same weights and batch: the same loss within fp32 rounding)
    step          the median step time over ``--rounds`` interleaved rounds (every variant once a
                  round, the order rotated), and mcore / hf for each tower setting: wall time,
                  and the process's CPU time (all threads; less moved by other jobs sharing
                  the machine)
    tower         the median time of the tower alone on the batch's views (global views and
                  crops; its backward too when trained), measured in the same rounds, and its
                  share of that variant's step

    python benchmarks/bench_vl.py                      # ~1-2 minutes on 2 CPU cores
    python benchmarks/bench_vl.py --image-size 448 --vision-layers 8 --rounds 5
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

VL_TINY = os.path.join(ROOT, "configs", "vl_tiny")
VARIANTS = ("mcore frozen", "hf frozen", "mcore trained", "hf trained")


def hf_config(args):
    from transformers import Step3p7Config, Step3p7TextConfig, Step3p7VisionConfig

    layers = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    moe = {} if args.dense else dict(
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=args.hidden, share_expert_dim=args.hidden,
        moe_router_scaling_factor=2.5)
    text = Step3p7TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, num_sliding_attention_heads=8, sliding_window=32,
        layer_types=layers, rope_theta=[10000.0, 500.0, 500.0, 10000.0],
        partial_rotary_factors=[0.5, 1.0, 1.0, 0.5], max_position_embeddings=512,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **({"mlp_layer_types": ["dense"] * 4} if args.dense else moe))
    vision = Step3p7VisionConfig(
        hidden_size=args.vision_hidden, num_hidden_layers=args.vision_layers,
        num_attention_heads=args.vision_hidden // 32, image_size=args.image_size, patch_size=14,
        mlp_ratio=4.0)
    return Step3p7Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         tie_word_embeddings=False, image_token_id=args.image_token)


def processor(args):
    """The tiny processor's tokenizer and chat template, its image processor at
    ``--image-size`` (local crops of half of it)."""
    from transformers import AutoProcessor, Step3p7ImageProcessor, Step3p7Processor

    tiny = AutoProcessor.from_pretrained(os.path.join(VL_TINY, "processor"), local_files_only=True)
    images = Step3p7ImageProcessor(size={"height": args.image_size, "width": args.image_size},
                                   patch_size=args.image_size // 2)
    return Step3p7Processor(image_processor=images, tokenizer=tiny.tokenizer,
                            chat_template=tiny.chat_template)


def batch_of(args, proc) -> dict:
    """The rendered conversations: input_ids [b, s], the images, and the answers' positions
    (``answer``: a bool [b, s], True at the tokens the loss predicts)."""
    from PIL import Image

    with open(os.path.join(VL_TINY, "captions.jsonl")) as f:
        conversations = [json.loads(line)["messages"] for _, line in
                         zip(range(args.conversations), f)]
    images = []
    for messages in conversations:
        with Image.open(os.path.join(VL_TINY, messages[0]["content"][0]["path"])) as image:
            images.append(image.convert("RGB"))
    texts = [proc.apply_chat_template(c, tokenize=False) for c in conversations]
    out = proc(text=texts, images=images, padding=True, return_tensors="pt")
    ids, real = out["input_ids"], out["attention_mask"].sum(1)
    answer = torch.zeros_like(ids, dtype=torch.bool)
    for row, (messages, image) in enumerate(zip(conversations, images)):
        prompt = proc.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        start = proc(text=[prompt], images=[image], return_tensors="pt")["input_ids"].size(1)
        answer[row, start:real[row]] = True
    return {"input_ids": ids, "answer": answer, **{k: out[k] for k in (
        "pixel_values", "pixel_values_local", "num_local_patches")}}


IMAGES = ("pixel_values", "pixel_values_local", "num_local_patches")


class Mcore:
    """The project's model and optimizer, wrapped as the launcher wraps them."""

    def __init__(self, directory, freeze, lr):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from mcore_ext.hf import load_pretrained
        from mcore_ext.hf.config.step3p7 import vision_config

        with open(os.path.join(directory, "config.json")) as f:
            vision = vision_config(json.load(f), freeze=freeze)
        model = load_pretrained(directory, architecture="hybrid", backend="sdpa", vision=vision)
        self.module = model
        self.model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0), [self.model])
        self.trained_tower = not freeze

    def step(self, batch) -> float:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        ids = batch["input_ids"]
        labels = torch.roll(ids, -1, dims=1)
        mask = torch.roll(batch["answer"], -1, dims=1)  # position t predicts token t + 1
        mask[:, -1] = False
        losses = self.model(ids, torch.arange(ids.size(1)).expand_as(ids), None, labels=labels,
                            **{k: batch[k] for k in IMAGES})
        loss = (losses.float() * mask).sum() / mask.sum()
        loss.backward()
        self.model.finish_grad_sync()
        self.optimizer.step()
        return loss.item()

    def tower(self, batch) -> None:
        tower = self.module.vision_model
        run(tower, batch, self.trained_tower)


class HF:
    """transformers' model and torch's AdamW (the tower frozen by requires_grad)."""

    def __init__(self, directory, freeze, lr):
        from transformers import Step3p7ForConditionalGeneration

        self.model = Step3p7ForConditionalGeneration.from_pretrained(directory,
                                                                     dtype=torch.float32)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            tensor.data = tensor.data.clone()  # torch's own memory, not the file's mmap
        self.model.model.vision_model.requires_grad_(not freeze)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        self.trained_tower = not freeze

    def step(self, batch) -> float:
        self.optimizer.zero_grad()
        labels = batch["input_ids"].masked_fill(~batch["answer"], -100)
        out = self.model(input_ids=batch["input_ids"], labels=labels,
                         **{k: batch[k] for k in IMAGES})
        out.loss.backward()
        self.optimizer.step()
        return out.loss.item()

    def tower(self, batch) -> None:
        tower = self.model.model.vision_model
        run(lambda x: tower(x).last_hidden_state, batch, self.trained_tower)


def run(tower, batch, trained: bool) -> None:
    """The tower on the batch's global views and crops, as the model's forward runs it; with
    ``trained`` its backward too (a fixed weighting of the features)."""
    with torch.set_grad_enabled(trained):
        outs = [tower(batch["pixel_values"])]
        if batch["pixel_values_local"] is not None and batch["pixel_values_local"].numel():
            outs.append(tower(batch["pixel_values_local"]))
        if trained:
            sum(o.sum() for o in outs).backward()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="text model width")
    parser.add_argument("--dense", action="store_true", help="dense text layers (no MoE)")
    parser.add_argument("--vision-hidden", type=int, default=256, help="tower width")
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224,
                        help="global view's side in pixels (a multiple of 56; crops: half)")
    parser.add_argument("--conversations", type=int, default=8, help="rows of the batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    args.vocab, args.image_token = 265, 259  # the tiny processor's tokenizer, <im_patch>

    import mcore_ext
    from transformers import Step3p7ForConditionalGeneration

    torch.manual_seed(0)
    proc = processor(args)
    batch = batch_of(args, proc)
    with tempfile.TemporaryDirectory() as directory:
        Step3p7ForConditionalGeneration(hf_config(args)).save_pretrained(directory)
        mcore_ext.init_parallel()
        with mcore_ext.cuda_to_cpu():  # megatron's optimizers make .cuda() tensors (no-op on GPUs)
            built = {v: (Mcore if v.startswith("mcore") else HF)(
                directory, v.endswith("frozen"), args.lr) for v in VARIANTS}
            first = {v: built[v].step(batch) for v in VARIANTS}
            # wall and process CPU time (all threads: less moved by other jobs on the machine)
            steps = {v: {"wall": [], "cpu": []} for v in VARIANTS}
            towers = {v: {"wall": [], "cpu": []} for v in VARIANTS}
            for r in range(args.rounds):
                for v in VARIANTS[r % 4:] + VARIANTS[:r % 4]:
                    start = (time.perf_counter(), time.process_time())
                    built[v].step(batch)
                    middle = (time.perf_counter(), time.process_time())
                    built[v].tower(batch)
                    end = (time.perf_counter(), time.process_time())
                    for i, clock in enumerate(("wall", "cpu")):
                        steps[v][clock].append(middle[i] - start[i])
                        towers[v][clock].append(end[i] - middle[i])
        mcore_ext.destroy_parallel()

    views = batch["pixel_values"].size(0) + batch["pixel_values_local"].size(0)
    print(f"[bench_vl] text hidden {args.hidden}, 4 layers ({'dense' if args.dense else 'MoE 8 x top-2'}); "
          f"tower {args.vision_layers} x {args.vision_hidden}, {args.image_size} px views and "
          f"{args.image_size // 2} px crops; batch {tuple(batch['input_ids'].shape)}, {views} "
          f"views, {int(batch['answer'].sum())} answer tokens; fp32, {args.rounds} rounds, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    median = statistics.median
    for v in VARIANTS:
        reference = "hf" + v[v.index(" "):]
        line = f"  {v:13s} first loss {first[v]:.7f} (hf {first[v] - first[reference]:+.1e})"
        for clock in ("wall", "cpu"):
            step, tower = median(steps[v][clock]), median(towers[v][clock])
            ratio = step / median(steps[reference][clock])
            line += (f"  {clock}: step {step * 1e3:7.0f} ms x{ratio:.3f}, tower "
                     f"{tower * 1e3:6.0f} ms ({tower / step:.1%})")
        print(line)


if __name__ == "__main__":
    main()
