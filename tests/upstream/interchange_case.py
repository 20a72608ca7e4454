"""What both sides of the upstream-dev interchange test build and measure.

Imported by the test (mcore_ext's environment, megatron-core 0.19.2) and by ``dev_driver.py``
(upstream Megatron-LM dev's environment). It therefore imports nothing of mcore_ext or of the
``tests`` package, and only megatron-core APIs that both versions share (inside functions).
"""

import torch

WORLD_SIZE = 4
TP_SIZES = (1, 2, 4)

# Upstream dev requires num_query_groups >= TP, so GQA uses 4 groups (one per rank at TP 4).
VARIANTS = {
    f"{attention}_{'bias' if bias else 'nobias'}": dict(num_query_groups=groups, add_qkv_bias=bias)
    for attention, groups in (("gqa_g4", 4), ("mha", 8))
    for bias in (True, False)
}

# TransformerConfig fields common to both sides (plus the variant, TP size and the gate flag).
MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    kv_channels=8,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
)
VOCAB_SIZE = 64
SEQ_LENGTH = 16
# GPTModel keyword arguments common to both sides.
GPT = dict(vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH, position_embedding_type="rope",
           parallel_output=False)

QKV_KEY = "decoder.layers.self_attention.linear_qkv.{}._qkv"
GATE_KEY = "decoder.layers.self_attention.linear_qkv.{}._gate"


def tokens_and_positions():
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LENGTH), generator=generator)
    return tokens, torch.arange(SEQ_LENGTH).expand_as(tokens)


def causal_mask():
    """[1, 1, s, s], True where a query must not see a key (megatron's mask convention)."""
    return torch.ones(1, 1, SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool).triu(diagonal=1)


def checkpoint_dir(root, side, variant, tp):
    """Where ``side`` ("ours" / "dev") saves its own checkpoint of ``variant`` at TP ``tp``."""
    return f"{root}/{side}/{variant}/tp{tp}"


def resave_dir(root, direction, variant, src_tp, dst_tp):
    """Where a loaded checkpoint is saved again (``direction``: "ours_to_dev" / "dev_to_ours")."""
    return f"{root}/{direction}/{variant}/tp{src_tp}_to_tp{dst_tp}"


def global_qkv_gate(model, num_attention_heads):
    """The model's linear_qkv tensors as the global blocks a checkpoint holds.

    Every TP rank holds ``[QKV_r ; Gate_r]`` rows (its ``num_attention_heads / tp`` gates last);
    gathering them gives ``{QKV_KEY: [layers, QKV rows, ...], GATE_KEY: [layers, H, ...]}`` for
    weight and bias, on every rank.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    gates_per_rank = num_attention_heads // tp
    blocks = {}
    for name in ("weight", "bias"):
        per_layer = [getattr(layer.self_attention.linear_qkv, name)
                     for layer in model.decoder.layers]
        if per_layer[0] is None:
            continue
        qkv, gate = [], []
        for local in per_layer:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.detach().contiguous(), group=group)
            qkv.append(torch.cat([p[:-gates_per_rank] for p in parts]))
            gate.append(torch.cat([p[-gates_per_rank:] for p in parts]))
        blocks[QKV_KEY.format(name)] = torch.stack(qkv)
        blocks[GATE_KEY.format(name)] = torch.stack(gate)
    return blocks


def max_abs_diffs(actual: dict, expected: dict) -> dict:
    """Per key of ``expected``: max |actual - expected|, or None if missing or of another shape."""
    out = {}
    for key, want in expected.items():
        got = actual.get(key)
        if got is None or got.shape != want.shape:
            out[key] = None
        else:
            out[key] = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return out


def compare_checkpoints(original_dir, resaved_dir):
    """Plain tensors of two checkpoints: key sets and bit equality (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    original = dist_checkpointing.load_plain_tensors(original_dir)
    resaved = dist_checkpointing.load_plain_tensors(resaved_dir)
    diffs = max_abs_diffs(resaved, original)
    return dict(
        same_keys=sorted(original) == sorted(resaved),
        identical=sorted(original) == sorted(resaved)
        and all(torch.equal(original[k], resaved[k]) for k in original),
        max_abs_diff=max((d for d in diffs.values() if d is not None), default=0.0),
        num_tensors=len(original),
    )


def set_distinct_gates_(model, num_attention_heads, seed):
    """Give every head its own gate (sigmoid spread over about 0.05 - 0.95), in place.

    Freshly initialized gates are nearly equal across heads (upstream's start near sigmoid(0),
    mcore_ext's near sigmoid(2)), so logits would hardly change if a load put gate rows on the
    wrong heads; with these they do (see ``check_load``'s ``logits_gates_rolled``).
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    rows = slice(rank * num_attention_heads // tp, (rank + 1) * num_attention_heads // tp)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.decoder.layers:
            linear = layer.self_attention.linear_qkv
            weight = torch.randn(num_attention_heads, linear.weight.shape[1], generator=generator)
            linear.weight[-num_attention_heads // tp:] = 0.3 * weight[rows]
            bias = torch.linspace(-3, 3, num_attention_heads)[
                torch.randperm(num_attention_heads, generator=generator)]
            if linear.bias is not None:
                linear.bias[-num_attention_heads // tp:] = bias[rows]


def check_load(model, source_dir, num_attention_heads, logits_of, expected_logits, fresh_logits):
    """Figures for one loaded model: its gathered [QKV; Gate] blocks against the checkpoint's, and
    its logits against the source model's (``fresh_logits``: before loading;
    ``logits_gates_rolled``: with each rank's gate rows rolled by one head, i.e. what a load that
    misplaced gates would give)."""
    from megatron.core import dist_checkpointing, parallel_state

    plain = dist_checkpointing.load_plain_tensors(source_dir)
    blocks = global_qkv_gate(model, num_attention_heads)
    wanted = {k: plain[k] for k in plain if "linear_qkv." in k and k.endswith(("._qkv", "._gate"))}
    figures = dict(
        qkv_gate_diffs=max_abs_diffs(blocks, wanted),
        qkv_gate_keys=sorted(wanted),
        logits_before=(fresh_logits - expected_logits).abs().max().item(),
        logits_after=(logits_of(model) - expected_logits).abs().max().item(),
    )
    gates = num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
    linears = [layer.self_attention.linear_qkv for layer in model.decoder.layers]
    tensors = [t for linear in linears for t in (linear.weight, linear.bias) if t is not None]
    loaded = [t[-gates:].clone() for t in tensors]
    with torch.no_grad():
        for tensor in tensors:
            tensor[-gates:] = tensor[-gates:].roll(1, dims=0)
        figures["logits_gates_rolled"] = (logits_of(model) - expected_logits).abs().max().item()
        for tensor, rows in zip(tensors, loaded):
            tensor[-gates:] = rows
    return figures
