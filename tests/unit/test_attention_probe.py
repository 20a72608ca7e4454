"""The attention probe (``mcore_ext.attention.probe``, the launcher's ``logging.attention_probe``).

- A constructed attention pattern: q and k built so that each head's probability of the first
  token is known in closed form, e^x / (e^x + n - 1) for a query seeing n keys whose score to
  the first key is x and 0 to the others (causal, a window, packed documents with padding, GQA):
  the probe's sums equal the formula and a plain-PyTorch softmax, its sink rate counts the heads
  above 0.3.
- A 2-layer GPT (sdpa, flex, megatron's local attention; full and sliding layer kinds; packed
  documents; gate on and off; fp32 and bf16): every figure equals a plain-PyTorch computation
  from what the layers received (q and k at core attention, linear_qkv's gate columns,
  linear_proj's input, the layers' outputs, captured by the test's own hooks). Layer 1's query
  rows are zero, so it attends uniformly and its first-token share is also the formula's mean of
  1 / n_i. One head's gate is held at 0 (weight rows 0, bias -inf): the probe shows its gate and
  its output contribution as exactly 0, every other head's above 0.
- TP 2 (sequence parallel; fewer query groups than ranks) and CP 2 (sliding layers, packed
  documents) give TP 1's figures (fp32, 1e-6).
"""

import math

import pytest
import torch

from tests import builders, reference

VOCAB, SEQ = 64, 16
DOCS = [5, 11, 8, 3]  # packed documents, each padded to a multiple of 4 (2 x CP 2): 8 12 8 4
TOL = 1e-6  # fp32 shares (probabilities <= 1) summed over at most 64 queries, then averaged


# ---------------------------------------------------------------- a constructed attention pattern


def _sink_pattern(scores, positions, docs=None):
    """q [1, np, sq, hn], k [1, ng, sk, hn] with score(query of head h, key j) = scores[h] where j
    is its document's first token, else 0 (np = 4 heads in 2 groups, hn = 4)."""
    heads, groups, hn = len(scores), 2, 4
    s = positions.numel()
    # key j: first of its document -> sqrt(hn) e_g in its group's slot; else 0
    k = torch.zeros(1, groups, s, hn)
    k[0, :, positions == 0, 0] = math.sqrt(hn)
    q = torch.zeros(1, heads, s, hn)
    q[0, :, :, 0] = torch.tensor(scores).unsqueeze(1)  # the group's key 0 direction
    return q, k


