"""Multi-token prediction (MTP): Step-3.5's semantics and megatron-core's own, against a reference.

Reference: ``tests.reference.step35_mtp_logits``, plain PyTorch written from the formula that vLLM's
``vllm/model_executor/models/step3p5_mtp.py`` (vllm-project/vllm, commit 375a5cf2) computes: each
depth's own shared_head (norm + output), the main model's pre-final-norm hidden state as the first
depth's input, pre-norm chaining, the MTP layer a decoder layer of its own kind. (sglang's
``python/sglang/srt/models/step3p5_mtp.py``, commit 7ebcb766, was read too: it feeds every depth
the target model's hidden state, a simplification its own comment calls non-standard.)

Numerics as in test_layer_kinds: every rank builds one set of global HF-named weights from a seed,
loads its TP slice into ``mcore_ext.build_gpt_model``'s model, and compares in fp32 within 1e-5
(logits are O(1)). The model has 4 main layers and 2 MTP depths (global layers 5 and 6: per-layer
lists of 6 entries; depth 0's sliding kind has other heads than the full layers and its clamp is
hit). Only the positions where depth k has real input tokens (t < s - k - 1) are compared.
Controls: the wrong variants (post-norm input, or the main lm_head for every depth) differ from
the reference by far more than the tolerance, so the test would see either mistake.
"""

import pytest
import torch

from tests import builders, reference
from tests.unit import test_layer_kinds as kinds

TOL = 1e-5
SEQ, BATCH, VOCAB, EPS, HIDDEN = 8, 2, 64, 1e-5, 32
MTP_DEPTHS = 2
LAYER_TYPES = kinds.LAYER_TYPES + ["sliding_attention", "full_attention"]
SWIGLU_LIMITS = kinds.SWIGLU_LIMITS + [0.05, None]  # depth 0's clamp is hit


def _config(tp, step35=True, **overrides):
    fields = dict(layer_types=LAYER_TYPES, swiglu_limits=SWIGLU_LIMITS,
                  mtp_num_layers=MTP_DEPTHS, mtp_step35_heads=step35)
    fields.update(overrides)
    return kinds._config("gqa", tp, **fields)


def _reference_kinds(config):
    """Reference layer dicts of the main layers and of the MTP depths (global layers
    num_layers + k + 1), from the config's per-layer rules."""
    def kind_of(number):
        kind = config.get_config_for_layer(number)
        sliding = config.layer_type(number) == "sliding_attention"
        return dict(heads=kind.num_attention_heads, groups=kind.num_query_groups,
                    window=config.sliding_window if sliding else None,
                    rope_base=kind.rotary_base, rope_fraction=kind.rotary_percent,
                    swiglu_limit=config.swiglu_limit(number))

    n = config.num_layers
    return ([kind_of(i) for i in range(1, n + 1)],
            [kind_of(i) for i in range(n + 1, n + config.mtp_num_layers + 1)])


def _weights(main_layers, mtp_layers, seed=0):
    weights = kinds._global_weights(main_layers + mtp_layers, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    weights["mtp"] = weights["layers"][len(main_layers):]
    weights["layers"] = weights["layers"][:len(main_layers)]
    for w in weights["mtp"]:
        w.update(enorm=rand(HIDDEN, std=0.3), hnorm=rand(HIDDEN, std=0.3),
                 eh_proj=rand(HIDDEN, 2 * HIDDEN, std=0.2),
                 shared_head_norm=rand(HIDDEN, std=0.3),
                 shared_head_output=rand(VOCAB, HIDDEN, std=0.2))
    return weights


def _mtp_local_weights(config, weights, step35):
    from mcore_ext import _mcore_compat

    inner = _mcore_compat.MTP_INNER_LAYER_FIELD  # megatron-core 0.16: transformer_layer
    rows = builders.rank_rows_of_this_rank
    local = {}
    for k, w in enumerate(weights["mtp"]):
        p = f"mtp.layers.{k}."
        local.update(kinds.local_layer_weights(
            f"{p}{inner}.", w, config.get_config_for_layer(config.num_layers + k + 1)))
        local.update({p + "enorm.weight": w["enorm"], p + "hnorm.weight": w["hnorm"],
                      p + "eh_proj.weight": rows(w["eh_proj"]),
                      p + "final_layernorm.weight": w["shared_head_norm"]})
        if step35:
            local[p + "output_layer.weight"] = rows(w["shared_head_output"])
    return local


def _build_loaded(tp, step35, **overrides):
    import mcore_ext

    config = _config(tp, step35, **overrides)
    main_layers, mtp_layers = _reference_kinds(config)
    weights = _weights(main_layers, mtp_layers)
    model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      backend="sdpa")
    kinds.load_global_weights(model, config, weights,
                              extra=_mtp_local_weights(config, weights, step35))
    return model, weights, main_layers, mtp_layers


