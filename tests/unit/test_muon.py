"""megatron-core's Muon on the gated ``linear_qkv``: Q, K, V and the gate rows are orthogonalised
each as its own matrix (per projection, over all heads of the layer), at TP 1 and TP 2 with GQA.

One optimizer step through megatron's ``get_megatron_optimizer(optimizer='muon')`` is compared
with a plain-PyTorch Muon step written here from the formula (momentum, Nesterov, decoupled weight
decay, quintic Newton-Schulz, spectral scale) on the separate global q / k / v / gate matrices,
fp32 within 1e-5. megatron's own split, which does not know the gate rows, fails the same check.
"""

from pathlib import Path

import pytest
import torch

from tests import builders

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")

SEQ, VOCAB, HIDDEN, HEADS, GROUPS, HEAD_DIM = 8, 64, 32, 4, 2, 8
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.9, 0.1
TOL = 1e-5

# megatron's default Newton-Schulz coefficients (emerging_optimizers' "quintic" set), 5 steps.
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def newton_schulz(m):
    """Orthogonalise m (fp32): normalise by the Frobenius norm, then X <- aX + (bA + cA^2)X with
    A = XX^T, over the shorter side."""
    x = m.T if m.size(0) > m.size(1) else m
    x = x / x.norm().clamp_min(1e-7)
    for a, b, c in QUINTIC:
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if m.size(0) > m.size(1) else x


def muon_update(weight, grad, blocks):
    """One Muon step of ``weight`` from a zero momentum, Nesterov, each block its own matrix."""
    momentum = (1 - MOMENTUM) * grad
    nesterov = grad + MOMENTUM * (momentum - grad)
    new = {}
    for name, rows in blocks.items():
        update = newton_schulz(nesterov[rows]) * max(nesterov[rows].shape) ** 0.5  # spectral
        new[name] = weight[rows] * (1 - LR * WEIGHT_DECAY) - LR * update
    return new