def test_constructed_sink_pattern_equals_the_formula_and_a_plain_softmax():
    from mcore_ext.attention.probe import SINK_THRESHOLD, combine, first_token_shares

    scores = [3.0, 0.0, -2.0, 1.0]  # heads 0, 1 (group 0) and 2, 3 (group 1)
    cases = {
        "causal": dict(window=None, docs=[16]),
        "window 5": dict(window=(5, 0), docs=[16]),
        "packed": dict(window=None, docs=DOCS),
        "packed, window 3": dict(window=(3, 0), docs=DOCS),
    }
    results = {}
    for name, case in cases.items():
        # Each document padded to a multiple of 4: padding slots are neither queries nor keys.
        pos, doc, valid = [], [], []
        for d, length in enumerate(case["docs"]):
            padded = -(-length // 4) * 4 if len(case["docs"]) > 1 else length
            pos += list(range(padded))
            doc += [d] * padded
            valid += [True] * length + [False] * (padded - length)
        pos, doc, valid = torch.tensor(pos), torch.tensor(doc), torch.tensor(valid)
        q, k = _sink_pattern(scores, pos)
        got = results[name] = first_token_shares(
            q, k, pos, pos, causal=True, window=case["window"], scale=0.5, q_doc=doc, k_doc=doc,
            q_valid=valid, k_valid=valid)

        # The formula: query at position p of its document sees n = min(p, w) + 1 real keys;
        # its document's first among them when p <= w.
        left = case["window"][0] if case["window"] else 10**9
        expect_doc = torch.zeros(4, dtype=torch.float64)
        expect_first = torch.zeros(4, dtype=torch.float64)
        for p, d, real in zip(pos.tolist(), doc.tolist(), valid.tolist()):
            if not real or p > left:
                continue
            n = min(p, left) + 1
            for h, x in enumerate(scores):
                share = math.exp(x) / (math.exp(x) + n - 1)
                expect_doc[h] += share
                expect_first[h] += share if d == 0 else 0.0
        assert got["queries"] == int(valid.sum()), name
        sums = TOL * got["queries"]  # each fp32 probability within TOL
        assert torch.allclose(got["doc_share"], expect_doc, atol=sums, rtol=0), (name, got)
        assert torch.allclose(got["share"], expect_first, atol=sums, rtol=0), (name, got)

        # A plain softmax over the allowed keys (the test's own mask, GQA by repeating k).
        allowed = ((pos.unsqueeze(1) >= pos.unsqueeze(0)) & (doc.unsqueeze(1) == doc.unsqueeze(0))
                   & valid.unsqueeze(0) & (pos.unsqueeze(0) >= pos.unsqueeze(1) - left))
        probs = reference.attention_probs(q, k, allowed, scale=0.5)[0]  # [np, sq, sk]
        own_first = (pos == 0).unsqueeze(0) & (doc.unsqueeze(1) == doc.unsqueeze(0))
        counted = valid & allowed.any(-1)
        plain_doc = ((probs * own_first).sum(-1) * counted).sum(-1)
        plain_first = (probs[:, :, 0] * counted).sum(-1)
        assert torch.allclose(got["doc_share"], plain_doc, atol=sums, rtol=0), name
        assert torch.allclose(got["share"], plain_first, atol=sums, rtol=0), name

    # combine: a rank's sums -> per-head means, the sink rate over heads above 0.3 (causal:
    # heads 0 and 3 are sinks, 0.65 and 0.35; head 1 is uniform, 0.21)
    got = results["causal"]
    part = dict(first_head=0, heads=4, share=got["share"].tolist(),
                doc_share=got["doc_share"].tolist(), queries=got["queries"], gate=None,
                gate_tokens=0, head_out=[1.0] * 4, residual=2.0, attn_out=1.0, packed=True)
    figures = combine([{"1": part}])
    per_head = [s / got["queries"] for s in got["share"].tolist()]
    assert figures["layers"]["1"]["first_token_share_per_head"] == pytest.approx(per_head)
    assert figures["sink_rate"] == sum(s > SINK_THRESHOLD for s in per_head) / 4
    assert figures["sink_rate"] == 0.5
    assert figures["doc_first_token_share"] == pytest.approx(
        sum(got["doc_share"].tolist()) / got["queries"] / 4)


# ------------------------------------------------------------------------------ on a model


MODEL_CASES = {  # name: (config fields, backend, packed)
    "gpt": (dict(), "sdpa", False),
    "gpt_ungated": (dict(head_wise_attn_gate=False), "sdpa", False),
    "step35_kinds": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                          sliding_num_attention_heads=4, qk_layernorm=True,
                          normalization="RMSNorm"), "sdpa", False),
    "packed": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                    sliding_num_attention_heads=4), "sdpa", True),
    "flex": (dict(attention_kernel="flex"), "sdpa", False),
    "local": (dict(), "local", False),
    "gpt_bf16": (dict(params_dtype=torch.bfloat16, bf16=True), "sdpa", False),
}
CLOSED_HEAD = 1  # a head whose gate is held at 0 in layer 2


def _config(tp=1, cp=1, **fields):
    fields = dict(dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                       add_qkv_bias=True), **fields)
    return builders.gated_config(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 **fields)


def _build(config, backend="sdpa"):
    import mcore_ext
    from mcore_ext.runtime import set_seed

    set_seed(1234)  # with CPU initialization: the same global weights at every TP size
    if config.layer_types is not None:  # RoPE per layer kind
        return mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64,
                                         backend=backend)
    return builders.build_gpt(config, VOCAB, 64, backend=backend, parallel_output=False)


