"""A GPTModel checkpoint (model + Adam) loads into the HybridModel of the same config through
``mcore_ext.checkpoint.architecture`` (megatron's load-time translation), on 2 gloo ranks.

Two formats: the dense gated model saves GPT's stacked keys (``decoder.layers.<name>``, the
layer a sharding axis: megatron's ``gpt_checkpoint_interop``), saved at TP 2 with megatron's
plain optimizer and loaded at TP 1 x DP 2; Step-3.5's kinds with MoE (test_moe.moe_config: layer
1 dense, 2-4 MoE with the expert bias) and 2 depths of Step's MTP save one key per layer
(renumbered; each MTP depth's layer is the hybrid depth's two layers), at EP 2 with the
distributed optimizer (fully_reshardable, the experts' own chained optimizer). The GPT model
trains 2 steps, saves, trains 2 more; the hybrid model loads the save and trains the same 2
steps: its losses, and its MTP losses (which read the MTP weights directly), equal the GPT
run's within 1e-5 (fp32; the TP change reorders reductions).
The control (dense) loads the weights alone (a fresh Adam): its second step differs by more than
100x that bound, so the optimizer state is what the comparison sees.
"""

import pytest
import torch

from tests import builders
from tests.unit import test_hybrid_model

TOL = 1e-5
SEQ, BATCH = 8, 4
VOCAB = test_hybrid_model.VOCAB


def _batches():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]


def _model(build, case, tp, ep, distributed_optimizer):
    import mcore_ext

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            seed=1234)
    config = test_hybrid_model.CONFIGS[case](tp, ep)
    model = build(config, vocab_size=VOCAB, max_sequence_length=SEQ, backend="sdpa")
    return builders.ddp_and_optimizer(config, model, distributed_optimizer)


def _gpt_then_hybrid(case, save_layout, load_layout, distributed_optimizer, directory, control):
    """(GPT's losses of steps 3-4, the hybrid's from the checkpoint, the control's (with
    ``control``, else None), the checkpoint's architecture as read from its keys, whether its
    keys are stacked)."""
    import mcore_ext
    from megatron.core import dist_checkpointing

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mcore_ext import _mcore_compat, checkpoint
    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.checkpoint import architecture

    batches = _batches()
    MTPLossLoggingHelper.tracker.clear()  # sized by the first model of the process to track

    def mtp_losses():
        depths = test_hybrid_model.CONFIGS[case](1, 1).mtp_num_layers
        return depths and _mcore_compat.take_mtp_losses(depths).tolist()

    with cuda_to_cpu():  # megatron's optimizer and schedule allocate on "cuda" literally
        model, optimizer = _model(mcore_ext.build_gpt_model, case, *save_layout,
                                  distributed_optimizer)
        for tokens in batches[:2]:
            builders.train_step(model, optimizer, tokens)
        checkpoint.save(builders.training_state(model, optimizer, False),
                        builders.shared_dir(directory))
        mtp_losses()
        expected = [builders.train_step(model, optimizer, tokens) for tokens in batches[2:]]
        expected_mtp = mtp_losses()
        mcore_ext.destroy_parallel()

        saved = set(dist_checkpointing.load_tensors_metadata(directory))
        continued = []
        for with_optimizer in (True, False)[:2 if control else 1]:
            model, optimizer = _model(mcore_ext.build_hybrid_model, case, *load_layout,
                                      distributed_optimizer)
            state = builders.training_state(model, optimizer, True, with_optimizer)
            for part in state.values():
                architecture.retarget_to_gpt_checkpoint(
                    part, model.module.hybrid_layer_pattern, saved)
            loaded = checkpoint.load(state, directory)
            model.module.load_state_dict(loaded["model"])
            if with_optimizer:
                checkpoint.load_optimizer_state_dict(optimizer, loaded["optimizer"])
            continued.append([builders.train_step(model, optimizer, t) for t in batches[2:]])
            continued_mtp = mtp_losses()
            mcore_ext.destroy_parallel()
    stacked = "decoder.layers.mlp.linear_fc1.weight" in saved
    return (expected, continued[0], continued[1] if control else None,
            architecture.saved_architecture(saved), stacked, expected_mtp, continued_mtp)


def test_gpt_checkpoint_loads_into_hybrid_model_with_its_optimizer(run_distributed, tmp_path):
    """About 90 s on the 2 loaded cores (the control on the dense case only)."""
    for case, save, load, distributed, stacked in (
            ("dense", (2, 1), (1, 1), False, True), ("moe_mtp", (1, 2), (1, 2), True, False)):
        control = case == "dense"
        for rank in run_distributed(_gpt_then_hybrid, case, save, load, distributed,
                                    str(tmp_path / case), control, world_size=2, timeout=600):
            expected, continued, fresh_adam, saved_as, saved_stacked, mtp, continued_mtp = rank
            assert saved_as == "gpt" and saved_stacked == stacked, (case, rank)
            assert continued == pytest.approx(expected, abs=TOL, rel=0), (case, rank)
            if case == "moe_mtp":  # 2 depths, summed over steps 3-4
                assert len(mtp) == 2 and min(mtp) > 1.0, rank
                assert continued_mtp == pytest.approx(mtp, abs=TOL, rel=0), (case, rank)
            if control:
                assert abs(fresh_adam[1] - expected[1]) > 100 * TOL, (case, rank)
