"""Step-3.5 attention in mcore_ext: two layer kinds, sliding window, per-kind RoPE, zero-centered
norms, SwiGLU clamp, and the sdpa / flex inner kernels.

Numerics: every rank builds one set of global weights from a seed (HF's parameter names), loads its
TP slice into the megatron model built by ``mcore_ext.build_gpt_model`` and compares the logits
with ``tests.reference.step35_logits``, plain PyTorch written from HF's formulas. fp32, micro-batch
2, sequence 8 > window 3, max abs diff <= 1e-5 (logits are O(1)). The weights make every feature
visible: norm weights are non-zero (HF initializes them to 0, which hides the 1 + w convention)
and layer 3's clamp is hit (the test checks that the unclamped reference differs).

bf16: the model runs in bf16 on bf16-rounded weights, the reference in fp32 on the same weights,
so the difference is the model's own rounding. bf16 keeps 8 significant bits (u = 2^-8 relative
per rounding); the logits pass through about 64 rounded stages (about 15 per layer: norms, GEMMs,
RoPE, scores, softmax, gate, residual adds; plus embedding, final norm, lm_head). Independent
rounding errors add like a random walk, sqrt(64) u = 8 u, so the bound on the RMS difference is
8 u x RMS(reference) (3.1 %); the largest of the 1024 logits may sit a few RMS out, so the max
difference gets 16 u x max|reference| (6.3 %). As a control, dropping the sliding windows from
the reference must move it by more than that bound.

Window edge: with q = k = 0 every visible key gets the same weight, and v_j = one-hot(j) makes the
output row of query i the indicator of the keys it sees / their count: it must be exactly
{i - W + 1, ..., i}, the key at i - W excluded (HF's ``i - W < j <= i``).
"""

import pytest
import torch

from tests import builders, reference

TOL = 1e-5
SEQ, BATCH, VOCAB, WINDOW, EPS = 8, 2, 64, 3, 1e-5
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
SWIGLU_LIMITS = [None, 0.0, 0.05, None]  # layer 3's clamp is hit

# name -> (full heads, sliding heads, KV groups); head dim 8, hidden 32
CASES = {"gqa": (4, 8, 2), "mha": (4, 4, 4)}


def _config(case, tp, **overrides):
    import torch.nn.functional as F

    full_heads, sliding_heads, groups = CASES[case]
    fields = dict(
        num_layers=4, hidden_size=32, num_attention_heads=full_heads, num_query_groups=groups,
        kv_channels=8, ffn_hidden_size=48, tensor_model_parallel_size=tp,
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, qk_layernorm=True,
        layernorm_epsilon=EPS, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False,
        layer_types=LAYER_TYPES, sliding_window=WINDOW,
        sliding_num_attention_heads=sliding_heads, rotary_base=5e6, rotary_percent=0.5,
        sliding_rotary_base=1e4, sliding_rotary_percent=1.0, swiglu_limits=SWIGLU_LIMITS,
    )
    fields.update(overrides)
    return builders.gated_config(**fields)