def _split_global(fused_per_rank):
    """[QKV_r; Gate_r] of each TP rank -> the global q, k, v, gate matrices."""
    tp = len(fused_per_rank)
    gate_rows = HEADS // tp
    qkv = torch.cat([w[:-gate_rows] for w in fused_per_rank])
    gate = torch.cat([w[-gate_rows:] for w in fused_per_rank])
    q, k, v = qkv.view(GROUPS, -1, HIDDEN).split(
        [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
    return dict(q=q.reshape(-1, HIDDEN), k=k.reshape(-1, HIDDEN), v=v.reshape(-1, HIDDEN),
                gate=gate)


def _muon_step(tp, tp_mode, gate_aware=True):
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():
        return _muon_step_on_this_rank(tp, tp_mode, gate_aware)


def _muon_step_on_this_rank(tp, tp_mode, gate_aware):
    """One Muon step of a 1-layer gated GPT; returns (linear_qkv weight before, its gradient,
    the weight after) of every TP rank, gathered."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=7)
    config = builders.gated_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, kv_channels=HEAD_DIM,
                                   tensor_model_parallel_size=tp)
    config.finalize_model_grads_func = finalize_model_grads
    gpt = builders.build_gpt(config, vocab_size=VOCAB, seq_length=SEQ)
    weight = gpt.decoder.layers[0].self_attention.linear_qkv.weight
    if not gate_aware and hasattr(weight, "qkv_gate_split"):
        del weight.qkv_gate_split  # megatron's default: the gate rows unknown
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0,
                        muon_momentum=MOMENTUM, muon_nesterov=True, muon_tp_mode=tp_mode,
                        muon_fp32_matmul_prec="highest"),
        [model])
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    model.zero_grad_buffer()
    optimizer.zero_grad()
    positions = torch.arange(SEQ).expand(2, -1)
    model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().backward()
    finalize_model_grads([model])
    before, grad = weight.detach().clone(), weight.main_grad.detach().clone()
    for group in optimizer.param_groups:  # megatron sets the scheduled lr; no scheduler here
        group["lr"] = LR
    optimizer.step()

    def gather(tensor):
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return shards

    return gather(before), gather(grad), gather(weight.detach())


def _compare(result, blocks_per_rank):
    """Max |megatron - reference| over q, k, v, gate. ``blocks_per_rank``: whether each TP
    rank's rows of a projection are their own matrix (tp_mode blockwise) or the whole
    projection is one (TP 1, tp_mode duplicated)."""
    before, grad, after = result
    tp = len(before)
    parts = [range(tp)] if not blocks_per_rank else [[r] for r in range(tp)]
    diff = 0.0
    for ranks in parts:
        w, g, new = (_split_global([per_rank[r] for r in ranks]) if len(ranks) == tp
                     else _split_rank(per_rank[ranks[0]], tp)
                     for per_rank in (before, grad, after))
        names = list(w)
        stacked = lambda d: torch.cat([d[n] for n in names])
        sizes = [w[n].size(0) for n in names]
        offsets = torch.tensor([0] + sizes).cumsum(0).tolist()
        blocks = {n: slice(offsets[i], offsets[i + 1]) for i, n in enumerate(names)}
        expected = muon_update(stacked(w), stacked(g), blocks)
        diff = max(diff, max((expected[n] - new[n]).abs().max().item() for n in names))
    return diff


def _split_rank(fused, tp):
    """One TP rank's [QKV_r; Gate_r] -> its q, k, v, gate rows (its query groups, its heads)."""
    gate_rows = HEADS // tp
    q, k, v = fused[:-gate_rows].view(GROUPS // tp, -1, HIDDEN).split(
        [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
    return dict(q=q.reshape(-1, HIDDEN), k=k.reshape(-1, HIDDEN), v=v.reshape(-1, HIDDEN),
                gate=fused[-gate_rows:])


@pytest.mark.parametrize("tp, tp_mode", [(1, "blockwise"), (2, "duplicated"), (2, "blockwise")])
def test_muon_step_orthogonalises_q_k_v_and_gate_separately(run_distributed, tp, tp_mode):
    result = run_distributed(_muon_step, tp, tp_mode, world_size=2, timeout=300)[0]
    assert _compare(result, blocks_per_rank=tp_mode == "blockwise") <= TOL
    # The step moved the weight: the comparison is not of two unchanged tensors.
    assert max((a - b).abs().max().item() for a, b in zip(result[0], result[2])) > 1e-3


@pytest.mark.parametrize("tp, tp_mode", [(1, "blockwise"), (2, "duplicated")])
def test_gate_unaware_split_fails_the_reference(run_distributed, tp, tp_mode):
    """megatron's own split on the same parameter (the gate rows unknown to it) is not Muon on
    q, k, v and gate: it orthogonalises the whole fused matrix."""
    result = run_distributed(_muon_step, tp, tp_mode, gate_aware=False, world_size=2,
                             timeout=300)[0]
    assert _compare(result, blocks_per_rank=False) > 1e-3


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.type=sgd"], "optimizer.type"),
    (["optimizer.type=muon", "training.precision=fp16"], "training.precision=fp16"),
    (["optimizer.type=muon", "lora.rank=4"], "optimizer.type=muon with lora.rank=4"),
    (["optimizer.type=muon", "optimizer.muon_num_ns_steps=0"], "optimizer.muon_num_ns_steps=0"),
    (["optimizer.type=muon", "optimizer.muon_momentum=1.0"], "optimizer.muon_momentum=1.0"),
    (["optimizer.type=muon", "optimizer.muon_coefficient_type=cubic"],
     "optimizer.muon_coefficient_type='cubic' is not one of simple, quintic"),
    (["optimizer.type=muon", "model.num_query_groups=1"],
     "needs num_query_groups (1) >= parallelism.tensor_model_parallel_size (2)"),
])
def test_muon_config_errors_name_the_field(overrides, message):
    from mcore_ext.training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides, world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_muon_is_accepted_on_the_moe_config():
    """The Step-3.5 MoE config takes Muon (the router on Adam: tests/unit/test_muon_moe.py)."""
    from mcore_ext.training.config import load_config

    moe = str(Path(TINY).with_name("step35_moe_tiny_cpu.yaml"))
    assert load_config(moe, ["optimizer.type=muon"], world_size=4).optimizer.type == "muon"


def test_muon_config_reaches_megatron():
    from mcore_ext.run_config.megatron_configs import optimizer_config
    from mcore_ext.training.config import load_config

    cfg = load_config(TINY, ["optimizer.type=muon", "optimizer.muon_nesterov=true",
                             "optimizer.muon_tp_mode=duplicated", "optimizer.muon_num_ns_steps=3"],
                      world_size=2)
    megatron = optimizer_config(cfg)
    assert (megatron.optimizer, megatron.muon_nesterov, megatron.muon_tp_mode,
            megatron.muon_num_ns_steps, megatron.muon_split_qkv) == ("muon", True, "duplicated",
                                                                     3, True)
    assert optimizer_config(load_config(TINY, [], world_size=2)).optimizer == "adam"


def _megatron_lm_muon_optimizer():
    """The Megatron-LM entry's model and the optimizer megatron.training builds for it from
    ``--optimizer muon`` (its get_megatron_optimizer_config, then get_megatron_optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.training import get_megatron_optimizer_config

    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.megatron_lm import GatedGPTModelBuilder, gated_gpt_config_from_args
    from tests.unit.test_megatron_lm import FLAGS, _parse

    args = _parse([*FLAGS, "--optimizer", "muon", "--muon-nesterov"], world_size=2)
    mcore_ext.init_parallel(tensor_model_parallel_size=2, seed=7)
    model_config = gated_gpt_config_from_args(args)
    gpt = GatedGPTModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups())
    with cuda_to_cpu():
        model = DistributedDataParallel(model_config.transformer, DistributedDataParallelConfig(),
                                        gpt)
        config, overrides = get_megatron_optimizer_config(args)
        optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    muon = [inner.optimizer for inner in optimizer.chained_optimizers
            if isinstance(inner.optimizer, TensorParallelMuon)]
    assert len(muon) == 1
    muon_params = {id(p) for group in muon[0].param_groups for p in group["params"]}
    splits = []
    for layer in gpt.decoder.layers:
        weight = layer.self_attention.linear_qkv.weight
        assert id(weight) in muon_params
        splits.append(weight.qkv_gate_split)
    assert TensorParallelMuon.orthogonalize.knows_gate_rows
    return splits


def test_megatron_lm_entry_muon_gets_the_gate_split(run_distributed):
    """``--optimizer muon`` through megatron.training: the same optimizer path as the launcher's
    (checked numerically above), on weights tagged with the gate rows: per rank 1 query group of
    (2 query heads x 16, 16, 16) rows and 2 gate rows, in both layer kinds."""
    pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")
    splits = run_distributed(_megatron_lm_muon_optimizer, world_size=2, timeout=300)
    assert splits == [[(1, (32, 16, 16), 2)] * 2] * 2


def test_gate_split_travels_to_main_copies():
    """bf16: megatron's mixed-precision optimizer gives Muon fp32 main copies of the weights, made
    with copy_tensor_model_parallel_attributes; the gate split is one of the attributes copied."""
    from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

    import mcore_ext  # noqa: F401 (installs the gate-aware Muon)

    weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    weight.qkv_gate_split = (1, (2, 1, 1), 2)
    main = weight.detach().clone().float()
    copy_tensor_model_parallel_attributes(main, weight)
    assert main.qkv_gate_split == (1, (2, 1, 1), 2)
