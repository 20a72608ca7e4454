"""HybridModel (``build_hybrid_model``) against GPTModel under the layouts test_hybrid_model.py
does not cover, on real gloo ranks, with its helpers: the same weights (seeded by parameter
name, loaded strictly with GPT layer g as hybrid layers 2g - 1 and 2g), ``(logits * target)``
summed, logits and every gradient within 1e-5 (fp32; gradients O(10), 10x that).

- A pattern's own ``|`` stages at PP 2: even (``*-*-|*-*-``) and uneven (``*-*-|*-``, GPT layers
  2 + 1) against GPTModel with ``num_layers_in_first_pipeline_stage=2``, through megatron's
  schedule; the GPT config alone (no pattern) makes the same stages, a pattern whose stages
  disagree with the config's split is refused in one line.
- Activation recompute, full (uniform and block, 1 layer) and selective, as the launcher's
  ``model.recompute_granularity`` sets it; ``recompute_num_layers`` counts GPT layers on both
  (megatron's checkpoint calls counted).
- Packed documents (THD, ``PackedSeqParams`` of test_sft_packed_loss's conversations) through
  the launcher's forward step at CP 1 and CP 2: loss, each token's logits, every gradient.
- CP 2's all-gather path for sliding layers (a window that reaches the sequence start, with
  ``cp_comm_type='all_gather'``): no halo exchange is made.
- A GPT checkpoint (dist_checkpointing, in process) into the hybrid model at another PP (1 -> 2)
  and another EP (2 -> 1): the loaded model's logits equal the saving GPT model's.
"""

import pytest
import torch

from tests import builders
from tests.unit import test_hybrid_model, test_layer_kinds, test_moe, test_sft_packed_loss
from tests.unit.test_hybrid_model import (BATCH, SEQ, TOL, VOCAB, _logits_and_grads, _randomize,
                                          hybrid_name)

SLIDING = (test_layer_kinds.WINDOW - 1, 0)


def _three_layer_config(**overrides):
    """test_layer_kinds' model with 3 layers (full, sliding, sliding; layer 3's clamp hit)."""
    return test_hybrid_model._kinds_config(
        1, 1, num_layers=3, layer_types=test_layer_kinds.LAYER_TYPES[:3],
        swiglu_limits=test_layer_kinds.SWIGLU_LIMITS[:3], **overrides)


# ---------------------------------------------------------------- pipeline stages of a pattern

PIPELINE_RUNS = {
    # name: (config overrides, hybrid_layer_pattern)
    "even": (dict(num_layers=4), "*-*-|*-*-"),
    "uneven": (dict(num_layers=3, num_layers_in_first_pipeline_stage=2), "*-*-|*-"),
    "uneven_derived": (dict(num_layers=3, num_layers_in_first_pipeline_stage=2), None),
}


def _pipeline_config(num_layers, **overrides):
    fields = dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, **overrides)
    if num_layers == 3:
        return _three_layer_config(**fields)
    return test_hybrid_model._kinds_config(1, 1, **fields)


def _pipeline_hybrid_vs_gpt(names):
    """{name: (relative loss diff or None off the last stage, gradient diff, this stage's
    layers: hybrid number, GPT number, window)} at PP 2, and the refusal of a pattern whose
    stages are not the config's."""
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(pipeline_model_parallel_size=2)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    build = dict(vocab_size=VOCAB, max_sequence_length=SEQ, backend="sdpa")
    results = {}
    for name in names:
        overrides, pattern = PIPELINE_RUNS[name]
        config = _pipeline_config(**overrides)
        gpt = mcore_ext.build_gpt_model(config, **build)
        _randomize(gpt)
        hybrid = mcore_ext.build_hybrid_model(config, hybrid_layer_pattern=pattern, **build)
        hybrid.load_state_dict({hybrid_name(k): v for k, v in gpt.state_dict().items()},
                               strict=True)
        with cuda_to_cpu():  # megatron's schedule allocates on "cuda"
            expected, gpt_grads = test_hybrid_model._pipeline_loss_and_grads(gpt, tokens, target)
            loss, grads = test_hybrid_model._pipeline_loss_and_grads(hybrid, tokens, target)
        grad_diff = max((grads[hybrid_name(n)] - grad).abs().max().item()
                        for n, grad in gpt_grads.items())
        results[name] = (None if loss is None else abs(loss - expected) / abs(expected),
                         grad_diff, [(layer.layer_number, layer.gpt_layer_number,
                                      layer.config.window_size)
                                     for layer in hybrid.decoder.layers],
                         hybrid.hybrid_layer_pattern)
    try:
        mcore_ext.build_hybrid_model(_pipeline_config(**PIPELINE_RUNS["uneven"][0]),
                                     hybrid_layer_pattern="*-|*-*-", **build)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    mcore_ext.destroy_parallel()
    return results, refusal