def _mtp_vs_reference(tp):
    """Per semantics: max abs diff of each depth's logits (gathered over TP) to the reference,
    the main logits' diff, the wrong variants' distance, and the local logits' shape."""
    import mcore_ext
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_ext.models import mtp_logits

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(tokens)
    results = {}
    for step35 in (True, False):
        try:
            model, weights, main_layers, mtp_layers = _build_loaded(tp, step35)
        except NotImplementedError as err:  # Step's MTP on megatron-core 0.16
            results[step35] = dict(refused=str(err))
            continue
        with torch.no_grad():
            local = mtp_logits(model, tokens, positions)
            got = [gather_from_tensor_model_parallel_region(x) for x in local]
            main = gather_from_tensor_model_parallel_region(model(tokens, positions, None))

        def ref(pre_norm_input, own_heads):
            return reference.step35_mtp_logits(tokens, weights, main_layers, mtp_layers, EPS,
                                               pre_norm_input=pre_norm_input, own_heads=own_heads)

        def diffs(a_list, b_list):
            return [(a[:, :SEQ - k - 1] - b[:, :SEQ - k - 1]).abs().max().item()
                    for k, (a, b) in enumerate(zip(a_list, b_list))]

        expected = ref(step35, step35)
        results[step35] = dict(
            diffs=diffs(got, expected),
            main_diff=(main - reference.step35_logits(tokens, weights, main_layers, EPS))
            .abs().max().item(),
            post_norm_input=diffs(ref(False, True), ref(True, True)),
            shared_head=diffs(ref(True, False), ref(True, True)),
            local_shape=tuple(local[0].shape), depths=len(local),
        )
    return results


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.smoke)])
def test_mtp_logits_match_reference(run_distributed, tp):
    from mcore_ext import _mcore_compat

    version = _mcore_compat.megatron_core_version()
    for rank, results in enumerate(run_distributed(_mtp_vs_reference, tp, world_size=2)):
        for step35, r in results.items():
            if "refused" in r:  # only Step's MTP, only where megatron lacks process_mtp_loss
                assert step35 and version.startswith("0.16"), (version, r)
                assert f"megatron-core {version}" in r["refused"], r
                continue
            assert r["depths"] == MTP_DEPTHS, r
            assert r["local_shape"] == (BATCH, SEQ, VOCAB // tp), r  # TP-split like the logits
            assert max(r["diffs"]) <= TOL, (rank, step35, r)
            assert r["main_diff"] <= TOL, (rank, step35, r)  # MTP leaves the main model alone
            # Controls: either wrong variant is far outside the tolerance at every depth.
            assert min(r["post_norm_input"]) > 1e-2, r
            assert min(r["shared_head"]) > 1e-2, r


# ------------------------------------------------------------------------------ config rules


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=LAYER_TYPES[:5]), "layer_types has 5 entries, num_layers is 4, "
                                        "mtp_num_layers is 2"),
    (dict(swiglu_limits=SWIGLU_LIMITS + [1.0]), "swiglu_limits has 7 entries"),
    (dict(mtp_detach_heads=True), "mtp_detach_heads=True is megatron's MTP option"),
    (dict(mtp_use_repeated_layer=True), "mtp_use_repeated_layer=True"),
    (dict(layer_types=["full_attention"] * 4, sliding_window=None, sliding_num_attention_heads=None,
          sliding_rotary_base=None, sliding_rotary_percent=None),
     "global layers [5, 6]; MTP layers without an entry are sliding"),
])
def test_bad_mtp_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _config(1, **overrides)


