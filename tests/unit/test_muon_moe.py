"""megatron-core's Muon on a MoE model: Muon takes the attention (the gated linear_qkv as its q,
k, v and gate), the dense MLP, the shared expert, the MTP layer's eh_proj, attention and MLP, and
each routed expert's fc1 and fc2 as its own matrix; Adam takes the router weight, the embedding,
the output layers (the main one and the Step-3.5 MTP depth's own head), and the norms.

The launcher's builder (``training.loop.build_model``, ``optimizer_config``) on
configs/step35_moe_tiny_cpu.yaml made smaller (a dense full-attention layer, a sliding MoE layer
with 4 experts, top-2, a shared expert and the expert bias, one MTP depth), on 2 gloo ranks at
EP 1 (DP 2, every expert on each rank) and EP 2 (2 experts a rank). One optimizer step through
megatron's schedule and ``get_megatron_optimizer(optimizer='muon')`` is compared, per parameter,
with a plain-PyTorch step written here from the formula on megatron's reduced gradients: Muon
(``tests.unit.test_muon``: zero momentum, Nesterov, decoupled weight decay, quintic
Newton-Schulz, spectral scale) per matrix, and Adam's first step (decoupled weight decay, none on
norms). fp32 within 1e-5. The router on Muon, and each layer's routed experts orthogonalised as
one concatenated [E x rows, columns] matrix, are both more than 1e-3 from the step.
"""

from pathlib import Path

import pytest
import torch

from tests import builders
from tests.unit.test_muon import LR, MOMENTUM, TOL, WEIGHT_DECAY, muon_update

MOE_TINY = str(Path(__file__).resolve().parents[2] / "configs" / "step35_moe_tiny_cpu.yaml")
VOCAB, SEQ, HIDDEN, GROUPS, HEAD_DIM, EXPERTS, ADAM_EPS = 64, 16, 32, 2, 16, 4, 1e-8
# Heads of each layer with attention: layer 1 is full attention (4 heads), layer 2 and the MTP
# depth sliding (6 heads); 2 query groups in both kinds. GPTModel's layers 0 and 1 hold them, or
# HybridModel's layers 0 and 2 (the launcher's default from megatron-core 0.19: 1 and 3 are MLPs).
HEADS = {"decoder.layers.0.": 4, "decoder.layers.1.": 6, "decoder.layers.2.": 6,
         "mtp.layers.0.": 6}
OVERRIDES = [
    "model.num_layers=2", "model.moe_layer_freq=[0,1]", "model.mtp_num_layers=1",
    "model.layer_types=[full_attention,sliding_attention,sliding_attention]",
    "model.swiglu_limits=[0,16.0,0]", "model.moe_expert_swiglu_limits=[0,7.0]",
    f"model.num_moe_experts={EXPERTS}", f"model.hidden_size={HIDDEN}", "model.ffn_hidden_size=32",
    "model.moe_ffn_hidden_size=16", "model.moe_shared_expert_intermediate_size=16",
    f"model.seq_length={SEQ}", "training.precision=fp32", "optimizer.type=muon",
    f"optimizer.lr={LR}", f"optimizer.weight_decay={WEIGHT_DECAY}", "optimizer.clip_grad=0",
    f"optimizer.muon_momentum={MOMENTUM}", "optimizer.muon_nesterov=true",
    "optimizer.muon_fp32_matmul_prec=highest", f"optimizer.adam_eps={ADAM_EPS}",
]

# What Muon takes (as whole matrices, linear_qkv as q, k, v and gate) and what Adam takes.
MUON = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "shared_experts.linear_fc1.weight",
        "shared_experts.linear_fc2.weight", "eh_proj.weight")
ROUTED = ("linear_fc1.weight", "linear_fc2.weight")  # of mlp.experts.local_experts.{i}
ADAM = ("word_embeddings.weight", "output_layer.weight", "router.weight", "layernorm.weight",
        "norm.weight")


def _muon_moe_step(ep):
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():
        return _muon_moe_step_on_this_rank(ep)