def _packed_params(pad):
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = [-(-n // pad) * pad for n in DOCS]
    cu = torch.tensor([0] + DOCS, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=max(padded), max_seqlen_kv=max(padded))


def _inputs(packed):
    g = torch.Generator().manual_seed(7)
    if packed:
        params = _packed_params(4)
        total = int(params.cu_seqlens_q_padded[-1])
        tokens = torch.randint(0, VOCAB, (1, total), generator=g)
        positions = torch.cat([torch.arange(n) for n in params.cu_seqlens_q_padded.diff()])[None]
        return tokens, positions, params
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand_as(tokens), None


def _attention_modules(model):
    from megatron.core.transformer.attention import SelfAttention

    return [m for m in model.modules() if isinstance(m, SelfAttention)]


def _hold_gate_closed(attention, head):
    """Gate weight row 0 and bias -inf for ``head`` (this rank's index): sigmoid = 0 exactly."""
    rows = attention.qkv_rows_per_partition
    with torch.no_grad():
        attention.linear_qkv.weight[rows + head].zero_()
        attention.linear_qkv.bias[rows + head] = float("-inf")


def _zero_query_rows(attention, config):
    """linear_qkv's query rows (weights and bias) 0: every score 0, uniform attention."""
    heads, groups, hn = (attention.num_attention_heads_per_partition,
                         attention.num_query_groups_per_partition, config.kv_channels)
    width = (heads // groups + 2) * hn  # per group: its query heads, then k and v
    with torch.no_grad():
        for g in range(groups):
            rows = slice(g * width, g * width + heads // groups * hn)
            attention.linear_qkv.weight[rows].zero_()
            attention.linear_qkv.bias[rows].zero_()


def _probe_model_vs_plain_pytorch(names):
    """Per case: the probe's figures and the test's own computation of each from what the layers
    received."""
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.attention.probe import AttentionProbe

    mcore_ext.init_parallel()
    results = {}
    for name in names:
        fields, backend, packed = MODEL_CASES[name]
        config = _config(**fields)
        model = _build(config, backend).to(config.params_dtype)
        attentions = _attention_modules(model)
        gated = config.head_wise_attn_gate
        _zero_query_rows(attentions[0], config)
        if gated:
            _hold_gate_closed(attentions[1], CLOSED_HEAD)
        seen = [dict() for _ in attentions]
        handles = []
        for attention, store in zip(attentions, seen):
            handles.append(attention.core_attention.register_forward_pre_hook(
                lambda m, args, kwargs, store=store: store.update(q=args[0].float().clone(),
                                                                  k=args[1].float().clone()),
                with_kwargs=True))
            handles.append(attention.linear_proj.register_forward_pre_hook(
                lambda m, args, store=store: store.update(proj_in=args[0].float().clone())))
            handles.append(attention.register_forward_hook(
                lambda m, args, out, store=store: store.update(attn_out=out[0].float().clone())))
            handles.append(attention.linear_qkv.register_forward_pre_hook(
                lambda m, args, store=store: store.update(qkv_in=args[0].float().clone())))
        for layer, store in zip(model.decoder.layers, seen):
            handles.append(layer.register_forward_hook(
                lambda m, args, out, store=store: store.update(residual=out[0].float().clone())))
        tokens, positions, params = _inputs(packed)
        probe = AttentionProbe(model)
        model.eval()
        with torch.no_grad(), probe.recording(), cuda_to_cpu():
            model(tokens, positions, None, packed_seq_params=params)
        figures = probe.gather()
        for handle in handles:
            handle.remove()
        with torch.no_grad(), cuda_to_cpu():  # hooks gone: nothing measured
            model(tokens, positions, None, packed_seq_params=params)
        results[name] = dict(figures=figures, again=probe.gather(),
                             expected=_plain(seen, attentions, config, packed, params))
    return results


def _plain(seen, attentions, config, packed, params):
    """The figures from the formulas on the captured tensors (fp64)."""
    out = {}
    for number, (store, attention) in enumerate(zip(seen, attentions), start=1):
        kind = config.get_config_for_layer(number) if config.layer_types else config
        window = kind.window_size
        left = window[0] if window is not None else 10**9
        q, k = store["q"], store["k"]
        if packed:  # [t, n, hn]: positions and documents from DOCS, padding slots none
            padded = params.cu_seqlens_q_padded.diff().tolist()
            pos = torch.cat([torch.arange(n) for n in padded])
            doc = torch.cat([torch.full((n,), d) for d, n in enumerate(padded)])
            valid = torch.cat([torch.arange(n) < real for n, real in zip(padded, DOCS)])
            q, k = q.unsqueeze(1), k.unsqueeze(1)  # [t, 1, n, hn]
        else:
            pos = torch.arange(q.size(0))
            doc = torch.zeros_like(pos)
            valid = torch.ones_like(pos, dtype=torch.bool)
        allowed = ((pos.unsqueeze(1) >= pos.unsqueeze(0)) & (pos.unsqueeze(0) >= pos.unsqueeze(1)
                                                             - left)
                   & (doc.unsqueeze(1) == doc.unsqueeze(0)) & valid.unsqueeze(0))
        scale = config.softmax_scale or 1 / math.sqrt(q.size(-1))
        # [s, b, n, hn] -> [b, n, s, hn]
        probs = reference.attention_probs(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), allowed,
                                          scale=scale)  # [b, n, sq, sk]
        counted = (valid & allowed.any(-1)).double()
        first = (pos == 0) & (doc == 0)
        own_first = (pos == 0).unsqueeze(0) & (doc.unsqueeze(1) == doc.unsqueeze(0))
        per_head = ((probs[..., first].sum(-1) * counted).sum((0, 2))
                    / (counted.sum() * probs.size(0)))
        doc_per_head = (((probs * own_first).sum(-1) * counted).sum((0, 2))
                        / (counted.sum() * probs.size(0)))
        uniform = [1 / (min(p, left) + 1) for p in pos.tolist() if p <= left]
        heads = attention.num_attention_heads_per_partition
        figures = dict(
            first_token_share_per_head=per_head.tolist(),
            doc_first_token_share=doc_per_head.mean().item(),
            head_output_max=store["proj_in"].unflatten(-1, (heads, -1)).abs().amax(
                dim=(0, 1, 3)).tolist(),
            residual_max=store["residual"].abs().max().item(),
            attn_output_max=store["attn_out"].abs().max().item())
        if number == 1 and not packed:  # zero queries: uniform over the visible keys
            figures["uniform_share"] = sum(uniform) / q.size(0)
        if getattr(attention, "head_wise_attn_gate", False):
            x = store["qkv_in"].double()
            rows = attention.qkv_rows_per_partition
            w = attention.linear_qkv.weight[rows:].double()
            b = attention.linear_qkv.bias[rows:].double()
            gates = torch.sigmoid(x @ w.T + b)  # [s, b, np] (THD: [t, 1, np])
            if packed:
                gates = gates[valid]
            figures["gate_mean_per_head"] = gates.flatten(0, -2).mean(0).tolist()
        out[str(number)] = figures
    return out


@pytest.mark.parametrize("names", [
    ["gpt", "gpt_ungated", "step35_kinds", "packed"],
    ["flex", "local", "gpt_bf16"],
], ids=["sdpa", "flex_local_bf16"])
def test_probe_figures_equal_plain_pytorch_on_a_model(run_distributed, names):
    for name, r in run_distributed(_probe_model_vs_plain_pytorch, names, world_size=1)[0].items():
        figures, expected = r["figures"], r["expected"]
        assert r["again"] == {}, name  # unhooked after recording: the next forward adds nothing
        assert list(figures["layers"]) == ["1", "2"], name
        for layer, want in expected.items():
            got = figures["layers"][layer]
            assert got["first_token_share_per_head"] == pytest.approx(
                want["first_token_share_per_head"], abs=TOL), (name, layer)
            if "uniform_share" in want:  # layer 1: uniform attention, the closed form
                assert got["first_token_share_per_head"] == pytest.approx(
                    [want["uniform_share"]] * 4, abs=TOL), (name, got)
            if name == "packed":
                assert got["doc_first_token_share"] == pytest.approx(
                    want["doc_first_token_share"], abs=TOL), name
            else:
                assert "doc_first_token_share" not in got, name
            for key in ("residual_max", "attn_output_max"):
                assert got[key] == pytest.approx(want[key], rel=1e-6), (name, layer, key)
            assert got["head_output_max"] == pytest.approx(want["head_output_max"], rel=1e-6)
            if "gate_mean_per_head" in want:
                # bf16: linear_qkv rounds each gate logit (|logit| < 1 here) by up to u of it,
                # which moves its sigmoid by at most a quarter of that; the reference is fp64
                tol = reference.BF16_UNIT_ROUNDOFF / 4 if "bf16" in name else TOL
                assert got["gate_mean_per_head"] == pytest.approx(want["gate_mean_per_head"],
                                                                  abs=tol), (name, layer)
            else:
                assert "gate_mean_per_head" not in got, name
        if name != "gpt_ungated":  # the closed head: gate 0, output contribution exactly 0
            closed = figures["layers"]["2"]
            assert closed["gate_mean_per_head"][CLOSED_HEAD] == 0.0, closed
            assert closed["head_output_max"][CLOSED_HEAD] == 0.0, closed
            others = [h for h in range(4) if h != CLOSED_HEAD]
            assert min(closed["head_output_max"][h] for h in others) > 1e-3, closed
            assert min(closed["gate_mean_per_head"][h] for h in others) > 0.3, closed
        heads = [s for f in figures["layers"].values() for s in f["first_token_share_per_head"]]
        assert figures["first_token_share"] == pytest.approx(sum(heads) / len(heads), abs=1e-12)
        assert figures["max_activation"] == max(f["residual_max"]
                                                for f in figures["layers"].values())


# ------------------------------------------------------------------------ TP 2, CP 2 vs TP 1


LAYOUT_CASES = {  # name: (tp, cp, config fields, packed)
    "tp2_sp": (2, 1, dict(sequence_parallel=True), False),
    "tp2_one_group": (2, 1, dict(num_query_groups=1), False),
    "cp2_step35_kinds": (1, 2, MODEL_CASES["step35_kinds"][0], False),
    "cp2_packed": (1, 2, MODEL_CASES["packed"][0], True),
}


def _figures_of(model, tokens, positions, params):
    from mcore_ext.attention.probe import AttentionProbe

    probe = AttentionProbe(model)
    model.eval()
    with torch.no_grad(), probe.recording():
        model(tokens, positions, None, packed_seq_params=params)
    return probe.gather()


def _layout_vs_tp1(names):
    import mcore_ext
    from mcore_ext.attention import context_parallel

    results = {}
    for name in names:
        tp, cp, fields, packed = LAYOUT_CASES[name]
        fields = dict(fields)
        tokens, positions, params = _inputs(packed)
        mcore_ext.init_parallel()
        model = _build(_config(**{k: v for k, v in fields.items() if k != "sequence_parallel"}))
        _hold_gate_closed(_attention_modules(model)[1], CLOSED_HEAD)
        state = model.state_dict()
        tp1 = _figures_of(model, tokens, positions, params)
        mcore_ext.destroy_parallel()

        mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        model = _build(_config(tp, cp, **fields))
        rank = builders.tp_rank_and_size()[0]
        local_head = CLOSED_HEAD - rank * (4 // tp)
        if 0 <= local_head < 4 // tp:
            _hold_gate_closed(_attention_modules(model)[1], local_head)
        if cp > 1:  # the same weights, this rank's tokens
            model.load_state_dict(state)
            if packed:
                def local(x):
                    return context_parallel.get_packed_batch_on_this_cp_rank(
                        x, params.cu_seqlens_q_padded, dim=1)
                tokens, positions = local(tokens), local(positions)
            else:
                local = context_parallel.get_batch_on_this_cp_rank(
                    dict(tokens=tokens, positions=positions))
                tokens, positions = local["tokens"], local["positions"]
        results[name] = dict(tp1=tp1, layout=_figures_of(model, tokens, positions, params))
        mcore_ext.destroy_parallel()
    return results


def _assert_same_figures(got, want, where):
    assert got.keys() == want.keys(), where
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_same_figures(got[key], value, f"{where}/{key}")
        elif isinstance(value, list):
            assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (where, key)
        elif isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (where, key)
        else:
            assert got[key] == value, (where, key)


def test_probe_at_tp2_and_cp2_gives_tp1_figures(run_distributed):
    names = list(LAYOUT_CASES)
    for rank_results in run_distributed(_layout_vs_tp1, names, world_size=2):
        for name, r in rank_results.items():
            want = r["tp1"]
            assert 0 < want["first_token_share"] < 1 and want["max_activation"] > 0, name
            assert want["layers"]["2"]["gate_mean_per_head"][CLOSED_HEAD] == 0.0, name
            assert ("doc_first_token_share" in want) == LAYOUT_CASES[name][3], name
            _assert_same_figures(r["layout"], want, name)


# ------------------------------------------------------------------------- the launcher's record


def test_probe_record_goes_to_tensorboard_per_layer_and_to_the_log_line():
    """The launcher's "probe" record: its scalars under probe/ at the probe's iteration, each
    layer's under probe/<figure>_layer_<key> (per-head lists only in the metrics file); the log
    line's field. A stand-in writer: tensorboard is optional."""
    from mcore_ext.training import loop

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = (value, step)

    trainer = object.__new__(loop._Trainer)
    trainer.metrics, trainer.tensorboard, trainer.iteration = None, Writer(), 7
    layer = dict(first_token_share=0.4, sink_rate=0.5, residual_max=30.0, attn_output_max=2.0,
                 first_token_share_per_head=[0.6, 0.2], head_output_max=[1.0, 0.0],
                 gate_mean=0.25, gate_mean_per_head=[0.5, 0.0])
    record = dict(kind="probe", iteration=6, first_token_share=0.4, sink_rate=0.5,
                  max_activation=30.0, max_attn_output=2.0, gate_mean=0.25,
                  layers={"1": layer, "mtp0": layer}, time_s=0.1)
    trainer._record(record)
    scalars = trainer.tensorboard.scalars
    assert scalars["probe/first_token_share"] == (0.4, 6)
    assert scalars["probe/max_activation"] == (30.0, 6)
    assert scalars["probe/sink_rate_layer_1"] == (0.5, 6)
    assert scalars["probe/residual_max_layer_mtp0"] == (30.0, 6)
    assert scalars["probe/gate_mean_layer_1"] == (0.25, 6)
    assert not any("per_head" in tag for tag in scalars)
    assert loop._probe_field(record) == "sink share 0.400 rate 0.50 max act 30"


def _layer_keys(architecture):
    import mcore_ext

    mcore_ext.init_parallel()
    config = builders.gated_config(num_layers=2, num_query_groups=2, ffn_hidden_size=48,
                                   normalization="RMSNorm", mtp_num_layers=2,
                                   mtp_step35_heads=False)
    build = getattr(mcore_ext, f"build_{architecture}_model")
    from mcore_ext.attention.probe import attention_layers

    layers = attention_layers(build(config, vocab_size=VOCAB, max_sequence_length=SEQ))
    return {key: len(modules) for key, (_, modules) in layers.items()}


@pytest.mark.parametrize("architecture, per_layer", [("gpt", 1), ("hybrid", 2)])
def test_every_mtp_depth_has_its_own_key(run_distributed, architecture, per_layer):
    """The probe's (and logging.gate_statistics') layer keys: GPT layer numbers, then mtpN per
    MTP depth; a hybrid layer's attention and MLP layers both measured as its residual stream.
    Before, a hybrid model's depths were all mtp0 (the index inside a depth's stack)."""
    keys = run_distributed(_layer_keys, architecture, world_size=1)[0]
    assert keys == {"1": per_layer, "2": per_layer, "mtp0": per_layer, "mtp1": per_layer}, keys
