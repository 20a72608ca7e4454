"""The gate rows under the launcher's bf16 training path, at the 1B config's layer shapes.

configs/gpt_1b.yaml trains in bf16 with megatron's distributed optimizer: linear_qkv's gate rows
are bf16 rows of a fused weight whose gradient megatron's DDP accumulates in an fp32 buffer
(``main_grad``) and whose fp32 master copy the optimizer shards and steps. Checked here against a
per-parameter reference written from the gate's formula (independent of megatron's fused path):

    d loss / d w_gate_h = sum_t <d loss / d gated_t,h , attn_t,h> s_t,h (1 - s_t,h) x_t,
    s = sigmoid(x w_gate^T + b_gate)

with attn, x and d loss / d gated read off the model by hooks, then one AdamW step of the gate
rows against ``torch.optim.AdamW`` on that reference gradient.
"""

import torch

from tests.reference import BF16_UNIT_ROUNDOFF

ROOT_CONFIG = "configs/gpt_1b.yaml"


def _gate_rows_main_grad_and_step():
    import mcore_ext
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import unwrap_model

    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.run_config.megatron_configs import optimizer_config
    from mcore_ext.training.config import load_config
    from mcore_ext.training.loop import build_model

    # The 1B layer (hidden 2048, 16 heads of 128, SwiGLU 8192, QKV + gate bias), one layer,
    # 32 tokens x 2 sequences; the 1B recipe's optimizer at lr 1e-3 (step 1 moves each weight by
    # about lr: well above bf16's rounding of a gate weight).
    cfg = load_config(ROOT_CONFIG, [
        "model.num_layers=1", "model.seq_length=32", "model.attention_backend=sdpa",
        "model.architecture=gpt", "training.micro_batch_size=2", "training.global_batch_size=2",
        "optimizer.lr=1.0e-3", "optimizer.lr_warmup_iters=0", "data.source=mock",
        "checkpoint.save=null", "checkpoint.load=null", "logging.metrics_file=null",
    ], world_size=1)
    p = cfg.parallelism
    mcore_ext.init_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size, seed=5)
    with cuda_to_cpu():
        model = build_model(cfg, vocab_size=256)
        optimizer = get_megatron_optimizer(optimizer_config(cfg), [model])
    for group in optimizer.param_groups:
        group["lr"] = cfg.optimizer.lr
    attention = unwrap_model(model).decoder.layers[0].self_attention
    qkv = attention.linear_qkv
    rows = attention.qkv_rows_per_partition
    seen = {}

    def keep_input(name):
        def hook(module, args):
            seen[name] = args[0].detach().float()
            if name == "gated":
                args[0].register_hook(lambda grad: seen.__setitem__("d_gated", grad.float()))
        return hook

    qkv.register_forward_pre_hook(keep_input("x"))
    attention.linear_proj.register_forward_pre_hook(keep_input("gated"))
    attention.core_attention.register_forward_hook(
        lambda module, args, out: seen.__setitem__("attn", out.detach().float()))

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32), generator=g)
    position_ids = torch.arange(32).expand(2, 32)
    labels = torch.randint(0, 256, (2, 32), generator=g)
    w0 = qkv.weight.detach()[rows:].float().clone()
    b0 = qkv.bias.detach()[rows:].float().clone()
    with cuda_to_cpu():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = model(tokens, position_ids, None, labels=labels)
        losses.float().mean().backward()
        model.finish_grad_sync()
        main_grad_w = qkv.weight.main_grad[rows:].clone()
        main_grad_b = qkv.bias.main_grad[rows:].clone()
        ok, grad_norm, _ = optimizer.step()

    # The reference gradient, in fp32, from what the layer saw: x [s, b, h] (bf16 values),
    # attn [s, b, np * hn] (core attention's output), d gated [s, b, np * hn].
    heads = cfg.model.num_attention_heads
    x, attn, d_gated = seen["x"], seen["attn"], seen["d_gated"]
    logits = x @ w0.T + b0
    s = torch.sigmoid(logits)
    d_logit = (d_gated.unflatten(-1, (heads, -1)) * attn.unflatten(-1, (heads, -1))).sum(-1) \
        * s * (1 - s)  # [s, b, np]
    ref_grad_w = torch.einsum("sbn,sbh->nh", d_logit, x)
    ref_grad_b = d_logit.sum((0, 1))

    # One AdamW step on the reference gradient, clipped as megatron clipped (its global norm).
    clip = min(1.0, cfg.optimizer.clip_grad / (float(grad_norm) + 1.0e-6))
    ref_w = w0.clone().requires_grad_(True)
    adam = torch.optim.AdamW([ref_w], lr=cfg.optimizer.lr, betas=(cfg.optimizer.adam_beta1,
                             cfg.optimizer.adam_beta2), eps=cfg.optimizer.adam_eps,
                             weight_decay=cfg.optimizer.weight_decay)
    ref_w.grad = ref_grad_w * clip
    adam.step()
    stepped = qkv.weight.detach()[rows:].float()
    # AdamW's first step moves a weight by lr x sign(gradient): compared where the reference
    # gradient's sign is certain, twice the measured gradient difference from zero.
    moved = ref_grad_w.abs() > 2 * (main_grad_w - ref_grad_w).abs().max()
    return dict(
        ok=bool(ok),
        main_grad_dtype=str(main_grad_w.dtype),
        grad_w=((main_grad_w - ref_grad_w).abs().max().item(), ref_grad_w.abs().max().item()),
        grad_b=((main_grad_b - ref_grad_b).abs().max().item(), ref_grad_b.abs().max().item()),
        step=((stepped - ref_w.detach())[moved].abs().max().item(),
              ref_w.detach()[moved].abs().max().item()),
        moved_fraction=moved.float().mean().item(),
        weight_changed=(stepped - w0).abs().max().item(),
    )


def test_gate_rows_main_grad_and_adam_step_match_the_formula_in_bf16_distributed_optimizer(
        run_distributed):
    (r,) = run_distributed(_gate_rows_main_grad_and_step, world_size=1)
    assert r["ok"] and r["main_grad_dtype"] == "torch.float32"
    # Gradients: the model's bf16 GEMMs on bf16 inputs, summed in fp32, against the fp32
    # formula on the same bf16 values: within 16 bf16 units of the largest.
    for quantity in ("grad_w", "grad_b"):
        diff, scale = r[quantity]
        assert scale > 0 and diff <= 16 * BF16_UNIT_ROUNDOFF * scale, (quantity, diff, scale)
    # The step: each gate weight moved by ~lr; the bf16 weight after the step equals AdamW's on
    # the reference gradient within bf16's rounding of the new weight (2 units).
    diff, scale = r["step"]
    assert r["moved_fraction"] > 0.2 and r["weight_changed"] > 5e-4, r
    assert diff <= 2 * BF16_UNIT_ROUNDOFF * scale, (diff, scale)