def _global_weights(layers, hidden=32, head_dim=8, ffn=48, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    weights = {"embed": rand(VOCAB, hidden, std=1.0), "norm": rand(hidden, std=0.3),
               "lm_head": rand(VOCAB, hidden, std=0.2), "layers": []}
    for kind in layers:
        n, g = kind["heads"], kind["groups"]
        weights["layers"].append(dict(
            input_layernorm=rand(hidden, std=0.3), post_attention_layernorm=rand(hidden, std=0.3),
            q_proj=rand(n * head_dim, hidden, std=0.3), k_proj=rand(g * head_dim, hidden, std=0.3),
            v_proj=rand(g * head_dim, hidden, std=0.3), g_proj=rand(n, hidden, std=0.3),
            q_norm=rand(head_dim, std=0.3), k_norm=rand(head_dim, std=0.3),
            o_proj=rand(hidden, n * head_dim, std=0.1),
            gate_proj=rand(ffn, hidden, std=0.2), up_proj=rand(ffn, hidden, std=0.2),
            down_proj=rand(hidden, ffn, std=0.2),
        ))
    return weights


def load_global_weights(model, config, weights, extra=None):
    """Copy each rank's TP slice of the global (HF-named) weights into the megatron model: its
    pipeline stage's layers (their global numbers), the embedding on the first stage, the final
    norm and lm_head on the last.

    ``extra``: more local tensors by megatron name (e.g. MTP layers); every parameter must get one.
    """
    rows = builders.rank_rows_of_this_rank
    local = {}
    if model.pre_process:
        local["embedding.word_embeddings.weight"] = rows(weights["embed"])
    if model.post_process:
        local.update({"decoder.final_layernorm.weight": weights["norm"],
                      "output_layer.weight": rows(weights["lm_head"])})
    for i, layer in enumerate(model.decoder.layers):
        number = layer.layer_number  # 1-based, global
        local.update(local_layer_weights(f"decoder.layers.{i}.", weights["layers"][number - 1],
                                         config.get_config_for_layer(number)))
    local.update(extra or {})
    params = dict(model.named_parameters())
    assert set(params) == set(local), set(params) ^ set(local)
    with torch.no_grad():
        for name, value in local.items():
            params[name].copy_(value)


def local_layer_weights(prefix, w, kind):
    """This TP rank's megatron tensors of one dense layer from its global HF-named tensors ``w``
    (``kind``: the layer's config, for heads and groups)."""
    rows = builders.rank_rows_of_this_rank

    def cols(t):
        rank, tp = builders.tp_rank_and_size()
        return t.chunk(tp, dim=1)[rank]

    qkv = builders.interleave_qkv(w["q_proj"], w["k_proj"], w["v_proj"],
                                  kind.num_attention_heads, kind.num_query_groups)
    return {
        prefix + "input_layernorm.weight": w["input_layernorm"],
        prefix + "self_attention.linear_qkv.weight": torch.cat([rows(qkv), rows(w["g_proj"])]),
        prefix + "self_attention.q_layernorm.weight": w["q_norm"],
        prefix + "self_attention.k_layernorm.weight": w["k_norm"],
        prefix + "self_attention.linear_proj.weight": cols(w["o_proj"]),
        prefix + "pre_mlp_layernorm.weight": w["post_attention_layernorm"],
        prefix + "mlp.linear_fc1.weight": torch.cat([rows(w["gate_proj"]), rows(w["up_proj"])]),
        prefix + "mlp.linear_fc2.weight": cols(w["down_proj"]),
    }


def _full_logits(model, tokens, first_position=0, inference_context=None):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(first_position, first_position + tokens.size(1),
                             device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(
            model(tokens, positions, None, inference_context=inference_context))


def _model_vs_reference(tp, runs, dtype="fp32", seq=SEQ, device="cpu", head_dim=8):
    """For each (case, backend, kernel): max abs diff of the logits to the reference, on ``seq``
    tokens (above 16 the sliding layers, window 3, run the banded sdpa path).

    bf16: the model is built in bf16 on the bf16-rounded weights; the reference computes in fp32
    on the same rounded weights. Also returned: the RMS of the difference, and the difference to
    a reference without the sliding windows (a control the tolerance must see).
    """
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(3))
    bf16 = dtype == "bf16"
    results = {}
    for case, backend, kernel in runs:
        overrides = dict(params_dtype=torch.bfloat16, bf16=True) if bf16 else {}
        config = _config(case, tp, attention_kernel=kernel, kv_channels=head_dim, **overrides)
        layers = builders.reference_layers(config)
        weights = _global_weights(layers, head_dim=head_dim)
        if bf16:
            weights = _rounded_to_bf16(weights)
        expected = reference.step35_logits(tokens, weights, layers, EPS)
        with cuda_to_cpu():  # the local backend allocates its masks on "cuda"
            model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=seq,
                                              backend=backend)
            load_global_weights(model, config, weights)
            model.to(device)
            logits = _full_logits(model, tokens.to(device))
            checked = backend != "sdpa" and not bf16 and device == "cpu" and seq == SEQ
            mask_checks = _mask_checks(model, tokens, logits) if checked else {}
            logits = logits.cpu()
        unclamped = [dict(kind, swiglu_limit=None) for kind in layers]
        clamp_effect = (reference.step35_logits(tokens, weights, unclamped, EPS)
                        - expected).abs().max().item()
        unwindowed = [dict(kind, window=None) for kind in layers]
        window_effect = (reference.step35_logits(tokens, weights, unwindowed, EPS)
                         - logits.float()).abs().max().item()
        diff = logits.float() - expected
        results[(case, backend, kernel)] = dict(
            diff=diff.abs().max().item(), rms_diff=diff.square().mean().sqrt().item(),
            dtype=str(logits.dtype), clamp_effect=clamp_effect, window_effect=window_effect,
            scale=expected.abs().max().item(), rms=expected.square().mean().sqrt().item(),
            **mask_checks,
        )
    return results


