#!/usr/bin/env python
"""Training state, step peak and step time of the same gated model four ways, side by side:

    gpt       GPTModel, every weight trained (full fine-tuning): the reference
    gpt-2     a second, identical GPTModel: the control (its ratio to gpt is the run's noise)
    hybrid    HybridModel of the same weights (issue 36: the migration promises no gain)
    lora      GPTModel with LoRA adapters on every linear target (``lora.targets: all-linear``),
              the base weights frozen (issue 35: the memory ratio is the point)

Each is built the launcher's way (``mcore_ext.training.loop.build_model``: the model in megatron's
DDP, LoRA applied before it; megatron's ``get_megatron_optimizer``, Adam) from one config, at TP 1
in one process; hybrid and lora start from gpt's weights (lora's B = 0), so all four compute the
same first loss (printed: the difference to gpt's). A step is forward, the mean loss over every
token, backward, DDP's gradient sync and the optimizer's step, on one fixed batch.

Reported per variant:

    state    bytes of the parameters, DDP's gradient buffers and the optimizer's state (Adam's
             two moments, and fp32 main copies in bf16) after the first step: what training
             holds between steps, and what LoRA cuts
    peak     torch's allocation peak of one step over what was allocated before it (CPU: the
             profiler's allocator events, ``mcore_ext.plan.measure.allocation_peak``; GPU:
             max_memory_allocated)
    time     the median step time over ``--rounds`` interleaved rounds (the variants' order
             rotates each round), and its ratio to gpt's median

    python benchmarks/bench_finetune.py                      # ~1 minute on 2 CPU cores
    python benchmarks/bench_finetune.py --hidden 512 --layers 8 --seq 512
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("gpt", "gpt-2", "hybrid", "lora")


def config_of(args, variant: str):
    """The launcher's config of ``variant`` (configs/tiny_cpu.yaml resized)."""
    from mcore_ext.run_config import PretrainConfig, build
    from mcore_ext.run_config.overrides import apply_overrides, read_yaml

    overrides = [
        f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={4 * args.hidden}",
        f"model.num_layers={args.layers}", f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.groups}", f"model.kv_channels={args.hidden // args.heads}",
        f"model.seq_length={args.seq}", f"training.precision={args.precision}",
        "parallelism.tensor_model_parallel_size=1", "parallelism.sequence_parallel=false",
    ]
    if variant == "hybrid":
        overrides.append("model.architecture=hybrid")
    if variant == "lora":
        overrides += [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}",
                      "lora.targets=all-linear"]
    return build(PretrainConfig, apply_overrides(
        read_yaml(os.path.join(ROOT, "configs", "tiny_cpu.yaml")), overrides))


def state_bytes(model, optimizer) -> dict:
    """What training holds between steps, by kind."""
    def size(t):
        return t.numel() * t.element_size()

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(b.grad_data) for b in [*model.buffers, *model.expert_parallel_buffers])
    optim = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            optim += sum(size(t) for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        for group in getattr(inner, "fp32_from_float16_groups", []):  # bf16's fp32 main copies
            optim += sum(size(p) for p in group)
    return {"params": params, "grads": grads, "optimizer": optim,
            "total": params + grads + optim}


def step(model, optimizer, batch) -> float:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = model(batch["tokens"], batch["positions"], None, labels=batch["labels"])
    loss = losses.float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    return loss.item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)

    import mcore_ext

    mcore_ext.init_parallel()
    with mcore_ext.cuda_to_cpu():  # megatron's optimizers make .cuda() tensors (no-op on GPUs)
        run(args)
    mcore_ext.destroy_parallel()


def run(args) -> None:
    import mcore_ext
    from megatron.core.optimizer import get_megatron_optimizer

    from mcore_ext.models.hybrid import copy_weights
    from mcore_ext.plan.measure import allocation_peak
    from mcore_ext.run_config.megatron_configs import optimizer_config
    from mcore_ext.training.loop import build_model

    vocab = 256
    built = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        cfg = config_of(args, variant)
        model = build_model(cfg, vocab)
        if variant == "hybrid":
            copy_weights(built["gpt"][0].module, model.module, to_hybrid=True)
        elif variant != "gpt":
            missing, unexpected = model.module.load_state_dict(
                built["gpt"][0].module.state_dict(), strict=False)
            assert not unexpected and all("_lora" in k or k.endswith("_extra_state")
                                          for k in missing), (missing, unexpected)
        built[variant] = (model, get_megatron_optimizer(optimizer_config(cfg), [model]))

    device = mcore_ext.device()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator)
    batch = {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
             "positions": torch.arange(args.seq).repeat(args.batch, 1).to(device)}

    first = {v: step(*built[v], batch) for v in VARIANTS}  # also creates the optimizer state
    state = {v: state_bytes(*built[v]) for v in VARIANTS}
    peak = {v: allocation_peak(lambda v=v: step(*built[v], batch), device)["peak"]
            for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS[r % 4:] + VARIANTS[:r % 4]:
            start = time.perf_counter()
            step(*built[v], batch)
            times[v].append(time.perf_counter() - start)

    print(f"[bench_finetune] hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
          f"{args.groups} groups, seq {args.seq} x batch {args.batch}, {args.precision}, LoRA "
          f"rank {args.rank}, {args.rounds} rounds, torch {torch.__version__} on {device}, "
          f"{torch.get_num_threads()} threads")
    mib = 2 ** 20
    reference = statistics.median(times["gpt"])
    for v in VARIANTS:
        s, median = state[v], statistics.median(times[v])
        print(f"  {v:7s} first loss {first[v]:.6f} (gpt {first[v] - first['gpt']:+.1e})  "
              f"state {s['total'] / mib:7.2f} MiB (params {s['params'] / mib:.2f}, grads "
              f"{s['grads'] / mib:.2f}, optimizer {s['optimizer'] / mib:.2f}) x"
              f"{s['total'] / state['gpt']['total']:.3f}  peak {peak[v] / mib:7.2f} MiB x"
              f"{peak[v] / peak['gpt']:.3f}  step {median * 1e3:7.1f} ms x{median / reference:.3f}")


if __name__ == "__main__":
    main()
