"""Expert parallelism at 8 on 8 gloo ranks: exact resume, EP 8 -> EP 2 with optimizer state, and the
expert-bias update balancing the routing over 50 steps of real text.

A tiny Step-3.5-style MoE model (2 layers, both MoE: 64 experts of width 32, top-8, a sigmoid
router whose fp32 expert bias only selects, x3.0, a shared expert; hidden 64) trains with
megatron's DDP, distributed optimizer (the experts in their own chained optimizer) and
finalize_model_grads, aux-loss-free: ``moe_router_bias_update_rate`` moves each expert's bias by
rate x sign(mean load - its load) after every step. Data: the bytes of Python standard-library
sources (real text, byte tokens), 16 sequences of 64 tokens a step, each step the next ones.

- Resume: the 50-step run saves model + optimizer at step 25; resuming there at EP 8 gives steps
  26-50 bit for bit (losses and expert biases).
- Reshard: resuming the same checkpoint at EP 2 (4 expert-data-parallel replicas of each expert,
  another sharding of the optimizer state) gives the uninterrupted losses within 1e-5 (fp32).
- Balance: the load of each MoE layer (tokens routed to each expert over the global batch) as
  max / mean. The router's own training (Adam, lr 3e-3) drifts towards a few experts: without
  the update (rate 0, same data and seed) the imbalance roughly doubles; with it, it ends below
  where it started and well below the run without.

8 processes on 2 cores take about 3 minutes: opt-in, ``pytest -m ep8`` (see pyproject.toml).
"""

import functools

import pytest
import torch

WORLD, EXPERTS, TOPK, SEQ, GLOBAL_BATCH, STEPS, RATE = 8, 64, 8, 64, 16, 50, 1e-2
pytestmark = [pytest.mark.slow, pytest.mark.ep8]


def _text_tokens() -> torch.Tensor:
    """The bytes of a few standard-library modules, as one long token stream."""
    import argparse
    import dataclasses
    import inspect
    import typing

    data = b"".join(open(m.__file__, "rb").read() for m in (argparse, dataclasses, inspect,
                                                            typing))
    return torch.tensor(list(data), dtype=torch.long)


def _config(ep, rate):
    import torch.nn.functional as F

    from tests import builders

    return builders.gated_config(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, normalization="RMSNorm", layernorm_zero_centered_gamma=True,
        qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=3.0, moe_router_dtype="fp32",
        moe_router_bias_update_rate=rate, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep)


def _train(ep, steps, rate=RATE, first_step=0, save_at=None, save_dir=None, load_dir=None):
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():  # megatron's optimizer and schedules allocate on 'cuda' literally
        return _train_on_this_rank(ep, steps, rate, first_step, save_at, save_dir, load_dir)


def _train_on_this_rank(ep, steps, rate, first_step, save_at, save_dir, load_dir):
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    import mcore_ext
    from mcore_ext import checkpoint
    from tests import builders

    mcore_ext.init_parallel(expert_model_parallel_size=ep, seed=5)
    config = _config(ep, rate)
    gpt = mcore_ext.build_gpt_model(config, vocab_size=256, max_sequence_length=SEQ,
                                    backend="sdpa")
    model, optimizer = builders.ddp_and_optimizer(config, gpt, distributed_optimizer=True)
    if load_dir:
        builders.load_training_state(model, optimizer, load_dir)
    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    loads = []  # per step: [layer][expert] tokens over the global batch
    step_loads = [torch.zeros(EXPERTS) for _ in routers]

    def count(load, _module, _inputs, output):  # output: (probs, routing_map [tokens, E])
        load.add_(output[1].sum(0).float())

    for load, router in zip(step_loads, routers):
        router.register_forward_hook(functools.partial(count, load))

    text = _text_tokens()
    losses, biases = [], []
    for step in range(first_step, first_step + steps):
        start = step * GLOBAL_BATCH * (SEQ + 1)
        for load in step_loads:
            load.zero_()
        losses.append(builders.train_step(
            model, optimizer, text[start:start + GLOBAL_BATCH * (SEQ + 1)].view(GLOBAL_BATCH,
                                                                                 SEQ + 1)))
        step_load = torch.stack(step_loads)
        dist.all_reduce(step_load)  # every rank routes its own tokens: sum over all ranks
        loads.append(step_load.tolist())
        biases.append(torch.cat([r.expert_bias for r in routers]).clone())
        if save_at is not None and step + 1 == save_at:
            checkpoint.save(builders.training_state(model, optimizer, False),
                            builders.shared_dir(save_dir))
    mcore_ext.destroy_parallel()
    return dict(losses=losses, loads=loads, bias=torch.stack(biases))


def _imbalance(step_load) -> float:
    """max / mean tokens per expert, averaged over the MoE layers."""
    load = torch.tensor(step_load)
    return (load.max(1).values / load.mean(1)).mean().item()


def test_ep8_resumes_exactly_reshards_to_ep2_and_balances_routing(run_distributed, tmp_path):
    def run(*args, **kwargs):
        return run_distributed(_train, *args, world_size=WORLD, timeout=900, **kwargs)[0]

    ckpt = str(tmp_path / "ep8_step25")
    full = run(8, STEPS, save_at=25, save_dir=ckpt)
    resumed = run(8, STEPS - 25, first_step=25, load_dir=ckpt)
    assert resumed["losses"] == full["losses"][25:]
    assert torch.equal(resumed["bias"], full["bias"][25:])

    resharded = run(2, 5, first_step=25, load_dir=ckpt)
    diffs = [abs(a - b) for a, b in zip(resharded["losses"], full["losses"][25:30])]
    assert max(diffs) <= 1e-5, (resharded["losses"], full["losses"][25:30])

    frozen = run(8, STEPS, rate=0.0)
    steps = (0, 9, 19, 29, 39, 49)
    for name, r in (("bias update", full), ("no update", frozen)):
        print(f"\nmax / mean expert load, {name}: " + ", ".join(
            f"step {i + 1} {_imbalance(r['loads'][i]):.2f}" for i in steps)
            + f"; last 5 steps {_late(r):.2f}")
    first = _imbalance(full["loads"][0])
    assert first == pytest.approx(_imbalance(frozen["loads"][0]))  # same start
    # the router's own training drifts towards a few experts; the bias update pulls it back
    assert _late(full) < first and _late(full) <= 0.7 * _late(frozen)


def _late(run) -> float:
    """The imbalance over the last 5 steps (one step's 1024 tokens are a noisy sample)."""
    return sum(_imbalance(load) for load in run["loads"][-5:]) / 5