def _rounded_to_bf16(weights):
    if isinstance(weights, dict):
        return {k: _rounded_to_bf16(v) for k, v in weights.items()}
    if isinstance(weights, list):
        return [_rounded_to_bf16(v) for v in weights]
    return weights.bfloat16().float()


def _mask_checks(model, tokens, logits):
    """local: an explicit causal mask gives the same logits; a padding mask inside a window is
    refused (megatron's DotProductAttention would replace it by its window mask)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(SEQ).expand_as(tokens)
    causal_mask = ~reference.causal(SEQ, SEQ).view(1, 1, SEQ, SEQ)  # True = masked out
    padding_mask = causal_mask.clone().repeat(BATCH, 1, 1, 1)
    padding_mask[1, :, :, 0] = True
    with torch.no_grad():
        same = gather_from_tensor_model_parallel_region(model(tokens, positions, causal_mask))
        try:
            model(tokens, positions, padding_mask)
            refused = False
        except NotImplementedError as err:
            refused = "padding mask inside the window would be ignored" in str(err)
    return dict(causal_mask_diff=(same - logits).abs().max().item(), padding_refused=refused)


RUNS = [(case, backend, kernel) for case in CASES
        for backend, kernel in (("sdpa", "sdpa"), ("sdpa", "flex"), ("local", "sdpa"))]


# Sliding layers on 40 tokens (window 3, blocks of 8): the banded sdpa path in the whole model.
BANDED_RUNS = [(case, "sdpa", "sdpa") for case in CASES]


@pytest.mark.parametrize("tp, world_size, runs, seq", [
    (1, 2, RUNS, SEQ),
    pytest.param(2, 2, RUNS, SEQ, marks=pytest.mark.smoke),  # also on megatron-core 0.16 - 0.18
    pytest.param(4, 4, [("gqa", "sdpa", "sdpa"), ("gqa", "local", "sdpa")], SEQ,
                 marks=pytest.mark.slow),
    pytest.param(2, 2, BANDED_RUNS, 40, id="banded-tp2"),
])
def test_step35_model_matches_hf_formulas(run_distributed, tp, world_size, runs, seq):
    per_rank = run_distributed(_model_vs_reference, tp, runs, "fp32", seq,
                               world_size=world_size)
    for rank, results in enumerate(per_rank):
        for run, r in results.items():
            assert r["diff"] <= TOL, (rank, run, r)
            assert r["clamp_effect"] > 1e-3, (run, r)  # the clamp is really hit
            assert r["scale"] > 0.1, (run, r)
            if run[1] == "local":
                assert r["causal_mask_diff"] <= TOL and r["padding_refused"], (run, r)


@pytest.mark.parametrize("runs, seq", [(RUNS, SEQ), (BANDED_RUNS, 40)], ids=["dense", "banded"])
def test_step35_model_in_bf16_matches_hf_formulas_within_bf16_rounding(run_distributed, runs,
                                                                        seq):
    _assert_within_bf16_rounding(run_distributed(_model_vs_reference, 2, runs, "bf16", seq,
                                                 world_size=2))


def _assert_within_bf16_rounding(per_rank):
    for rank, results in enumerate(per_rank):
        for run, r in results.items():
            assert r["dtype"] == "torch.bfloat16", (run, r)
            max_bound = 16 * reference.BF16_UNIT_ROUNDOFF * r["scale"]
            assert r["diff"] <= max_bound, (rank, run, r)
            assert r["rms_diff"] <= 8 * reference.BF16_UNIT_ROUNDOFF * r["rms"], (rank, run, r)
            assert r["window_effect"] > max_bound, (run, r)  # the bound sees a missing window


# On CUDA (one GPU): sdpa, flex (compiled there, dynamic shapes) and local. fp32: the GPU's
# kernels sum in other orders than the CPU reference, 1e-4 on O(1) logits; bf16: the bounds above.
# Head dim 16: torch's flex kernel on CUDA needs at least 16 (the CPU tests use 8).
GPU_FP32_TOL = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("runs, seq", [(RUNS, SEQ), (BANDED_RUNS, 40)], ids=["dense", "banded"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step35_model_on_cuda_matches_hf_formulas(run_distributed, dtype, runs, seq):
    per_rank = run_distributed(_model_vs_reference, 1, runs, dtype, seq, "cuda", 16,
                               world_size=1)
    if dtype == "bf16":
        _assert_within_bf16_rounding(per_rank)
        return
    for run, r in per_rank[0].items():
        assert r["diff"] <= GPU_FP32_TOL and r["clamp_effect"] > 1e-3, (run, r)


# ------------------------------------------------------------------------ KV-cache decoding


def _kv_cache_decode_vs_reference(tp, runs, prefill=5):
    """megatron's static KV cache: prefill ``prefill`` tokens, then decode the rest one at a time
    (query i against keys 0..i: a bottom-right aligned window). Max abs diff of all the logits to
    the reference, and how far the decoded logits are from a reference without windows."""
    import mcore_ext
    from megatron.core.inference.contexts import StaticInferenceContext

    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    results = {}
    for case, backend, kernel in runs:
        config = _config(case, tp, attention_kernel=kernel)
        layers = builders.reference_layers(config)
        weights = _global_weights(layers)
        expected = reference.step35_logits(tokens, weights, layers, EPS)
        unwindowed = reference.step35_logits(tokens, weights,
                                             [dict(kind, window=None) for kind in layers], EPS)
        with cuda_to_cpu():
            model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                              backend=backend).eval()
            load_global_weights(model, config, weights)
            context = StaticInferenceContext(max_batch_size=BATCH, max_sequence_length=SEQ)
            steps = [slice(0, prefill)] + [slice(i, i + 1) for i in range(prefill, SEQ)]
            logits = []
            for step in steps:
                logits.append(_full_logits(model, tokens[:, step], step.start, context))
                context.sequence_len_offset += step.stop - step.start
        logits = torch.cat(logits, dim=1)
        results[(case, backend, kernel)] = dict(
            diff=(logits - expected).abs().max().item(),
            window_effect=(logits - unwindowed)[:, prefill:].abs().max().item(),
        )
    return results


def test_kv_cache_decoding_keeps_the_window(run_distributed):
    for results in run_distributed(_kv_cache_decode_vs_reference, 2, RUNS, world_size=2):
        for run, r in results.items():
            assert r["diff"] <= TOL, (run, r)
            assert r["window_effect"] > 1e-2, (run, r)  # the decoded tokens' windows matter


# ------------------------------------------------------------------------- window edge, kernels


def _attention_module(config, backend):
    from megatron.core.transformer.enums import AttnMaskType

    if backend == "local":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self")
    from mcore_ext.attention.sdpa import SDPAttention

    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                        attention_type="self")


def _visible_sets(out_SBNH, heads):
    """Output rows of one-hot values -> per query, the set of keys it attends."""
    rows = out_SBNH[:, 0].reshape(out_SBNH.size(0), heads, -1)[:, 0]  # [s, s]
    return [set(torch.nonzero(row > 1e-6).flatten().tolist()) for row in rows]


def _window_config(kernel, heads, groups, head_dim, **extra):
    """A plain (ungated) attention config with the sliding window of WINDOW keys."""
    return builders.gated_config(head_wise_attn_gate=False, num_attention_heads=heads,
                                 num_query_groups=groups, kv_channels=head_dim,
                                 hidden_size=4 * head_dim, window_size=(WINDOW - 1, 0),
                                 attention_kernel=kernel, **extra)


def _window_edges_and_kernels():
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from megatron.core.packed_seq_params import PackedSeqParams

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    s, w, heads, groups = 8, WINDOW, 4, 2
    expected = [set(range(max(0, i - w + 1), i + 1)) for i in range(s)]
    found, diffs = {}, {}
    for backend, kernel in (("sdpa", "sdpa"), ("sdpa", "flex"), ("local", "sdpa")):
        config = _window_config(kernel, heads, groups, s, masked_softmax_fusion=False)
        with cuda_to_cpu():
            attn = _attention_module(config, backend)
            q = torch.zeros(s, 1, heads, s)
            k = torch.zeros(s, 1, groups, s)
            v = torch.eye(s).view(s, 1, 1, s).expand(s, 1, groups, s).contiguous()
            with torch.no_grad():
                found[(backend, kernel)] = _visible_sets(attn(q, k, v, None), heads)
    # Packed THD: two documents of 5 tokens, each padded to 6 slots; each document's windows
    # start over, padding rows stay zero.
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=5, max_seqlen_kv=5)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(12, n, 8, generator=gen) for n in (heads, groups, groups))
    packed = {}
    for kernel in ("sdpa", "flex"):
        config = _window_config(kernel, heads, groups, 8)
        with torch.no_grad():
            packed[kernel] = _attention_module(config, "sdpa")(q, k, v, None,
                                                               packed_seq_params=params)
    # Reference per document: sliding causal attention of its own tokens.
    ref = torch.zeros(12, heads * 8)
    for start, length in ((0, 5), (6, 5)):
        rows = slice(start, start + length)
        ref[rows] = reference.attention(q[rows, None], k[rows, None], v[rows, None],
                                        reference.sliding_causal(length, w))[:, 0]
    diffs = {kernel: (out - ref).abs().max().item() for kernel, out in packed.items()}
    # A user's padding mask (True = masked out) on top of causal + window: flex equals sdpa.
    q, k, v = (torch.randn(8, 2, n, 8, generator=gen) for n in (heads, groups, groups))
    user_mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    user_mask[1, :, :, :2] = True
    masked = {}
    for kernel in ("sdpa", "flex"):
        config = _window_config(kernel, heads, groups, 8)
        with torch.no_grad():
            masked[kernel] = _attention_module(config, "sdpa")(q, k, v, user_mask)
    diffs["user_mask_flex_vs_sdpa"] = (masked["flex"] - masked["sdpa"])[2:].abs().max().item()
    return dict(found=found, expected=expected, packed_diffs=diffs,
                padding_zero=all(out[[5, 11]].abs().max().item() == 0 for out in packed.values()))


def test_window_edge_token_and_packed_documents(run_distributed):
    result = run_distributed(_window_edges_and_kernels, world_size=2)[0]
    for run, visible in result["found"].items():
        assert visible == result["expected"], run
    for kernel, diff in result["packed_diffs"].items():
        assert diff <= TOL, (kernel, diff)
    assert result["padding_zero"]


# ------------------------------------------------------------------------------- config checks


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries, num_layers is 4"),
    (dict(layer_types=["full_attention", "local", "full_attention", "full_attention"]),
     "'local' is not one of"),
    (dict(sliding_window=None), "sliding_window must be at least 1"),
    (dict(sliding_num_attention_heads=6, tensor_model_parallel_size=4),
     "sliding_num_attention_heads=6 (sliding layers) must be divisible by "
     "tensor_model_parallel_size (4)"),
    (dict(swiglu_limits=[None, 1.0]), "swiglu_limits has 2 entries"),
    (dict(swiglu_limits=[None, -1.0, None, None]), "-1.0 is negative"),
    (dict(rotary_percent=0.0), "rotary_percent=0.0 must be in (0, 1]"),
    (dict(attention_kernel="flash"), "attention_kernel='flash' is not one of"),
    (dict(window_size=(3, 0)), "give the sliding layers' window as sliding_window"),
])
def test_bad_layer_kind_config_is_refused(overrides, message):
    with pytest.raises(ValueError) as err:
        _config("gqa", 1, **overrides)
    assert message in str(err.value)


def test_kind_configs_and_checkpoint_format():
    config = _config("gqa", 2)
    sliding = config.get_config_for_layer(2)
    assert config.get_config_for_layer(1) is config
    assert (sliding.num_attention_heads, sliding.num_query_groups) == (8, 2)
    assert (sliding.rotary_base, sliding.rotary_percent, sliding.window_size) == (1e4, 1.0, (2, 0))
    assert sliding.layer_types is None and sliding.linear_qkv_rows == (8 + 4) * 8 + 8
    assert config.heterogeneous_block_specs  # per-layer keys: the kinds differ in shape
    assert not _config("mha", 2).heterogeneous_block_specs  # same shapes: stacked keys
    assert config.swiglu_limit(3) == 0.05 and config.swiglu_limit(2) is None


def _fused_rope_inputs():
    """Call a sliding layer (its own RoPE) and a full layer with the model's precomputed cos /
    sin tables, as megatron's fused-RoPE inference passes them; the refusals' messages."""
    import mcore_ext

    mcore_ext.init_parallel()
    model = mcore_ext.build_gpt_model(_config("gqa", 1), vocab_size=64, max_sequence_length=16,
                                      backend="sdpa")
    full, sliding = model.decoder.layers[0], model.decoder.layers[1]
    hidden = torch.randn(8, 2, 32)
    table = torch.randn(8, 1, 1, 4)
    out = {}
    for name, kwargs in (("cos_sin", dict(rotary_pos_cos=table, rotary_pos_sin=table)),
                         ("fused", dict(rotary_pos_cos_sin=table))):
        try:
            sliding(hidden_states=hidden, attention_mask=None, rotary_pos_emb=None, **kwargs)
            out[name] = None
        except NotImplementedError as err:
            out[name] = str(err)
    out["full_layer_has_no_own_rope"] = full.kind_rotary_pos_emb is None
    return out


def test_fused_rope_tables_are_refused_on_a_layer_with_its_own_rope(run_distributed):
    """megatron's flash_decode / flashinfer fused-RoPE paths hand every layer the model's (full
    layers') cos / sin instead of rotary_pos_emb: a sliding layer would rotate with the full
    kind's base and fraction. Refused by name (before, it ran with them)."""
    out = run_distributed(_fused_rope_inputs, world_size=1)[0]
    assert out["full_layer_has_no_own_rope"]
    for name, given in (("cos_sin", "rotary_pos_cos / rotary_pos_sin"),
                        ("fused", "rotary_pos_cos_sin")):
        assert out[name] is not None, out
        assert out[name].startswith(
            f"layer 2 has its own RoPE (rotary_base=10000.0, rotary_percent=1.0) but was given "
            f"the model's precomputed {given}"), out
        assert "flash_decode" in out[name], out


# ---------------------------------------------------------------------------------- checkpoints
# Saved at (TP 2, PP 1), loaded at (TP 1, PP 2) into a model from another seed: logits equal
# (fp32, <= 1e-5), saving again reproduces every tensor. At PP 2 stage 0 builds layers 1-2 (full,
# sliding) and stage 1 layers 3-4 (sliding, full): kinds follow global layer numbers. "gqa" has
# per-layer keys (the kinds differ in shape), "mha" megatron's stacked ones.


def _pp_model(case, tp, pp):
    import mcore_ext

    config = _config(case, tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    return mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                     backend="sdpa")


def _pp_logits(model):
    """Full logits on every rank, through a 2-stage pipeline when there is one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return _full_logits(model, tokens)
    positions = torch.arange(SEQ).expand_as(tokens)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    first, last = (dist.get_global_rank(pp_group, i) for i in (0, 1))
    logits = torch.empty(BATCH, SEQ, VOCAB)
    with torch.no_grad():
        if parallel_state.is_pipeline_first_stage():
            dist.send(model(tokens, positions, None).contiguous(), last)  # hidden [s, b, h]
            dist.recv(logits, last)
        else:
            hidden = torch.empty(SEQ, BATCH, 32)
            dist.recv(hidden, first)
            model.set_input_tensor(hidden)
            logits = _full_logits_from(model(tokens, positions, None))
            dist.send(logits.contiguous(), first)
    return logits


def _full_logits_from(local_logits):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(local_logits)


def _save_kinds(case, tp, pp, path):
    import mcore_ext
    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = _pp_model(case, tp, pp)
    checkpoint.save(model.sharded_state_dict(), builders.shared_dir(path))
    return _pp_logits(model)


def _load_kinds(case, tp, pp, source, target, expected):
    import mcore_ext
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            seed=99)
    model = _pp_model(case, tp, pp)
    before = (_pp_logits(model) - expected).abs().max().item()
    model.load_state_dict(checkpoint.load(model.sharded_state_dict(), source))
    after = (_pp_logits(model) - expected).abs().max().item()
    checkpoint.save(model.sharded_state_dict(), builders.shared_dir(target))
    dist.barrier()
    original, again = (dist_checkpointing.load_plain_tensors(d) for d in (source, target))
    identical = original.keys() == again.keys() and all(
        torch.equal(original[k], again[k]) for k in original)
    qkv_keys = sorted(k for k in original if "linear_qkv.weight" in k)
    return before, after, identical, qkv_keys


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_layer_kinds_reshard_tp2_to_pp2(run_distributed, tmp_path, case):
    source, target = str(tmp_path / "tp2"), str(tmp_path / "pp2")
    expected = run_distributed(_save_kinds, case, 2, 1, source, world_size=2)[0]
    for before, after, identical, keys in run_distributed(_load_kinds, case, 1, 2, source, target,
                                                          expected, world_size=2):
        assert before > 1e-3 and after <= TOL and identical, (before, after, identical)
        if case == "gqa":
            assert keys[:2] == ["decoder.layers.0.self_attention.linear_qkv.weight._gate",
                                "decoder.layers.0.self_attention.linear_qkv.weight._qkv"]
            assert len(keys) == 8
        else:
            assert keys == ["decoder.layers.self_attention.linear_qkv.weight._gate",
                            "decoder.layers.self_attention.linear_qkv.weight._qkv"]
