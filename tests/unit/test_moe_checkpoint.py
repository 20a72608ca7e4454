"""Distributed checkpoints of the MoE model reshard across EP, TP and PP, optimizer state included.

The 4-layer Step-3.5-like MoE model of test_moe.py (layer 1 dense, 2-4 MoE with 4 experts, a
shared expert, both attention kinds, clamps) trains 3 steps at TP 2 x EP 2 on 4 ranks with
megatron's distributed optimizer (fully_reshardable; the expert parameters have their own chained
optimizer), saves model + optimizer, and resumes for 3 more steps at TP 1 x EP 4, TP 1 x EP 2 x
PP 2 and TP 1 x EP 1 (where megatron alone would build one optimizer instead of a chain of two:
mcore_ext.moe.mark_expert_parameters); the losses must equal an uninterrupted TP 2 x EP 2 run's
within 1e-5 (fp32; the global batch is fixed, so the DP size changing with the layout does not
change a step).
Loaded weights are exact: saving them again at the new layout reproduces every model tensor of
the checkpoint bit for bit (experts keyed by global index, the gate's _qkv / _gate keys as
before). Resuming with a fresh Adam does not reproduce the run (the moments matter).
"""

import pytest
import torch

from tests import builders
from tests.unit.test_moe import VOCAB, moe_config

GLOBAL_BATCH, SEQ = 4, 8
TOL = 1e-5


def _train(layout, steps, save_dir=None, load_dir=None, first_step=0, load_optimizer=True,
           resave_dir=None):
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():  # megatron's optimizer and schedules allocate on 'cuda' literally
        return _train_on_this_rank(layout, steps, save_dir, load_dir, first_step,
                                   load_optimizer, resave_dir)


def _train_on_this_rank(layout, steps, save_dir, load_dir, first_step, load_optimizer,
                        resave_dir):
    import mcore_ext
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_ext import checkpoint

    tp, ep, pp = layout
    mcore_ext.init_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            pipeline_model_parallel_size=pp, seed=10 * tp + ep)
    config = moe_config(tp, ep, "alltoall", pipeline_model_parallel_size=pp,
                        pipeline_dtype=torch.float32)
    model, optimizer = builders.ddp_and_optimizer(
        config, mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                          backend="sdpa"), distributed_optimizer=True)
    if load_dir:
        builders.load_training_state(model, optimizer, load_dir, with_optimizer=load_optimizer)
    identical = None
    if resave_dir:
        checkpoint.save({"model": model.module.sharded_state_dict()},
                        builders.shared_dir(resave_dir))
        dist.barrier()
        original, again = (dist_checkpointing.load_plain_tensors(d) for d in (load_dir,
                                                                              resave_dir))
        model_keys = sorted(k for k in original if not k.startswith(("optimizer", "chained_")))
        # problems: keys on one side only, tensors that differ (empty = bit for bit)
        identical = sorted(set(model_keys) ^ set(again)) + [
            k for k in model_keys if k in again and not torch.equal(original[k], again[k])]
        assert any("_gate" in k for k in model_keys), model_keys
        assert any("experts.experts.linear_fc1" in k for k in model_keys), model_keys

    losses = [builders.train_step(model, optimizer,
                                  torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1),
                                                generator=torch.Generator().manual_seed(step)))
              for step in range(first_step, first_step + steps)]

    if save_dir:
        checkpoint.save(builders.training_state(model, optimizer, False),
                        builders.shared_dir(save_dir))
    return dict(losses=losses, identical=identical)


@pytest.mark.slow  # 6 training runs on 4 ranks: about 4 minutes on 2 cores
def test_moe_checkpoint_reshards_across_ep_tp_pp_with_optimizer(run_distributed, tmp_path):
    def run(*args, **kwargs):
        return run_distributed(_train, *args, world_size=4, timeout=600, **kwargs)[0]

    source = str(tmp_path / "tp2_ep2")
    uninterrupted = run((2, 2, 1), 6)["losses"]
    first_half = run((2, 2, 1), 3, save_dir=source)["losses"]
    assert first_half == uninterrupted[:3]
    fresh_adam = run((1, 4, 1), 3, load_dir=source, first_step=3, load_optimizer=False)["losses"]
    assert max(abs(a - b) for a, b in zip(fresh_adam, uninterrupted[3:])) > 1e-3
    for layout in ((1, 4, 1), (1, 2, 2), (1, 1, 1)):
        name = "_".join(map(str, layout))
        r = run(layout, 3, load_dir=source, first_step=3, resave_dir=str(tmp_path / name))
        assert r["identical"] == [], (layout, r["identical"])
        diffs = [abs(a - b) for a, b in zip(r["losses"], uninterrupted[3:])]
        assert max(diffs) <= TOL, (layout, r["losses"], uninterrupted[3:])
