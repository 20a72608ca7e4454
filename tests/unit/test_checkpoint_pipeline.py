"""Resharding across tensor and pipeline parallelism: (tp, pp) = (2, 1) -> (1, 2) -> (2, 1).

Each load goes into a model built from a different seed; its logits must equal the source model's
(fp32, max abs diff <= 1e-5) and saving it again must reproduce the checkpoint's plain tensors.
With pp = 2, stage 0 holds the embedding and layer 1, stage 1 layer 2 and the output layer; the
hidden states travel between them with a point-to-point send.
"""

import torch

from tests import builders

TOL = 1e-5


def _model(tp, pp):
    from megatron.core import parallel_state

    config = builders.gated_config(hidden_size=64, num_attention_heads=8, num_query_groups=2,
                                   kv_channels=8, add_qkv_bias=True, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    return builders.build_gpt(config, parallel_output=False,
                              pre_process=parallel_state.is_pipeline_first_stage(),
                              post_process=parallel_state.is_pipeline_last_stage())


def _logits(model):
    """Full logits on every rank, through the pipeline when there is one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(16).expand_as(tokens)
    logits = torch.empty(2, 16, 64)
    with torch.no_grad():
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return model(tokens, positions, None)
        rank, pp_group = dist.get_rank(), parallel_state.get_pipeline_model_parallel_group()
        first, last = (dist.get_global_rank(pp_group, i) for i in (0, 1))
        if parallel_state.is_pipeline_first_stage():
            dist.send(model(tokens, positions, None).contiguous(), last)  # hidden [s, b, h]
            dist.recv(logits, last)
        else:
            hidden = torch.empty(16, 2, 64)
            dist.recv(hidden, first)
            model.set_input_tensor(hidden)
            logits = model(tokens, positions, None)
            dist.send(logits.contiguous(), first)
    return logits




def _save(tp, pp, path):
    import mcore_ext

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = _model(tp, pp)
    checkpoint.save(model.sharded_state_dict(), builders.shared_dir(path))
    return _logits(model)


def _load_compare_resave(tp, pp, source, target, expected):
    import mcore_ext
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            seed=99)
    model = _model(tp, pp)
    before = (_logits(model) - expected).abs().max().item()
    model.load_state_dict(checkpoint.load(model.sharded_state_dict(), source))
    logits = _logits(model)
    checkpoint.save(model.sharded_state_dict(), builders.shared_dir(target))
    dist.barrier()
    original, again = (dist_checkpointing.load_plain_tensors(d) for d in (source, target))
    identical = original.keys() == again.keys() and all(
        torch.equal(original[k], again[k]) for k in original)
    return before, (logits - expected).abs().max().item(), identical, logits


def test_reshard_tp2_pp1_to_tp1_pp2_and_back(run_distributed, tmp_path):
    tp2 = str(tmp_path / "tp2_pp1")
    expected = run_distributed(_save, 2, 1, tp2, world_size=2)[0]
    pp2 = str(tmp_path / "tp1_pp2")
    for before, after, identical, _ in run_distributed(_load_compare_resave, 1, 2, tp2, pp2,
                                                       expected, world_size=2):
        assert before > 1e-3 and after <= TOL and identical, (before, after, identical)
    back = str(tmp_path / "back_tp2_pp1")
    for before, after, identical, _ in run_distributed(_load_compare_resave, 2, 1, pp2, back,
                                                       expected, world_size=2):
        assert before > 1e-3 and after <= TOL and identical, (before, after, identical)