def test_pattern_pipeline_stages_match_gpt_at_pp2(run_distributed):
    """Before: the uneven config built its hybrid model with megatron's split counted in hybrid
    layers (stage 0 held GPT layer 1 only, ``*-``: its GPT state dict did not load), and a
    pattern's '|' beside the config's counts raised megatron's 'Cannot specify
    num_layers_in_first_pipeline_stage ...'."""
    (first, refusal), (last, _) = run_distributed(
        _pipeline_hybrid_vs_gpt, list(PIPELINE_RUNS), world_size=2, timeout=600)
    for name in PIPELINE_RUNS:
        assert first[name][0] is None and last[name][0] <= TOL, (name, last[name])
        assert first[name][1] <= TOL * 10 and last[name][1] <= TOL * 10, (name, first, last)
    assert first["even"][2] == [(1, 1, None), (2, 1, None), (3, 2, SLIDING), (4, 2, SLIDING)]
    assert last["even"][2] == [(5, 3, SLIDING), (6, 3, SLIDING), (7, 4, None), (8, 4, None)]
    for name in ("uneven", "uneven_derived"):
        assert first[name][2] == [(1, 1, None), (2, 1, None), (3, 2, SLIDING), (4, 2, SLIDING)]
        assert last[name][2] == [(5, 3, SLIDING), (6, 3, SLIDING)]
        assert first[name][3] == last[name][3] == "*-*-|*-"
    assert refusal == (
        "hybrid_layer_pattern='*-|*-*-' puts [1, 2] attention layers ('*') on its pipeline "
        "stages, the config's GPT layers per stage are [2, 1] (num_layers_in_first_pipeline_stage"
        " 2, num_layers_in_last_pipeline_stage None): give each stage that many '*', or leave "
        "the '|' out")


def test_staged_pattern_follows_the_configs_gpt_split():
    """``|`` where the config's GPT stages end: first / last stage counts, megatron's
    ``pipeline_model_parallel_layout``, MTP depths kept after the main pattern; none for an
    even split (megatron's own)."""
    from mcore_ext.models.hybrid import staged_pattern

    def three(pp, **split):
        return _three_layer_config(pipeline_model_parallel_size=pp,
                                   pipeline_dtype=torch.float32, **split)

    assert staged_pattern("*-*-*-", three(2, num_layers_in_last_pipeline_stage=2)) == "*-|*-*-"
    layout = [["embedding", "decoder"], ["decoder", "decoder", "loss"]]
    assert staged_pattern("*-*-*-", three(2, pipeline_model_parallel_layout=layout)) == "*-|*-*-"
    assert staged_pattern("*-*-*-/*-", three(3, num_layers_in_first_pipeline_stage=1,
                                             num_layers_in_last_pipeline_stage=1)) == "*-|*-|*-/*-"
    four = test_hybrid_model._kinds_config(1, 1, pipeline_model_parallel_size=2,
                                           pipeline_dtype=torch.float32)
    assert staged_pattern("*-*-*-*-", four) == "*-*-*-*-"


# --------------------------------------------------- recompute, CP's all-gather (the main runs)

def _recompute_full(tp, ep, cp=1):
    return test_hybrid_model._kinds_config(tp, ep, cp, recompute_granularity="full",
                                           recompute_method="uniform", recompute_num_layers=1)


def _recompute_block(tp, ep, cp=1):
    return test_hybrid_model._kinds_config(tp, ep, cp, recompute_granularity="full",
                                           recompute_method="block", recompute_num_layers=1)


def _recompute_selective(tp, ep, cp=1):
    return test_hybrid_model._kinds_config(tp, ep, cp, recompute_granularity="selective")


def _all_gather_cp(tp, ep, cp=1):
    """Sliding layers whose window (SEQ) reaches the sequence start from every query: under CP
    they all-gather K/V as full layers do (cp_comm_type 'all_gather'), no halo."""
    return test_hybrid_model._kinds_config(tp, ep, cp, sliding_window=SEQ,
                                           cp_comm_type="all_gather")


CONFIGS = {"recompute_full": _recompute_full, "recompute_block": _recompute_block,
           "recompute_selective": _recompute_selective,
           "all_gather_cp": _all_gather_cp, "kinds": test_hybrid_model._kinds_config}


