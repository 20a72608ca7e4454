"""Upstream Megatron-LM dev's side of test_upstream_dev_interchange.py.

Runs under ``python -m torch.distributed.run --nproc_per_node=4`` in the environment that
``scripts/setup_upstream_dev.sh`` builds: megatron-core is upstream's dev branch with its native
``head_wise_attn_gate`` (``TransformerConfig(head_wise_attn_gate=True)``, its own local GPT layer
spec and ``SelfAttention``, which adds the gate rows itself). Nothing of mcore_ext is imported.

For every TP size and variant, on 4 gloo ranks (data-parallel size 4 / TP):

1. build upstream's gated GPTModel, give its heads distinct gates, record its logits, save it ->
   ``<root>/dev/<variant>/tp<tp>`` (mcore_ext loads these afterwards);
2. for every source TP, load mcore_ext's checkpoint ``<root>/ours/<variant>/tp<src>`` into a
   fresh model (strict: every key on both sides), gather its global [QKV; Gate] rows and compare
   them with the checkpoint's, compare its logits with the ones mcore_ext computed
   (``<root>/ours_logits.pt``), save it again -> ``<root>/ours_to_dev/<variant>/tp<src>_to_tp<tp>``
   and compare that with the original bit for bit.

Rank 0 writes ``<root>/dev_results.pt``: upstream's logits and the figures of every load.
"""

import argparse
import contextlib
import datetime
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

import interchange_case as case


def adapt_to_cpu():
    """The CUDA assumptions this script's megatron calls hit on a CPU-only machine.

    (mcore_ext has its own version in ``mcore_ext/_cpu_compat.py``; this side stays independent of
    mcore_ext.) Dropout is 0 here, so the model-parallel RNG stream never draws and a tracker
    whose fork does nothing is exact.
    """
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"  # used as a device: RoPE, memory buffer, ckpt
    torch.cuda.synchronize = lambda device=None: None  # dist-checkpoint save

    class NoDropoutRngTracker:
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

    mcore_random._CUDA_RNG_STATE_TRACKER = NoDropoutRngTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def build_gpt(tp, variant, seed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**case.MODEL, **case.VARIANTS[variant],
                               tensor_model_parallel_size=tp, head_wise_attn_gate=True)
    torch.manual_seed(seed)  # use_cpu_initialization: one master weight, split by rank
    model = GPTModel(config, get_gpt_layer_local_spec(), **case.GPT)
    attention = model.decoder.layers[0].self_attention
    assert type(attention) is SelfAttention, type(attention)  # upstream's own, not a subclass
    heads, groups = config.num_attention_heads, config.num_query_groups
    rows = ((heads + 2 * groups) * config.kv_channels + heads) // tp
    assert attention.linear_qkv.weight.shape[0] == rows, (attention.linear_qkv.weight.shape, rows)
    return model.eval()


def logits_of(model):
    tokens, positions = case.tokens_and_positions()
    with torch.no_grad():
        # An explicit causal mask: upstream's default one is built on "cuda".
        return model(tokens, positions, case.causal_mask())


def run(root):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ours_logits = torch.load(f"{root}/ours_logits.pt")
    results = dict(logits={}, loads={})
    heads = case.MODEL["num_attention_heads"]
    for tp in case.TP_SIZES:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        for variant in case.VARIANTS:
            model = build_gpt(tp, variant, seed=200 + tp)
            fresh = logits_of(model)
            case.set_distinct_gates_(model, heads, seed=200)
            results["logits"][(variant, tp)] = logits_of(model)
            own_dir = case.checkpoint_dir(root, "dev", variant, tp)
            _make_dir(own_dir)
            dist_checkpointing.save(model.sharded_state_dict(), own_dir)
            _log(f"TP {tp} {variant}: saved {own_dir}")

            for src_tp in case.TP_SIZES:
                source = case.checkpoint_dir(root, "ours", variant, src_tp)
                model = build_gpt(tp, variant, seed=200 + tp)
                state = dist_checkpointing.load(model.sharded_state_dict(), source,
                                                strict=StrictHandling.RAISE_ALL)
                model.load_state_dict(state)
                expected = ours_logits[(variant, src_tp)]
                figures = case.check_load(model, source, heads, logits_of, expected, fresh)
                resaved = case.resave_dir(root, "ours_to_dev", variant, src_tp, tp)
                _make_dir(resaved)
                dist_checkpointing.save(model.sharded_state_dict(), resaved)
                dist.barrier()
                figures["resave"] = case.compare_checkpoints(source, resaved)
                results["loads"][(variant, src_tp, tp)] = figures
                _log(f"TP {src_tp} -> {tp} {variant}: {figures}")
        parallel_state.destroy_model_parallel()
    return results


def _log(message):
    if dist.get_rank() == 0:
        print(f"[dev_driver] {message}", flush=True)


def _make_dir(path):
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the test's checkpoint directory")
    root = parser.parse_args().root
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    adapt_to_cpu()
    import megatron.core

    try:
        results = run(root)
    except BaseException:
        # Exit now: the other ranks wait in a collective, and torchrun stops them when one fails.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    results["megatron_core"] = dict(version=megatron.core.__version__, file=megatron.core.__file__)
    if dist.get_rank() == 0:
        torch.save(results, f"{root}/dev_results.pt")
    dist.barrier()
    # Skip interpreter teardown: dist-checkpoint save leaves a multiprocessing Manager running.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":  # dist-checkpoint save starts a spawn-context Manager
    main()