def test_mtp_layers_take_their_kind_from_padded_or_main_only_lists():
    padded = _config(1)
    assert [padded.layer_type(n) for n in (5, 6)] == ["sliding_attention", "full_attention"]
    assert [padded.swiglu_limit(n) for n in (5, 6)] == [0.05, None]
    assert padded.get_config_for_layer(5).window_size == (kinds.WINDOW - 1, 0)
    main_only = _config(1, layer_types=kinds.LAYER_TYPES, swiglu_limits=kinds.SWIGLU_LIMITS)
    # Step's rule: MTP layers without entries are sliding and unclamped.
    assert [main_only.layer_type(n) for n in (5, 6)] == ["sliding_attention"] * 2
    assert [main_only.swiglu_limit(n) for n in (5, 6)] == [None, None]


# -------------------------------------------------------------- context parallelism


def _mtp_cp_vs_cp1(cp):
    """Main and MTP logits at CP ``cp`` (this rank's tokens) against CP 1 on the same weights.
    SEQ 8 at CP 2 is 4 chunks of 2 tokens: every sliding layer (window 3), MTP depth 0's
    included, takes its halo from the chunk before, on another rank for half the chunks."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext.attention import context_parallel
    from mcore_ext.models import mtp_logits

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand_as(tokens)
    logits = {}
    for size in (1, cp):
        mcore_ext.init_parallel(context_parallel_size=size)
        model, *_ = _build_loaded(1, True, context_parallel_size=size)
        batch = dict(tokens=tokens, positions=positions)
        if size > 1:
            batch = context_parallel.get_batch_on_this_cp_rank(batch)
        with torch.no_grad():
            logits[size] = [model(batch["tokens"], batch["positions"], None)] + mtp_logits(
                model, batch["tokens"], batch["positions"])
        mcore_ext.destroy_parallel()
    # Positions of this rank's tokens: depth k is compared where it has real inputs.
    local_positions = context_parallel.zigzag_positions(SEQ // cp, cp, dist.get_rank())
    diffs = []
    for depth, (full, local) in enumerate(zip(logits[1], logits[cp])):
        keep = local_positions < SEQ - depth if depth else torch.ones_like(local_positions).bool()
        expected = full[:, local_positions]
        diffs.append((local[:, keep] - expected[:, keep]).abs().max().item())
    return diffs


def test_mtp_sliding_layers_under_cp2_match_cp1(run_distributed):
    from mcore_ext import _mcore_compat

    if _mcore_compat.megatron_core_version().startswith("0.16"):
        pytest.skip("Step's MTP needs megatron-core >= 0.17 (process_mtp_loss)")
    for diffs in run_distributed(_mtp_cp_vs_cp1, 2, world_size=2):
        assert len(diffs) == 1 + MTP_DEPTHS and max(diffs) <= TOL, diffs

# ------------------------------------------------------------------ checkpoints across padding


def _mtp_heads_across_vocabulary_padding(root):
    """Save a TP 2 Step-3.5 MTP model whose heads have 64 rows; load it into models of 128 and
    48 rows (other make_vocab_size_divisible_by, or Megatron-LM's 128 x TP rule). Returns per case
    the launcher's vocabulary message and whether every depth's head has the saved token rows."""
    import contextlib
    import io
    import os

    import mcore_ext
    from mcore_ext import checkpoint
    from mcore_ext.training import checkpointing

    tokens = 40  # the tokenizer's vocabulary: the rows every padding keeps
    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    saved = mcore_ext.build_gpt_model(_config(2), vocab_size=VOCAB, max_sequence_length=SEQ,
                                      backend="sdpa")
    directory = builders.shared_dir(os.path.join(root, "ckpt"))
    checkpoint.save(saved.sharded_state_dict(), directory)
    heads = [layer.output_layer.weight for layer in saved.mtp.layers]
    full = [gather(w) for w in heads]
    out = {}
    for case, rows in (("more padding", 128), ("less padding", 48)):
        torch.manual_seed(1)  # other weights than the saved model's
        model = mcore_ext.build_gpt_model(_config(2), vocab_size=rows, max_sequence_length=SEQ,
                                          backend="sdpa")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            checkpointing._check_vocabulary(directory, model.sharded_state_dict(), tokens)
        try:
            model.load_state_dict(checkpoint.load(model.sharded_state_dict(), directory))
        except Exception as err:  # noqa: BLE001 (the failure is the result)
            out[case] = dict(message=printed.getvalue(), error=f"{type(err).__name__}: {err}")
            continue
        loaded = [gather(layer.output_layer.weight) for layer in model.mtp.layers]
        out[case] = dict(
            message=printed.getvalue(),
            token_rows_equal=all(torch.equal(a[:tokens], b[:tokens]) for a, b in zip(loaded, full)),
            rows=[w.size(0) for w in loaded],
        )
    return out


def gather(weight):
    """[v / TP, h] rows of every TP rank -> [v, h]."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(weight.detach().t().contiguous()).t()


def test_mtp_heads_load_across_vocabulary_padding(run_distributed, tmp_path):
    """Each depth's output_layer loads like GPTModel's (megatron's allow_shape_mismatch): the
    token rows exactly, padding rows the checkpoint lacks at zero; the launcher names the change.
    Before, a changed padding failed with a global shape mismatch on
    mtp.layers.0.output_layer.weight."""
    from mcore_ext import _mcore_compat

    if _mcore_compat.megatron_core_version().startswith("0.16"):
        pytest.skip("Step-3.5 MTP heads need megatron-core >= 0.17")
    outs = run_distributed(_mtp_heads_across_vocabulary_padding, str(tmp_path), world_size=2)
    for rank, out in enumerate(outs):
        for case, rows in (("more padding", 128), ("less padding", 48)):
            result = out[case]
            assert "error" not in result, result
            assert result["token_rows_equal"] and result["rows"] == [rows] * MTP_DEPTHS, result
            for depth in range(MTP_DEPTHS):  # rank 0 says it
                change = f"mtp.layers.{depth}.output_layer.weight {VOCAB} -> {rows}"
                assert (change in result["message"]) == (rank == 0), (rank, result)


# ------------------------------------------------------------------------ speculative decoding


class _SpeculativeDecodingContext:
    """What megatron's GPTModel reads to tell speculative decoding (dynamic batching drafting
    tokens): a stand-in for a DynamicInferenceContext, which needs a GPU to build."""

    num_speculative_tokens = 2

    @staticmethod
    def is_dynamic_batching():
        return True


def _speculative_decoding_refusals():
    import mcore_ext
    from mcore_ext import _mcore_compat

    mcore_ext.init_parallel()
    out = {}
    for step35 in (True, False):
        try:
            model = mcore_ext.build_gpt_model(_config(1, step35), vocab_size=VOCAB,
                                              max_sequence_length=SEQ, backend="sdpa")
        except NotImplementedError:  # Step's MTP on megatron-core 0.16
            continue
        hidden = torch.randn(SEQ, BATCH, HIDDEN)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        calls = {
            "postprocess": lambda: model._postprocess(
                hidden, tokens, None, None, None, None, None, mtp_in_postprocess=True,
                inference_context=_SpeculativeDecodingContext()),
        }
        if hasattr(type(model).__mro__[1], "compute_mtp_single_step"):  # megatron-core 0.19+
            calls["single_step"] = lambda: model.compute_mtp_single_step(
                torch.randn(BATCH, 1, HIDDEN), tokens[:1, :BATCH], torch.zeros(1, BATCH).long(),
                depth=0)
        for name, call in calls.items():
            try:
                call()
                out[(step35, name)] = None
            except NotImplementedError as err:
                out[(step35, name)] = str(err)
            except Exception as err:  # noqa: BLE001 (megatron's own path, not refused here)
                out[(step35, name)] = f"other: {type(err).__name__}"
    out["version"] = _mcore_compat.megatron_core_version()
    return out


def test_speculative_decoding_is_refused_for_step35_heads(run_distributed):
    """megatron's speculative decoding caches the post-norm decoder output and drafts every depth
    with the main output layer: wrong inputs and heads for Step's MTP, a silent loss of acceptance.
    Refused by name for mtp_step35_heads=True; megatron's own MTP is left to megatron."""
    out = run_distributed(_speculative_decoding_refusals, world_size=1)[0]
    version = out.pop("version")
    step35 = {name: message for (is_step35, name), message in out.items() if is_step35}
    if version.startswith("0.16"):
        assert not step35, out
        return
    assert sorted(step35) == (["postprocess", "single_step"] if version >= "0.19"
                              else ["postprocess"]), out
    for message in step35.values():
        assert message is not None and message.startswith(
            "megatron's speculative decoding with MTP (num_speculative_tokens > 0"), out
        assert "mtp_step35_heads=True" in message, out
    for (is_step35, name), message in out.items():
        if not is_step35:  # megatron's MTP: not refused by mcore_ext
            assert message is None or not message.startswith("megatron's speculative"), out
