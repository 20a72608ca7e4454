"""Distributed checkpoints of a 2-layer gated GPTModel reshard exactly across TP sizes.

For each source TP in {1, 2, 4} six variants are saved (MHA / GQA with G = 4 = tp_max / GQA with
G = 2 < tp_max, each with and without QKV bias). Each is loaded at every other TP into a model
built from a different seed: its logits must equal the source model's (fp32, max abs diff
<= 1e-5) and saving it again must reproduce the checkpoint's plain tensors bit for bit.
"""

import pytest
import torch

from tests import builders

VARIANTS = {
    f"{attention}_{'bias' if bias else 'nobias'}": dict(num_query_groups=groups, add_qkv_bias=bias)
    for attention, groups in (("mha", 8), ("gqa_g4", 4), ("gqa_g2", 2))
    for bias in (True, False)
}
TOL = 1e-5


def _config(tp, variant):
    return builders.gated_config(hidden_size=64, num_attention_heads=8, kv_channels=8,
                                 tensor_model_parallel_size=tp, **VARIANTS[variant])


def _logits(model):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(16).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def _save_variants(tp, root):
    import mcore_ext
    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=tp)
    logits = {}
    for variant in VARIANTS:
        model = builders.build_gpt(_config(tp, variant), parallel_output=False)
        logits[variant] = _logits(model)
        checkpoint.save(model.sharded_state_dict(), builders.shared_dir(f"{root}/{variant}/tp{tp}"))
    return logits


def _load_compare_resave(tp, root, src_tp, expected):
    import mcore_ext
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=100 + tp)
    results = {}
    for variant in VARIANTS:
        model = builders.build_gpt(_config(tp, variant), parallel_output=False)
        before = (_logits(model) - expected[variant]).abs().max().item()
        source = f"{root}/{variant}/tp{src_tp}"
        model.load_state_dict(checkpoint.load(model.sharded_state_dict(), source))
        after = (_logits(model) - expected[variant]).abs().max().item()

        resaved = builders.shared_dir(f"{root}/{variant}/tp{src_tp}_to_tp{tp}")
        checkpoint.save(model.sharded_state_dict(), resaved)
        dist.barrier()
        original, again = (dist_checkpointing.load_plain_tensors(d) for d in (source, resaved))
        identical = original.keys() == again.keys() and all(
            torch.equal(original[k], again[k]) for k in original
        )
        results[variant] = dict(before=before, after=after, identical=identical,
                                keys=sorted(k for k in original if "linear_qkv.weight" in k))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory, _worker_pools):
    """(root, logits_at(tp)): every variant saved at TP tp, once, on 4 ranks, when first asked."""
    from tests.distributed import WorkerPool

    root = str(tmp_path_factory.mktemp("reshard"))
    logits = {}

    def logits_at(tp):
        if tp not in logits:
            pool = _worker_pools.get(4)
            if pool is None or not pool.alive:
                pool = _worker_pools[4] = WorkerPool(4)
            logits[tp] = pool.run(_save_variants, tp, root, timeout=600)[0]
        return logits[tp]

    return root, logits_at


@pytest.mark.parametrize("src_tp, dst_tp", [
    (1, 2), pytest.param(2, 1, marks=pytest.mark.smoke), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_reshard_keeps_logits_and_tensors(run_distributed, saved, src_tp, dst_tp):
    root, logits_at = saved
    per_rank = run_distributed(_load_compare_resave, dst_tp, root, src_tp, logits_at(src_tp),
                               world_size=4, timeout=600)
    for rank, results in enumerate(per_rank):
        for variant, r in results.items():
            assert r["before"] > 1e-3, (rank, variant)  # a fresh model really differs
            assert r["after"] <= TOL, (rank, variant, r)
            assert r["identical"], (rank, variant)
            # The upstream (dev) keys: QKV and gate blocks saved separately.
            assert r["keys"] == ["decoder.layers.self_attention.linear_qkv.weight._gate",
                                 "decoder.layers.self_attention.linear_qkv.weight._qkv"]