def _counted(module, name, calls):
    """``module.name`` counting its calls into ``calls``; returns the original."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def _layouts_hybrid_vs_gpt(runs):
    """test_hybrid_model's comparison of these CONFIGS, run by run, with the recomputed
    segments (megatron's ``tensor_parallel.checkpoint`` calls) and the halo exchanges (CP's
    ``_halo_attention``) of the GPT and hybrid forwards: {run: (comparison, calls)}."""
    from megatron.core import tensor_parallel

    from mcore_ext.attention import context_parallel

    results = {}
    for run in runs:
        calls = {}
        spied = [(tensor_parallel, "checkpoint"), (context_parallel, "_halo_attention")]
        originals = [_counted(module, name, calls) for module, name in spied]
        try:
            (comparison,) = test_hybrid_model._hybrid_vs_gpt([run], configs=CONFIGS).values()
        finally:
            for (module, name), original in zip(spied, originals):
                setattr(module, name, original)
        results[run] = comparison, calls
    return results


@pytest.mark.parametrize("runs, calls", [
    # uniform, 1 layer: GPT's 4 layers and the hybrid model's 4 pairs ('*-'), each recomputed
    # on its own (recompute_num_layers counts GPT layers, megatron's HybridStack hybrid ones);
    # block, 1 layer: GPT layer 1, and its two hybrid layers; selective: the 4 core attentions
    # of each model
    ([("recompute_full", 2, 1, 1, "sdpa"), ("recompute_block", 1, 1, 1, "sdpa"),
      ("recompute_selective", 1, 1, 1, "sdpa")],
     [{"checkpoint": 8}, {"checkpoint": 3}, {"checkpoint": 8}]),
    # the all-gather variant: no halo; the control (window 3 < SEQ): the 2 sliding layers of
    # GPT's, the hybrid model's and its kinds-swapped control's forward exchange halos
    ([("all_gather_cp", 1, 1, 2, "sdpa"), ("kinds", 1, 1, 2, "sdpa")],
     [{}, {"_halo_attention": 6}]),
], ids=["recompute", "cp2_all_gather"])
def test_hybrid_model_matches_gpt_model_in_more_layouts(run_distributed, runs, calls):
    """Full recompute (uniform, 1 layer) at TP 2 x SP, selective at TP 1; CP 2 with the sliding
    layers on the all-gather path (their window covers the sequence; the kinds still differ in
    heads and RoPE)."""
    for rank_results in run_distributed(_layouts_hybrid_vs_gpt, runs, world_size=2,
                                        timeout=600):
        assert [rank_results[run][1] for run in runs] == calls, rank_results
        for run in runs:
            logits, grads, n_gpt, n_hybrid, _, scale, *_rest = rank_results[run][0]
            assert n_gpt == n_hybrid and scale > 0.1, run
            assert logits <= TOL and grads <= TOL * 10, (run, logits, grads)


# ------------------------------------------------------------------------- packed documents

def _packed_hybrid_vs_gpt(cp):
    """Packed conversations (test_sft_packed_loss's rows: 2 THD micro-batches of 2 rows)
    through the launcher's forward step and megatron's schedule on GPTModel and HybridModel of
    Step-3.5's kinds: (loss diff, logits diff, gradient diff, loss, documents)."""
    import mcore_ext
    from mcore_ext._cpu_compat import cuda_to_cpu

    mcore_ext.init_parallel(context_parallel_size=cp)
    config = test_layer_kinds._config("gqa", 1, context_parallel_size=cp,
                                      calculate_per_token_loss=True)
    lengths = test_sft_packed_loss.CP_LENGTHS if cp > 1 else test_sft_packed_loss.LENGTHS
    docs = test_sft_packed_loss._conversations(VOCAB, lengths)
    batches = test_sft_packed_loss._micro_batches(docs, cp)
    build = dict(vocab_size=VOCAB, max_sequence_length=SEQ, backend="sdpa")
    out = {}
    with cuda_to_cpu():
        gpt = mcore_ext.build_gpt_model(config, **build)
        _randomize(gpt)
        hybrid = mcore_ext.build_hybrid_model(config, **build)
        hybrid.load_state_dict({hybrid_name(k): v for k, v in gpt.state_dict().items()},
                               strict=True)
        for name, model in (("gpt", gpt), ("hybrid", hybrid)):
            model, _ = builders.ddp_and_optimizer(config, model, distributed_optimizer=False)
            loss = test_sft_packed_loss._schedule(model, batches, forward_only=False)
            grads = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
            logits = [test_sft_packed_loss._logits(model, batch) for batch in batches]
            out[name] = loss, grads, logits
    mcore_ext.destroy_parallel()
    (expected, gpt_grads, gpt_logits), (loss, grads, logits) = out["gpt"], out["hybrid"]
    return (abs(loss - expected), max((a - b).abs().max().item()
                                      for a, b in zip(logits, gpt_logits)),
            max((grads[hybrid_name(n)] - g).abs().max().item() for n, g in gpt_grads.items()),
            expected, sum(len(b["cu_seqlens"]) - 1 for b in batches))


@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
def test_packed_documents_on_hybrid_match_gpt(run_distributed, cp):
    """At CP 1 (2 ranks: DP 2) seven conversations and two padding documents, at CP 2 six
    conversations, each split into 2 x CP chunks of its own (halo and all-gather paths)."""
    for loss, logits, grads, expected, documents in run_distributed(
            _packed_hybrid_vs_gpt, cp, world_size=2, timeout=600):
        assert documents == (6 if cp > 1 else 9) and expected > 1.0
        assert loss <= TOL and logits <= TOL and grads <= TOL, (loss, logits, grads)


# -------------------------------------------------- a GPT checkpoint at another PP or EP

def _checkpoint_config(case, pp, ep):
    overrides = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    if case == "moe":
        return test_moe.moe_config(1, ep, **overrides)
    return test_hybrid_model._kinds_config(1, ep, **overrides)


def _pipeline_logits(model, tokens):
    """Logits [b, s, v] through megatron's schedule, forward only (None off the last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(SEQ).expand_as(tokens)

    def forward_step(data, chunk):
        def keep(logits):
            return logits.sum() * 0, {"logits": logits.detach()}

        return chunk(tokens, positions, None), keep

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=True)
    return out[0]["logits"] if out else None


def _gpt_checkpoint_into_hybrid(case, save, load, directory):
    """GPTModel at ``save`` (PP, EP) saves its seeded weights; the hybrid model at ``load``
    loads them (``retarget_to_gpt_checkpoint``): (logits diff on the last stage or None, the
    logits' scale, the architecture the checkpoint was saved from)."""
    import mcore_ext
    from megatron.core import dist_checkpointing

    from mcore_ext import checkpoint
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.checkpoint import architecture

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    build = dict(vocab_size=VOCAB, max_sequence_length=SEQ, backend="sdpa")
    with cuda_to_cpu():
        models = []
        for builder, (pp, ep) in ((mcore_ext.build_gpt_model, save),
                                  (mcore_ext.build_hybrid_model, load)):
            mcore_ext.init_parallel(pipeline_model_parallel_size=pp,
                                    expert_model_parallel_size=ep)
            model = builder(_checkpoint_config(case, pp, ep), **build)
            model.eval()
            if builder is mcore_ext.build_gpt_model:
                _randomize(model)
                checkpoint.save({"model": model.sharded_state_dict()},
                                builders.shared_dir(directory))
            else:
                saved = set(dist_checkpointing.load_tensors_metadata(directory))
                state = {"model": model.sharded_state_dict()}
                architecture.retarget_to_gpt_checkpoint(state["model"],
                                                        model.hybrid_layer_pattern, saved)
                model.load_state_dict(checkpoint.load(state, directory)["model"])
            with torch.no_grad():
                models.append(_pipeline_logits(model, tokens))
            mcore_ext.destroy_parallel()
    expected, logits = models
    if logits is None:
        return None, None, architecture.saved_architecture(saved)
    return ((logits - expected).abs().max().item(), expected.abs().max().item(),
            architecture.saved_architecture(saved))


@pytest.mark.parametrize("case, save, load, world", [
    ("kinds", (1, 1), (2, 1), 2),
    ("moe", (1, 2), (1, 1), 2),
    pytest.param("moe", (1, 1), (2, 2), 4, marks=pytest.mark.slow),
], ids=["kinds_pp1_to_pp2", "moe_ep2_to_ep1", "moe_pp1_ep1_to_pp2_ep2"])
def test_gpt_checkpoint_loads_into_hybrid_at_another_pp_or_ep(run_distributed, tmp_path, case,
                                                              save, load, world):
    """(PP, EP) saved -> loaded; the slow one on 4 ranks (PP 2 x EP 2, from DP 4)."""
    ranks = run_distributed(_gpt_checkpoint_into_hybrid, case, save, load, str(tmp_path),
                            world_size=world, timeout=600)
    last = ranks[-1]
    assert all(saved_as == "gpt" for *_, saved_as in ranks), ranks
    assert last[1] > 0.1 and last[0] <= TOL, ranks
    if load[0] == 1:  # every rank holds the whole model
        assert ranks[0][0] <= TOL, ranks