def _muon_moe_step_on_this_rank(ep):
    """One Muon step of the launcher's model at EP ``ep``; {name: (weight before, reduced
    gradient, weight after)} of this rank's parameters, routed experts under their global index."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer

    import mcore_ext
    from mcore_ext.run_config import PretrainConfig, apply_overrides, build, read_yaml
    from mcore_ext.run_config.megatron_configs import optimizer_config
    from mcore_ext.training.loop import build_model

    cfg = build(PretrainConfig, apply_overrides(read_yaml(MOE_TINY), [
        *OVERRIDES, f"parallelism.expert_model_parallel_size={ep}"]))
    mcore_ext.init_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=1, seed=7)
    model = build_model(cfg, VOCAB)
    optimizer = get_megatron_optimizer(optimizer_config(cfg), [model])
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(3))
    first_expert = ps.get_expert_model_parallel_rank() * EXPERTS // ep

    def name_of(name):
        name = name.removeprefix("module.")
        head, sep, tail = name.partition("local_experts.")
        if not sep:
            return name
        local, _, rest = tail.partition(".")
        return f"{head}{sep}{first_expert + int(local)}.{rest}"

    state = {}

    def before_step():
        for name, param in model.named_parameters():
            state[name_of(name)] = [param.detach().clone(), param.main_grad.detach().clone()]
        for group in optimizer.param_groups:  # megatron sets the scheduled lr; no scheduler here
            group["lr"] = LR

    builders.train_step(model, optimizer, tokens, before_step=before_step)
    for name, param in model.named_parameters():
        state[name_of(name)].append(param.detach().clone())
    return state


def _muon(weight, grad):
    """One Muon step of one matrix from a zero momentum (Nesterov, spectral scale)."""
    return muon_update(weight, grad, {"matrix": slice(None)})["matrix"]


def _adam(weight, grad):
    """Adam's first step (bias-corrected moments g and g^2); no weight decay on vectors."""
    decay = WEIGHT_DECAY if weight.dim() == 2 else 0.0
    return weight * (1 - LR * decay) - LR * grad / (grad.abs() + ADAM_EPS)


def _qkv_gate(fused, heads):
    """[QKV; Gate] -> the q, k, v and gate matrices (megatron's q, k, v rows per query group)."""
    qkv, gate = fused[:-heads], fused[-heads:]
    q, k, v = qkv.view(GROUPS, -1, HIDDEN).split(
        [heads // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
    return [q.reshape(-1, HIDDEN), k.reshape(-1, HIDDEN), v.reshape(-1, HIDDEN), gate]


def _reference(name, weight, grad):
    """The parameter after the step (linear_qkv as its q, k, v and gate rows, stacked)."""
    if name.endswith(ADAM):
        return _adam(weight, grad)
    if "local_experts." in name and name.endswith(ROUTED) or name.endswith(MUON[1:]):
        return _muon(weight, grad)
    assert name.endswith(MUON[0]), f"no reference for {name}"
    heads = next(n for prefix, n in HEADS.items() if name.startswith(prefix))
    return torch.cat([_muon(w, g) for w, g in zip(_qkv_gate(weight, heads),
                                                   _qkv_gate(grad, heads))])


def _after_qkv_gate(name, after):
    if not name.endswith(MUON[0]):
        return after
    heads = next(n for prefix, n in HEADS.items() if name.startswith(prefix))
    return torch.cat(_qkv_gate(after, heads))


@pytest.mark.parametrize("ep", [1, 2])
def test_muon_step_on_moe_model(run_distributed, ep):
    ranks = run_distributed(_muon_moe_step, ep, world_size=2, timeout=300)
    state = {**ranks[1], **ranks[0]}  # at EP 2 rank 1 holds experts 2 and 3
    experts = {n for n in state if "local_experts." in n}
    assert len(experts) == 2 * EXPERTS and all(
        f"local_experts.{e}.linear_fc2.weight" in " ".join(experts) for e in range(EXPERTS))
    diff = {}
    for name, (before, grad, after) in state.items():
        diff[name] = (_reference(name, before, grad) - _after_qkv_gate(name, after)).abs().max()
        # the step moved every parameter: no comparison of unchanged tensors
        assert (after - before).abs().max() > 1e-4, name
    assert not {n: d for n, d in diff.items() if d > TOL}, {n: d.item() for n, d in diff.items()
                                                             if d > TOL}

    # The router as a Muon matrix is not the step (the MoE layer: GPTModel's 1, HybridModel's 3).
    (router,) = [n for n in state if n.endswith("mlp.router.weight")]
    moe = router.removesuffix("router.weight")
    before, grad, after = state[router]
    assert (_muon(before, grad) - after).abs().max() > 1e-3
    # Nor the routed experts of the layer concatenated into one [E x rows, columns] matrix.
    for linear in ROUTED:
        names = [f"{moe}experts.local_experts.{e}.{linear}" for e in range(EXPERTS)]
        before, grad, after = (torch.cat([state[n][i] for n in names]) for i in range(3))
        assert (_muon(before, grad) - after).abs().max() > 1e-3, linear
