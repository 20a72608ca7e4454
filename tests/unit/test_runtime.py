"""init_parallel / destroy_parallel on CPU gloo ranks, and a quiet import."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests import builders


def _gpt_forward_backward_then_reinit():
    """TP=2 GPTModel forward + backward, then tear down and run again at TP=1 in one process."""
    import mcore_ext
    from megatron.core import parallel_state

    results = []
    for tp in (2, 1):
        mcore_ext.init_parallel(tensor_model_parallel_size=tp)
        config = builders.gated_config(hidden_size=64, num_attention_heads=4,
                                       tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
        model = builders.build_gpt(config)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(tokens, torch.arange(16).expand_as(tokens), None, labels=tokens).mean()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        results.append(dict(
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            loss=loss.item(),
            all_grads=all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                          for g in grads),
        ))
        mcore_ext.destroy_parallel()
        assert not parallel_state.model_parallel_is_initialized()
    return results


def test_tp2_gpt_forward_backward_and_reinit_at_tp1(run_distributed):
    rank0, rank1 = run_distributed(_gpt_forward_backward_then_reinit, world_size=2)
    for results in (rank0, rank1):
        assert [r["tp"] for r in results] == [2, 1]
        assert all(r["all_grads"] for r in results)
    assert rank0[0]["loss"] == rank1[0]["loss"]  # TP ranks compute one loss


def _init_destroy_cycles():
    import os

    import mcore_ext
    import torch.distributed as dist

    after = []
    for tp in (2, 1, 2, 1):
        mcore_ext.init_parallel(tensor_model_parallel_size=tp)
        mcore_ext.destroy_parallel()
        after.append((len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))))
    return after


def test_destroy_parallel_frees_megatrons_process_groups(run_distributed):
    """megatron's destroy only drops references; ~20 groups with 3 gloo threads each would pile up
    in a process that initializes repeatedly (as test workers and notebooks do)."""
    for after in run_distributed(_init_destroy_cycles, world_size=2):
        groups, threads = zip(*after)
        assert len(set(groups)) == 1 and max(threads) - min(threads) <= 2, after


def _model_cycles():
    import os

    import mcore_ext
    import torch.distributed as dist

    after = []
    for tp, cp in ((2, 1), (1, 2), (2, 1), (1, 2)):
        mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        config = builders.gated_config(hidden_size=64, num_attention_heads=4,
                                       tensor_model_parallel_size=tp, context_parallel_size=cp)
        tokens = torch.zeros(1, 16 // cp, dtype=torch.long)
        model = builders.build_gpt(config)
        model(tokens, torch.arange(16 // cp).expand_as(tokens), None, labels=tokens).sum().backward()
        del model
        mcore_ext.destroy_parallel()
        after.append((len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))))
    return after


def test_destroy_parallel_frees_the_groups_a_model_and_megatrons_leftovers_hold(run_distributed):
    """Training steps at TP 2 and CP 2, re-initialized in between. A destroyed gloo group lives on,
    with a thread that polls while idle, as long as something references it: megatron's
    RotaryEmbedding.forward cache holds each model it ran (and its CP group), and
    destroy_model_parallel leaves its intra-partial data-parallel groups set. A test worker had
    accumulated ~80 such threads, a fifth of a core spent while idle."""
    for after in run_distributed(_model_cycles, world_size=2):
        groups, threads = zip(*after)
        assert len(set(groups)) == 1 and max(threads) - min(threads) <= 2, after


def _bad_layout():
    import mcore_ext

    try:
        mcore_ext.init_parallel(tensor_model_parallel_size=4)
    except ValueError as error:
        return str(error)


def test_layout_that_does_not_divide_world_size_is_rejected(run_distributed):
    for message in run_distributed(_bad_layout, world_size=2):
        assert "world size 2 is not divisible by tensor_model_parallel_size (4)" in message


def test_import_prints_nothing():
    result = subprocess.run([sys.executable, "-c", "import mcore_ext"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0
    assert result.stdout == "" and result.stderr == "", result.stderr


def test_backend_choice_is_explicit():
    import mcore_ext
    from mcore_ext.specs import transformer_engine_available

    Backend = mcore_ext.AttentionBackend
    has_te = importlib.util.find_spec("transformer_engine") is not None
    assert transformer_engine_available() is has_te
    # auto: Transformer Engine only on a GPU with TE installed, SDPA everywhere else.
    expected_auto = Backend.TE if torch.cuda.is_available() and has_te else Backend.SDPA
    assert mcore_ext.resolve_backend("auto") is expected_auto
    assert mcore_ext.resolve_backend("sdpa") is Backend.SDPA
    assert mcore_ext.resolve_backend("local") is Backend.LOCAL
    with pytest.raises(ValueError, match=r"backend='flash' is not one of 'auto', 'sdpa'"):
        mcore_ext.resolve_backend("flash")
    if has_te:
        assert mcore_ext.resolve_backend("te") is Backend.TE
    else:
        with pytest.raises(ImportError, match="backend='te' needs Transformer Engine"):
            mcore_ext.resolve_backend("te")


def test_backend_resolution_follows_what_is_installed(monkeypatch):
    """Both branches on any machine: TE present or absent, GPU present or absent."""
    import mcore_ext
    from mcore_ext import specs

    Backend = mcore_ext.AttentionBackend
    for has_te in (True, False):
        for on_gpu in (True, False):
            monkeypatch.setattr(specs, "transformer_engine_available", lambda: has_te)
            monkeypatch.setattr(specs.torch.cuda, "is_available", lambda: on_gpu)
            auto = Backend.TE if has_te and on_gpu else Backend.SDPA
            assert specs.resolve_backend("auto") is auto, (has_te, on_gpu)
            if has_te:
                assert specs.resolve_backend("te") is Backend.TE
            else:
                with pytest.raises(ImportError, match="pip install 'mcore_ext\\[te\\]'"):
                    specs.resolve_backend("te")
